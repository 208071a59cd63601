"""redwood.progress: log lines off a terminal, nothing for quick work, --quiet."""

from __future__ import annotations

import io

import pytest

import redwood.progress as progress
from redwood.progress import Progress


@pytest.fixture(autouse=True)
def not_quiet():
    progress.set_quiet(False)
    yield
    progress.set_quiet(False)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_log_lines_are_throttled_and_carry_an_estimate(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    out = io.StringIO()
    bar = Progress(total=10, desc="prefill", unit="tokens", delay=1.0, stream=out)
    bar.update(1)  # within the delay: nothing
    clock.t += 2
    bar.update(1)  # 2/10 after 2 s: ~8 s left
    clock.t += 1
    bar.update(1)  # 1 s after the last line: held back
    clock.t += progress.LOG_EVERY_S
    bar.update(7)  # the last one always shows
    bar.close()
    assert out.getvalue().splitlines() == [
        "prefill: 2/10 tokens (20%), 2s, ~8s left",
        "prefill: 10/10 tokens (100%), 8s",
    ]


def test_quick_work_quiet_and_bytes(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    out = io.StringIO()
    with Progress(total=3, desc="quick", stream=out) as bar:
        bar.update(3)
    assert out.getvalue() == ""
    progress.set_quiet()
    with Progress(total=3, desc="quiet", delay=0, stream=out) as bar:
        clock.t += 10
        bar.update(3)
    assert out.getvalue() == ""
    progress.set_quiet(False)
    with Progress(total=3_000_000_000, desc="loading x.gguf", unit="B", delay=0, stream=out) as bar:
        clock.t += 90
        bar.update(1_500_000_000)
    assert out.getvalue() == "loading x.gguf: 1500/3000 MB (50%), 1m30s, ~1m30s left\n"


def test_a_terminal_gets_a_tqdm_bar():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with Progress(total=4, desc="bar", delay=0, stream=out) as bar:
        bar.update(4)
    text = out.getvalue()  # (tqdm redraws in place with carriage returns; leave=False clears it at the end)
    assert text.startswith("\rbar:") and "0/4 [" in text and "\n" not in text
