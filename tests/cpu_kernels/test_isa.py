"""redwood.cpu_kernels.isa: REDWOOD_CPU_ISA caps the CPU features every capability probe sees, so one machine
answers them as an AVX2-only CPU (or one without AVX) would: the kquant kernel's AVX2 (portable) build, no exact
w8a8."""

from __future__ import annotations

import pytest

from redwood import envs
from redwood.cpu_kernels import isa, kquant
from redwood.models import cpu_weights


def test_the_caps_drop_avx512_vnni_and_amx_or_every_avx_flag(monkeypatch):
    monkeypatch.setattr(
        isa,
        "_host_flags",
        lambda: frozenset({"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile"}),
    )
    isa._flags.cache_clear()
    try:
        monkeypatch.delenv(envs.CPU_ISA, raising=False)
        assert "avx512_vnni" in isa.cpu_flags() and isa.allows("avx512_vnni") and isa.capped() is None
        monkeypatch.setenv(envs.CPU_ISA, "avx2")
        assert isa.cpu_flags() == {"sse2", "avx", "avx2", "fma", "f16c"}
        assert not isa.allows("avx512_vnni") and isa.allows("avx2") and isa.capped() == "avx2"
        monkeypatch.setenv(envs.CPU_ISA, "portable")
        assert isa.cpu_flags() == {"sse2"} and not isa.allows("avx2") and isa.capped() == "portable"
    finally:
        isa._flags.cache_clear()


@pytest.mark.parametrize("cap", ["avx2", "portable"])
def test_capped_probes_answer_as_a_smaller_cpu(monkeypatch, cap):
    monkeypatch.setenv(envs.CPU_ISA, cap)
    monkeypatch.delenv(envs.CPU_KERNEL, raising=False)
    monkeypatch.setattr(cpu_weights, "_W8A8_EXACT", [])
    if kquant.variant_unavailable(cap):
        pytest.skip(f"the {cap} kquant build cannot run here: {kquant.variant_unavailable(cap)}")
    assert kquant.variant() == cap and kquant.available()
    assert not cpu_weights.w8a8_exact()
    assert cpu_weights.gguf_default() == "kquant" and cpu_weights.gguf_default(draft=True) == "q4k"


def test_the_flags_come_from_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd asimddp lrcpc\nCPU implementer\t: 0x41\n")
    assert isa._host_flags(str(x86)) == {"fpu", "sse2", "avx2", "fma"}
    assert isa._host_flags(str(arm)) == {"fp", "asimd", "asimddp", "lrcpc"}
    assert isa._host_flags(str(tmp_path / "missing")) == frozenset()
