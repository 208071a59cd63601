"""PNG plots for benchmark reports (matplotlib, Agg backend); each drawn only when the runs support it.

- ``speedup_vs_batch_size.png``: speedup over batch size (≥ 2 batch sizes), one line per other setting;
- ``speedup_vs_context_length.png``: speedup over prefix / context length (≥ 2 lengths);
- ``acceptance_by_position.png``: per-position acceptance of each run that reports it;
- ``tokens_per_step_vs_tree_size.png``: tokens per target step over tree size (≥ 2 sizes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# settings that tell series apart on a plot (besides the plot's x axis)
SERIES_KEYS = (
    "method",
    "dataset",
    "draft",
    "batch_size",
    "prefix_len",
    "context_len",
    "gamma",
    "tree_size",
    "budget",
    "temperature",
)
_CONTEXT_KEYS = ("prefix_len", "context_len")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _varying(runs: list[dict], exclude: tuple[str, ...]) -> list[str]:
    keys = []
    for k in SERIES_KEYS:
        if k in exclude:
            continue
        values = {repr(r.get(k)) for r in runs}
        if len(values) > 1:
            keys.append(k)
    return keys


def _label(run: dict, keys: list[str]) -> str:
    parts = [f"{k}={run.get(k)}" for k in keys if run.get(k) is not None]
    return ", ".join(parts)


def _series(runs: list[dict], x: str, y: str) -> list[tuple[str, list[float], list[float]]]:
    pts = [r for r in runs if _num(r.get(x)) and _num(r.get(y))]
    if len({r[x] for r in pts}) < 2:
        return []
    keys = _varying(pts, (x,) + (_CONTEXT_KEYS if x in _CONTEXT_KEYS else ()))
    groups: dict[str, list[dict]] = {}
    for r in pts:
        groups.setdefault(_label(r, keys), []).append(r)
    out = []
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: r[x])
        out.append((label, [r[x] for r in rs], [r[y] for r in rs]))
    return out


def _figure():
    """A figure on the Agg canvas, without pyplot (no global backend state, no GUI)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, ax, path: Path, legend: bool) -> None:
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _line_plot(
    path: Path, series, xlabel: str, ylabel: str, title: str, *, unity: bool = False, log2x: bool = False
) -> bool:
    if not series:
        return False
    fig, ax = _figure()
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o", label=label or None)
    if unity:
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    xs_all = [v for _, xs, _ in series for v in xs]
    if log2x and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 4:
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.set_xscale("log", base=2)
        ticks = sorted(set(xs_all))
        if len(ticks) <= 12:
            ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _save(fig, ax, path, legend=any(label for label, _, _ in series))
    return True


def _acceptance_plot(path: Path, runs: list[dict], max_lines: int = 12) -> bool:
    rows = [
        r
        for r in runs
        if isinstance(r.get("acceptance_by_position"), list) and any(_num(a) for a in r["acceptance_by_position"])
    ][:max_lines]
    if not rows:
        return False
    keys = _varying(rows, ())
    fig, ax = _figure()
    for i, r in enumerate(rows):
        acc = [a if _num(a) else float("nan") for a in r["acceptance_by_position"]]
        label = r.get("label") or _label(r, keys) or f"run {i + 1}"
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=label)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title("Acceptance by position")
    _save(fig, ax, path, legend=True)
    return True


def write_plots(out_dir: str | Path, report: dict) -> list[str]:
    """Draw every plot the report's runs support into `out_dir`; return the file names written."""
    out = Path(out_dir)
    runs = [r for r in (report.get("runs") or []) if isinstance(r, dict)]
    written = []
    if _line_plot(
        out / "speedup_vs_batch_size.png",
        _series(runs, "batch_size", "speedup"),
        "batch size",
        "speedup over autoregressive",
        "Speedup vs batch size",
        unity=True,
        log2x=True,
    ):
        written.append("speedup_vs_batch_size.png")
    ctx = next((k for k in _CONTEXT_KEYS if len({r.get(k) for r in runs if _num(r.get(k))}) > 1), None)
    if ctx and _line_plot(
        out / "speedup_vs_context_length.png",
        _series(runs, ctx, "speedup"),
        "context length (tokens)",
        "speedup over autoregressive",
        "Speedup vs context length",
        unity=True,
        log2x=True,
    ):
        written.append("speedup_vs_context_length.png")
    if _acceptance_plot(out / "acceptance_by_position.png", runs):
        written.append("acceptance_by_position.png")
    if _line_plot(
        out / "tokens_per_step_vs_tree_size.png",
        _series(runs, "tree_size", "tokens_per_step"),
        "tree size (tokens verified per step)",
        "tokens per step",
        "Tokens per step vs tree size",
        log2x=True,
    ):
        written.append("tokens_per_step_vs_tree_size.png")
    return written
