"""Benchmark reports: JSON round trip, plots, Markdown summary, `redwood bench report` parser."""

from __future__ import annotations

import argparse
import json

import pytest

from redwood.bench.report import (
    SCHEMA,
    ReportError,
    add_report_parser,
    environment_info,
    read_report,
    render_markdown,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sweep_report(kind="standalone", speed=1.0):
    runs = []
    for prefix_len in (1024, 4096):
        for batch in (1, 4, 16):
            runs.append(
                {
                    "method": kind,
                    "batch_size": batch,
                    "prefix_len": prefix_len,
                    "gamma": 3,
                    "tokens_per_s": 100.0 * batch * speed,
                    "speedup": speed * (1 + batch / 16 + prefix_len / 8192),
                    "acceptance_rate": 0.7,
                    "mean_accepted_length": 2.4,
                    "acceptance_by_position": [0.9, 0.75, 0.6],
                    "tokens_per_step": 3.4,
                    "peak_memory_bytes": 3 * 2**30,
                    "per_prompt": [{"id": "p0", "tokens": 64, "seconds": 0.5}],
                }
            )
    return {
        "kind": kind,
        "models": {"target": "qwen2.5-1.5b", "draft": "qwen2.5-0.5b", "dtype": "bfloat16"},
        "config": {"dataset": "essays", "max_new_tokens": 64, "seed": 0},
        "runs": runs,
        "aggregate": {"speedup": 1.5 * speed, "tokens_per_s": 420.0},
    }


def test_environment_info(monkeypatch):
    from redwood.config import ExecutionConfig

    monkeypatch.setenv("REDWOOD_HOME", "/somewhere")
    monkeypatch.setenv("REDWOOD_CPU_ISA", "avx2")
    env = environment_info(ExecutionConfig(megakernel="off"))
    for key in ("hostname", "platform", "cpu_count", "python", "torch", "timestamp", "device_name"):
        assert key in env
    assert env["cpu_count"] >= 1 and env["python"].count(".") == 2
    assert env["settings"]["execution"]["megakernel"] == "off" and "REDWOOD_HOME" not in env["settings"]
    assert env["settings"]["REDWOOD_CPU_ISA"] == "avx2"


def test_round_trip_and_plots(tmp_path):
    np = pytest.importorskip("numpy")
    report = _sweep_report()
    report["runs"][0]["tokens_per_s"] = np.float32(12.5)  # numpy scalars are accepted
    report["runs"][0]["acceptance_by_position"] = np.array([0.5, 0.25])
    report["aggregate"]["nan"] = float("nan")
    path = write_report(tmp_path / "out", report)
    assert path == tmp_path / "out" / "report.json"
    data = read_report(tmp_path / "out")
    assert data == json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["kind"] == "standalone"
    assert data["environment"]["hostname"]
    assert data["runs"][0]["tokens_per_s"] == 12.5 and data["runs"][0]["acceptance_by_position"] == [0.5, 0.25]
    assert data["runs"][1] == report["runs"][1]
    assert data["aggregate"]["nan"] is None
    assert data["models"] == report["models"] and data["config"] == report["config"]
    assert sorted(data["plots"]) == [
        "acceptance_by_position.png",
        "speedup_vs_batch_size.png",
        "speedup_vs_context_length.png",
    ]
    for name in data["plots"]:
        blob = (tmp_path / "out" / name).read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5000


def test_tree_size_plot_and_minimal_report(tmp_path):
    runs = [{"method": "sequoia", "tree_size": t, "tokens_per_step": 1 + t**0.5 / 2} for t in (8, 16, 32, 64)]
    write_report(tmp_path / "seq", {"kind": "sequoia", "runs": runs, "environment": {"hostname": "h"}})
    data = read_report(tmp_path / "seq")
    assert data["plots"] == ["tokens_per_step_vs_tree_size.png"]
    assert data["environment"] == {"hostname": "h"}  # given environment kept
    assert (tmp_path / "seq" / "tokens_per_step_vs_tree_size.png").stat().st_size > 5000

    write_report(tmp_path / "ar", {"kind": "ar", "runs": [{"batch_size": 1, "tokens_per_s": 38.5}]})
    data = read_report(tmp_path / "ar")
    assert data["plots"] == [] and not list((tmp_path / "ar").glob("*.png"))


def test_markdown_compares_reports(tmp_path):
    write_report(tmp_path / "a", _sweep_report("standalone", 1.0))
    write_report(tmp_path / "b", _sweep_report("selfspec", 2.0))
    md = render_markdown([tmp_path / "a", tmp_path / "b"], base=tmp_path)
    assert md.startswith("# Benchmark reports")
    assert "## Overview" in md and "| a | standalone | qwen2.5-1.5b | qwen2.5-0.5b |" in md
    assert "| setting | a | b |" in md and "| max_new_tokens | 64 | 64 |" in md
    header = next(line for line in md.splitlines() if line.startswith("| report | method"))
    assert header == (
        "| report | method | batch_size | prefix_len | gamma | tokens_per_s | speedup | "
        "acceptance_rate | mean_accepted_length | tokens_per_step | peak_memory_bytes |"
    )
    assert "| b | selfspec | 16 | 4096 | 3 | 3,200 | 5.00x | 0.700 | 2.4 | 3.4 | 3.00 GiB |" in md
    assert "| metric | a | b |" in md and "| speedup | 1.50x | 3.00x |" in md
    assert "## Acceptance by position" in md and "| p1 | p2 | p3 |" in md
    assert "![speedup vs batch size](a/speedup_vs_batch_size.png)" in md
    assert "![acceptance by position](b/acceptance_by_position.png)" in md
    single = render_markdown([tmp_path / "a"])
    assert single.startswith("# Benchmark report\n") and "| report | method" not in single
    assert "| method | batch_size |" in single


def test_missing_report(tmp_path):
    with pytest.raises(ReportError, match="no report.json"):
        render_markdown([tmp_path])
    (tmp_path / "report.json").write_text('{"schema": "other/1"}')
    with pytest.raises(ReportError, match="not a redwood benchmark report"):
        read_report(tmp_path)


def test_report_subcommand(tmp_path, capsys):
    write_report(tmp_path / "r1", _sweep_report())
    parser = argparse.ArgumentParser(prog="redwood bench")
    add_report_parser(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["report", str(tmp_path / "r1"), "--output", str(tmp_path / "docs" / "sum.md")])
    assert args.func(args) == 0
    md = (tmp_path / "docs" / "sum.md").read_text()
    assert "](../r1/speedup_vs_batch_size.png)" in md
    args = parser.parse_args(["report", str(tmp_path / "r1")])
    assert args.func(args) == 0
    assert "## Runs" in capsys.readouterr().out
