"""Benchmark reports: `report.json` + PNG plots in an output folder, and a Markdown summary across folders.

Schema ``redwood.bench/1`` (every field except ``schema`` and ``runs`` may be missing)::

    {
      "schema": "redwood.bench/1",
      "kind": "ar" | "standalone" | "selfspec" | "sequoia" | ...,   # which benchmark produced it
      "title": "free text",                                          # optional
      "environment": {                                               # environment_info(), added if absent
        "hostname", "platform", "machine", "cpu_count", "python", "torch", "transformers", "redwood",
        "cpu_kernel",                                                # kquant's build: "avx512" | "avx2" | ... | null
        "cuda_available", "cuda_version", "device_count", "device_name", "devices": [...], "timestamp"
      },
      "models": {"target": "name or path", "draft": "...", "dtype": "bfloat16", ...},
      "config": {...},               # settings shared by every run: dataset, max_new_tokens, seed, temperature …
      "runs": [                      # one entry per measured configuration
        {
          # configuration (any scalars; the well-known ones are used as plot axes):
          "label": "optional display name",
          "method": "ar" | "standalone" | ..., "batch_size": 8, "prefix_len": 4096, "gamma": 3,
          "tree_size": 64, "draft": "...",
          # measurements:
          "tokens_per_s": 123.4,         # generated tokens per second (all rows of the batch together)
          "speedup": 1.8,                # tokens_per_s over the autoregressive baseline's
          "acceptance_rate": 0.71,       # accepted / drafted tokens
          "mean_accepted_length": 3.9,   # tokens per verification step, the correction/bonus token included
          "acceptance_by_position": [0.9, 0.8, ...],  # fraction of steps whose draft token i was accepted
          "tokens_per_step": 3.9,        # tokens emitted per target forward pass
          "peak_memory_bytes": 1234567,
          "per_prompt": [{"id": ..., "tokens": ..., "seconds": ..., "tokens_per_s": ..., ...}, ...]
        }
      ],
      "aggregate": {"speedup": ..., "tokens_per_s": ..., ...},   # summary over runs (free form, scalars)
      "plots": ["speedup_vs_batch_size.png", ...]                 # written by write_report
    }

`write_report(out_dir, report)` fills in ``schema`` / ``environment``, draws the plots the data allows
(see `redwood.bench.plots`) and writes ``report.json``. `render_markdown(dirs)` compares report folders
side by side; `redwood bench report DIR [DIR…] [--output FILE.md]` prints or writes it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from redwood.errors import RedwoodError

SCHEMA = "redwood.bench/1"
REPORT_FILE = "report.json"

# run fields shown as configuration columns (in this order, when present), and as measurement columns
CONFIG_KEYS = (
    "label",
    "method",
    "dataset",
    "batch_size",
    "prefix_len",
    "context_len",
    "gamma",
    "tree_size",
    "draft",
    "budget",
    "temperature",
    "max_new_tokens",
)
METRIC_KEYS = (
    "tokens_per_s",
    "speedup",
    "acceptance_rate",
    "mean_accepted_length",
    "tokens_per_step",
    "latency_ms_per_token",
    "peak_memory_bytes",
)
_LIST_KEYS = ("acceptance_by_position", "per_prompt")


class ReportError(RedwoodError):
    """A report folder that is missing or holds no readable report.json."""


# ----------------------------------------------------------------------------------------- environment
def environment_info(execution=None) -> dict[str, Any]:
    """Machine and software facts for a report: host, platform, CPUs, Python / torch versions, the CPU kernels'
    build (`cpu_kernel`: kquant.chosen()), GPU, time, and the settings a number was measured with: the
    `ExecutionConfig` (`execution`; None: the defaults) and redwood's settings from the environment
    (`envs.describe()`; the home folder, a path, left out)."""
    import redwood
    from redwood import envs
    from redwood.config import ExecutionConfig

    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "redwood": getattr(redwood, "__version__", None),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "execution": (execution or ExecutionConfig()).to_dict(),
            **{name: value for name, value, _ in envs.describe() if name != envs.HOME},
        },
    }
    try:
        import torch
    except ImportError:
        info["torch"] = None
    else:
        info["torch"] = torch.__version__
        from redwood.cpu_kernels import kquant
        from redwood.errors import ConfigError

        try:
            info["cpu_kernel"] = kquant.chosen()  # the kquant build this process ran (None: none used yet)
        except ConfigError:  # (an invalid REDWOOD_CPU_KERNEL: settings shows it)
            info["cpu_kernel"] = None
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["cuda_version"] = torch.version.cuda
        if info["cuda_available"]:
            count = torch.cuda.device_count()
            info["device_count"] = count
            info["devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
            info["device_name"] = info["devices"][0] if count else None
        else:
            info["device_count"] = 0
            info["device_name"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


# ------------------------------------------------------------------------------------------ write/read
def _jsonable(x: Any) -> Any:
    """numpy / torch scalars and arrays, Paths, tuples, dataclasses → plain JSON; NaN/inf → None."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist"):  # numpy / torch scalar or array
        return _jsonable(x.tolist())
    if hasattr(x, "item"):
        return _jsonable(x.item())
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict

        return _jsonable(asdict(x))
    return str(x)


def write_report(out_dir: str | Path, report: dict) -> Path:
    """Write `report.json` (schema above) and its plots into `out_dir`; return the report.json path.

    ``schema`` and ``environment`` are filled in when missing; ``plots`` lists the PNGs written.
    """
    from redwood.bench import plots

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create report folder {out}: {e}") from None
    data = _jsonable(dict(report))
    data.setdefault("schema", SCHEMA)
    data.setdefault("environment", environment_info())
    data.setdefault("runs", [])
    data["plots"] = plots.write_plots(out, data)
    path = out / REPORT_FILE
    tmp = out / (REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def read_report(path: str | Path) -> dict:
    """The report in folder `path` (or the report.json at `path`)."""
    p = Path(path)
    if not p.exists():
        raise ReportError(f"no report folder {p}")
    if p.is_dir():
        p = p / REPORT_FILE
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ReportError(f"no {REPORT_FILE} in {p.parent}") from None
    except (OSError, ValueError) as e:
        raise ReportError(f"{p} is not a readable report: {e}") from None
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("redwood.bench/"):
        raise ReportError(
            f"{p} is not a redwood benchmark report (schema {data.get('schema')!r})"
            if isinstance(data, dict)
            else f"{p} is not a redwood benchmark report"
        )
    return data


# ------------------------------------------------------------------------------------------- markdown
def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if key == "peak_memory_bytes" and isinstance(v, (int, float)):
        return f"{v / 2**30:.2f} GiB"
    if key in ("acceptance_rate",) and isinstance(v, float):
        return f"{v:.3f}"
    if key == "speedup" and isinstance(v, (int, float)):
        return f"{v:.2f}x"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)[:40]
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _run_columns(runs: list[dict]) -> tuple[list[str], list[str]]:
    present = {k for r in runs for k, v in r.items() if v is not None and k not in _LIST_KEYS}
    config = [k for k in CONFIG_KEYS if k in present]
    metrics = [k for k in METRIC_KEYS if k in present]
    extra = sorted(
        k for k in present - set(config) - set(metrics) if all(not isinstance(r.get(k), (list, dict)) for r in runs)
    )
    return config + extra, metrics


def _report_name(d: Path, data: dict) -> str:
    return data.get("title") or d.name or str(d)


def _link(target: Path, base: Path | None) -> str:
    if base is None:
        return target.as_posix()
    try:
        return Path(os.path.relpath(target.resolve(), base.resolve())).as_posix()
    except ValueError:  # another drive on Windows
        return target.resolve().as_posix()


def render_markdown(dirs: Sequence[str | Path], base: str | Path | None = None) -> str:
    """A Markdown summary of the report folders `dirs`: environment, per-run tables, aggregates, plots.

    With several folders their runs share one table (a ``report`` column tells them apart) and the
    aggregates sit side by side. Image links are relative to `base` (the folder of the Markdown file),
    else as given.
    """
    if not dirs:
        raise ReportError("no report folders given")
    reports = [(Path(d), read_report(d)) for d in dirs]
    names = [_report_name(d, data) for d, data in reports]
    if len(set(names)) < len(names):
        names = [str(d) for d, _ in reports]
    base_p = Path(base) if base is not None else None
    out = ["# Benchmark report" + ("s" if len(reports) > 1 else ""), ""]

    # overview: one row per report
    rows = []
    for name, (_, data) in zip(names, reports):
        env, models = data.get("environment") or {}, data.get("models") or {}
        device = env.get("device_name") or (f"CPU ×{env['cpu_count']}" if env.get("cpu_count") else "–")
        rows.append(
            [
                name,
                _fmt("kind", data.get("kind")),
                _fmt("", models.get("target")),
                _fmt("", models.get("draft")),
                device,
                _fmt("", env.get("torch")),
                _fmt("", env.get("hostname")),
                _fmt("", env.get("timestamp")),
                str(len(data.get("runs") or [])),
            ]
        )
    out += [
        "## Overview",
        "",
        _table(["report", "kind", "target", "draft", "device", "torch", "host", "time", "runs"], rows),
        "",
    ]

    # shared configuration, side by side
    cfg_keys = sorted({k for _, data in reports for k in (data.get("config") or {})})
    if cfg_keys:
        rows = [[k] + [_fmt(k, (data.get("config") or {}).get(k)) for _, data in reports] for k in cfg_keys]
        out += ["## Configuration", "", _table(["setting"] + names, rows), ""]

    # runs: one table across all reports
    all_runs = [(name, r) for name, (_, data) in zip(names, reports) for r in (data.get("runs") or [])]
    if all_runs:
        config_cols, metric_cols = _run_columns([r for _, r in all_runs])
        header = (["report"] if len(reports) > 1 else []) + config_cols + metric_cols
        rows = [
            ([name] if len(reports) > 1 else []) + [_fmt(k, r.get(k)) for k in config_cols + metric_cols]
            for name, r in all_runs
        ]
        out += ["## Runs", "", _table(header, rows), ""]

        with_pos = [(name, r) for name, r in all_runs if r.get("acceptance_by_position")]
        if with_pos:
            width = max(len(r["acceptance_by_position"]) for _, r in with_pos)
            width = min(width, 16)
            header = (["report"] if len(reports) > 1 else []) + config_cols + [f"p{i + 1}" for i in range(width)]
            rows = []
            for name, r in with_pos:
                acc = list(r["acceptance_by_position"])[:width]
                rows.append(
                    ([name] if len(reports) > 1 else [])
                    + [_fmt(k, r.get(k)) for k in config_cols]
                    + [f"{a:.2f}" if isinstance(a, (int, float)) else "–" for a in acc]
                    + [""] * (width - len(acc))
                )
            out += ["## Acceptance by position", "", _table(header, rows), ""]

    # aggregates side by side
    agg_keys = [k for k in METRIC_KEYS if any(k in (data.get("aggregate") or {}) for _, data in reports)]
    agg_keys += sorted(
        {
            k
            for _, data in reports
            for k, v in (data.get("aggregate") or {}).items()
            if k not in agg_keys and not isinstance(v, (list, dict))
        }
    )
    if agg_keys:
        rows = [[k] + [_fmt(k, (data.get("aggregate") or {}).get(k)) for _, data in reports] for k in agg_keys]
        out += ["## Aggregate", "", _table(["metric"] + names, rows), ""]

    # plots
    plot_lines = []
    for name, (d, data) in zip(names, reports):
        pngs = [p for p in (data.get("plots") or []) if (d / p).is_file()]
        if pngs:
            plot_lines += [f"### {name}", ""]
            for p in pngs:
                title = Path(p).stem.replace("_", " ")
                plot_lines += [f"![{title}]({_link(d / p, base_p)})", ""]
    if plot_lines:
        out += ["## Plots", ""] + plot_lines
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------- CLI
def add_report_parser(bench_subparsers) -> None:
    """Add `report DIR [DIR…] [--output FILE.md]` to the subparsers of `redwood bench`."""
    p = bench_subparsers.add_parser(
        "report",
        help="summarize benchmark report folders as Markdown",
        description="Render report folders written by `redwood bench … --output DIR` as one Markdown "
        "summary: runs side by side in tables, with links to their plots.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="report folders (each holding report.json)")
    p.add_argument("--output", "-o", metavar="FILE.md", help="write the Markdown here instead of stdout")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args) -> int:
    if args.output:
        out = Path(args.output)
        md = render_markdown(args.dirs, base=out.parent)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(md)
        except OSError as e:
            raise ReportError(f"cannot write {out}: {e}") from None
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(render_markdown(args.dirs))
    return 0
