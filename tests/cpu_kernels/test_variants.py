"""Which kquant build runs (redwood.cpu_kernels.kquant): the dispatcher on faked CPU flag sets and builds (no
compiler runs: `_build` is replaced), REDWOOD_CPU_KERNEL forcing a variant, a failed build warning once and
giving way to the next; and the torch-free core (kquant.h) built without torch for every variant — run where this
CPU can, and compared bit for bit with the torch operators — and the portable core cross-built for aarch64 and run
under qemu-user, where the cross compiler and emulator are installed.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from redwood import envs
from redwood.cpu_kernels import isa, kquant
from redwood.errors import ConfigError

AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
ALDER_LAKE = AVX2 | {"avx_vnni"}
GRAVITON2 = {"fp", "asimd", "asimdhp", "asimddp", "lrcpc"}  # (ARM's Features line)


@pytest.fixture
def fake_cpu(monkeypatch):
    """fake(flags, fail=()) → the list of builds asked for: the CPU reports `flags`, and building a variant
    succeeds unless it is in `fail` (then its error is "boom <name>")."""
    built: list[str] = []

    def fake(flags, fail=()):
        monkeypatch.setattr(isa, "_host_flags", lambda: frozenset(flags))
        isa._flags.cache_clear()
        kquant._CHOICES.clear()

        def build(name):
            built.append(name)
            return f"boom {name}" if name in fail else None

        monkeypatch.setattr(kquant, "_build", build)
        monkeypatch.setattr(kquant, "_no_compiler", lambda: None)
        return built

    monkeypatch.delenv(envs.CPU_KERNEL, raising=False)
    monkeypatch.delenv(envs.CPU_ISA, raising=False)
    yield fake
    isa._flags.cache_clear()
    kquant._CHOICES.clear()


def test_auto_takes_the_fastest_build_the_cpu_runs(fake_cpu, monkeypatch):
    assert fake_cpu(AVX512) == [] and kquant.variant() == "avx512"
    assert kquant.supported() == ["avx512", "avx2", "portable"]
    fake_cpu(AVX2)
    assert kquant.variant() == "avx2" and kquant.supported() == ["avx2", "portable"]
    fake_cpu(ALDER_LAKE)  # AVX-VNNI without AVX-512: the 256-bit VNNI build
    assert kquant.variant() == "avxvnni" and kquant.supported() == ["avxvnni", "avx2", "portable"]
    fake_cpu({"sse2", "avx"})  # no AVX2
    assert kquant.variant() == "portable" and kquant.available()
    fake_cpu(GRAVITON2)  # ARM with DOTPROD; without it (ARMv8.0), or no flags read at all: portable
    assert kquant.variant() == "neon" and kquant.supported() == ["neon", "portable"]
    fake_cpu({"fp", "asimd"})
    assert kquant.variant() == "portable"
    fake_cpu(set())
    assert kquant.variant() == "portable"
    fake_cpu(AVX512 | {"avx_vnni"})  # the caps: as an AVX2-only CPU, as one without AVX
    monkeypatch.setenv(envs.CPU_ISA, "avx2")
    assert kquant.variant() == "avx2" and kquant.supported() == ["avx2", "portable"]
    monkeypatch.setenv(envs.CPU_ISA, "portable")
    assert kquant.variant() == "portable" and kquant.supported() == ["portable"]
    fake_cpu(GRAVITON2)
    assert kquant.variant() == "portable"  # (the cap: as an ARM CPU without DOTPROD)


def test_the_choice_is_made_once_and_logged(fake_cpu, caplog):
    built = fake_cpu(AVX2)
    with caplog.at_level("INFO", logger="redwood.cpu_kernels.kquant"):
        assert kquant.chosen() in (None, *kquant.VARIANTS)
        for _ in range(3):
            assert kquant.variant() == "avx2" and kquant.why_unavailable() is None
    assert built == ["avx2"] and kquant.chosen() == "avx2"
    assert [r.getMessage() for r in caplog.records] == ["CPU kernels: the avx2 build, the fastest this CPU runs"]


def test_a_setting_forces_a_build_and_one_the_cpu_lacks_is_an_error(fake_cpu, monkeypatch):
    fake_cpu(AVX512)
    for name in ("avx2", "portable", "avx512"):
        monkeypatch.setenv(envs.CPU_KERNEL, name)
        assert kquant.variant() == name
    monkeypatch.setenv(envs.CPU_KERNEL, "avxvnni")
    with pytest.raises(ConfigError, match=r"REDWOOD_CPU_KERNEL=avxvnni: this CPU lacks avx_vnni$"):
        kquant.variant()
    fake_cpu(AVX2)
    monkeypatch.setenv(envs.CPU_KERNEL, "avx512")
    with pytest.raises(ConfigError, match=r"this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni"):
        kquant.available()
    fake_cpu(AVX512)
    monkeypatch.setenv(envs.CPU_ISA, "avx2")
    with pytest.raises(ConfigError, match=r"lacks avx512f.*\(under REDWOOD_CPU_ISA=avx2\)"):
        kquant.why_unavailable()
    monkeypatch.setenv(envs.CPU_KERNEL, "sse")
    with pytest.raises(ConfigError, match="REDWOOD_CPU_KERNEL='sse' is not one of auto, avx512, avxvnni, avx2"):
        kquant.variant()


def test_a_failed_build_warns_once_and_falls_back(fake_cpu, monkeypatch):
    built = fake_cpu(AVX512, fail=("avx512",))
    with pytest.warns(UserWarning, match=r"the avx512 CPU kernel did not build \(boom avx512\); falling back to avx2"):
        assert kquant.variant() == "avx2"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kquant.variant() == "avx2" and kquant.available()
    assert built == ["avx512", "avx2"]
    built = fake_cpu(AVX512, fail=("avx512", "avx2"))
    with pytest.warns(UserWarning) as record:
        assert kquant.variant() == "portable"
    assert [str(w.message) for w in record] == [
        "the avx512 CPU kernel did not build (boom avx512); falling back to avx2",
        "the avx2 CPU kernel did not build (boom avx2); falling back to portable",
    ]
    fake_cpu(AVX2, fail=("avx2", "portable"))
    with pytest.warns(UserWarning) as record:
        assert kquant.variant() is None
    assert str(record[-1].message) == "the portable CPU kernel did not build (boom portable); no other build left"
    assert not kquant.available()
    assert kquant.why_unavailable() == "building the kernel failed (avx2: boom avx2; portable: boom portable)"
    with pytest.raises(RuntimeError, match="the kquant kernel cannot run here: building the kernel failed"):
        kquant.ops()
    # forced, a failed build is not replaced by another: unavailable, with the reason
    fake_cpu(AVX512, fail=("avx2",))
    monkeypatch.setenv(envs.CPU_KERNEL, "avx2")
    with pytest.warns(UserWarning, match=r"the avx2 CPU kernel \(forced by REDWOOD_CPU_KERNEL\) did not build"):
        assert kquant.variant() is None
    assert kquant.why_unavailable() == "building the avx2 kernel failed: boom avx2"


def test_describe_names_the_build_what_chose_it_and_what_the_cpu_runs(fake_cpu, monkeypatch):
    fake_cpu(AVX512)
    assert kquant.describe() == "CPU kernels: avx512 (auto; this CPU runs avx512, avx2, portable)"
    monkeypatch.setenv(envs.CPU_KERNEL, "avx2")
    assert kquant.describe() == "CPU kernels: avx2 (forced by REDWOOD_CPU_KERNEL; this CPU runs avx512, avx2, portable)"
    monkeypatch.setenv(envs.CPU_ISA, "avx2")
    assert kquant.describe() == (
        "CPU kernels: avx2 (forced by REDWOOD_CPU_KERNEL; this CPU runs avx2, portable under REDWOOD_CPU_ISA=avx2)"
    )
    monkeypatch.setenv(envs.CPU_KERNEL, "avx512")  # a setting the CPU lacks: the line says so, nothing raises
    assert kquant.describe().startswith("CPU kernels: none (REDWOOD_CPU_KERNEL=avx512: this CPU lacks avx512f")
    monkeypatch.delenv(envs.CPU_KERNEL)
    monkeypatch.delenv(envs.CPU_ISA)
    fake_cpu(AVX2, fail=("avx2", "portable"))
    with pytest.warns(UserWarning):
        assert kquant.describe() == (
            "CPU kernels: none (building the kernel failed (avx2: boom avx2; portable: boom portable))"
        )


def test_no_compiler_is_reported(fake_cpu, monkeypatch):
    fake_cpu(AVX512)
    monkeypatch.setattr(kquant, "_no_compiler", lambda: "no C++ compiler (install g++) to build the kernel")
    assert kquant.variant() is None and kquant.why_unavailable().startswith("no C++ compiler")
    from redwood.models import cpu_weights

    monkeypatch.setattr(cpu_weights, "_W8A8_EXACT", [False])
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler .*; CPU weights fall back to gguf"):
        assert cpu_weights.gguf_default() == "gguf"


# ------------------------------------------------------------------------------------- the core, without torch
HERE = Path(__file__).parent
CORE = Path(kquant.__file__).parent


def build_core(cxx: str, flags: list[str], exe: Path, main: str = "kq_standalone.cpp") -> Path:
    """A test program of tests/cpu_kernels (`main`: kq_standalone.cpp, the product; kq_layer_standalone.cpp, the
    layer) with kquant.cpp and layer.cpp, compiled by `cxx` with `flags` (no torch headers or libraries) into
    `exe`."""
    cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", *flags, f"-I{CORE}", f"-I{HERE}"]
    cmd += [str(CORE / "kquant.cpp"), str(CORE / "layer.cpp"), str(HERE / main), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """variant → the path of the torch-free core built under the variant's flags (`build_core`, g++), or
    pytest.skip's reason."""
    cxx = shutil.which("g++") or shutil.which("c++")
    out = tmp_path_factory.mktemp("kq_standalone")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if cxx is None:
            pytest.skip("no C++ compiler")
        if (name == "neon") != (platform.machine() in ("aarch64", "arm64")):
            pytest.skip(f"the {name} build is for another architecture than {platform.machine()}")
        if name not in built:
            built[name] = build_core(cxx, kquant.VARIANTS[name][1], out / name)
        return built[name]

    return get


def assert_core_gives_the_operators_bits(command: list[str], name: str) -> None:
    """The core run as `command` (stdin → stdout: kq_standalone.cpp) packs and multiplies random rows of every type
    as the torch operators (this process's chosen build) do, bit for bit, and names itself `name`."""
    from tests.cpu_kernels.test_kquant import activations, random_blocks

    for type_name, (type_id, _, _) in kquant.TYPES.items():
        M, N, K = 11, 37, 768 if kquant.FILE_BLOCK[type_name] == 256 else 896  # (896: padded to whole super-blocks)
        rows = random_blocks(type_name, N, K, seed=5)
        x = activations(M, K, seed=6)
        stdin = np.array([M, K, N, type_id], dtype=np.int64).tobytes() + x.numpy().tobytes() + rows.numpy().tobytes()
        r = subprocess.run(command, input=stdin, capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        line, _, rest = r.stdout.partition(b"\n")
        assert line.decode() == name
        packed = kquant.pack(rows, type_name)
        assert torch.equal(
            torch.frombuffer(bytearray(rest[: packed.numel()]), dtype=torch.uint8).view_as(packed), packed
        )
        y = torch.frombuffer(bytearray(rest[packed.numel() :]), dtype=torch.float32).view(M, N)
        assert torch.equal(y, kquant.kquant_linear(x, packed, type_name)), type_name


@pytest.mark.parametrize("name", list(kquant.VARIANTS))
def test_the_core_builds_without_torch_and_gives_the_operators_bits(standalone, name):
    """Each variant's core compiles with no torch header on the include path; where this CPU runs it, its packed
    bytes and products equal the torch operators' (the chosen build's) bit for bit. avxvnni is only built here
    unless the CPU has AVX-VNNI."""
    exe = standalone(name)
    if kquant.lacks(name):
        if name == "avxvnni":  # the VEX vpdpbusd is in the build
            dis = subprocess.run(["objdump", "-d", str(exe)], capture_output=True, text=True)
            if dis.returncode == 0:
                assert "vpdpbusd" in dis.stdout
        pytest.skip(f"built; this CPU lacks {', '.join(kquant.lacks(name))} to run it")
    if not kquant.available():
        pytest.skip(f"no torch operators to compare with: {kquant.why_unavailable()}")
    assert_core_gives_the_operators_bits([str(exe)], name)


def arm_tools() -> tuple[str, str]:
    """(the aarch64 cross compiler, qemu-aarch64), or pytest.skip."""
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        pytest.skip("no aarch64 cross compiler / qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)")
    return cxx, qemu


ARM_BUILDS = {"portable": ["-static"], "neon": ["-static", *kquant.VARIANTS["neon"][1]]}


@pytest.mark.parametrize("name", list(ARM_BUILDS))
def test_the_arm_builds_give_the_operators_bits(tmp_path, name):
    """The core cross-compiled for aarch64 (Debian's g++-aarch64-linux-gnu, static; neon with DOTPROD) and run under
    qemu-user (`qemu-aarch64 -cpu max`) packs and multiplies as this machine's operators do, bit for bit (std::fma
    is one instruction there; sdot's sums are exact). Skipped without the cross compiler and emulator."""
    cxx, qemu = arm_tools()
    if not kquant.available():
        pytest.skip(f"no torch operators to compare with: {kquant.why_unavailable()}")
    exe = build_core(cxx, ARM_BUILDS[name], tmp_path / f"kq_{name}")
    assert_core_gives_the_operators_bits([qemu, "-cpu", "max", str(exe)], name)


def test_every_build_of_the_layer_gives_the_same_bits(tmp_path):
    """tests/cpu_kernels/kq_layer_standalone.cpp (a synthetic decoder layer, 7 new tokens after 20 of context, from a
    fixed pseudo-random stream) built for every x86 variant this CPU runs and, where the tools are installed, for
    aarch64 (portable and neon, under qemu): the layer's output and KV cache are the same bytes in every build —
    norms, rotary, attention, exp, softmax tails, SiLU included, which the product alone does not reach."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    runs = {}
    for name in kquant.supported():
        exe = build_core(cxx, kquant.VARIANTS[name][1], tmp_path / f"layer_{name}", "kq_layer_standalone.cpp")
        runs[name] = [str(exe), "7"]
    if shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64"):
        cxx_arm, qemu = arm_tools()
        for name, flags in ARM_BUILDS.items():
            exe = build_core(cxx_arm, flags, tmp_path / f"layer_arm_{name}", "kq_layer_standalone.cpp")
            runs[f"arm {name}"] = [qemu, "-cpu", "max", str(exe), "7"]
    outs = {}
    for key, cmd in runs.items():
        r = subprocess.run(cmd, capture_output=True, timeout=300)
        assert r.returncode == 0, (key, r.stderr[-2000:])
        line, _, outs[key] = r.stdout.partition(b"\n")
        assert line.decode() == key.split()[-1]
    first = next(iter(outs))
    x = np.frombuffer(outs[first][: 7 * 256 * 4], dtype=np.float32)
    assert np.isfinite(x).all() and len(outs) >= 2, list(outs)
    for key, out in outs.items():
        assert out == outs[first], (key, first)
