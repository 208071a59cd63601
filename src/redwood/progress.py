"""Progress of long work on stderr: a tqdm bar on a terminal, plain log lines otherwise (a log file or a
pipe gets a line every LOG_EVERY_S seconds, not carriage-return redraws). Work that ends within
`delay` seconds shows nothing, so quick runs and tests stay quiet.

    with Progress(total=28, desc="loading qwen2.5-coder-1.5b-instruct", unit="layer") as bar:
        for layer in layers:
            ...
            bar.update()
"""

from __future__ import annotations

import sys
import time

LOG_EVERY_S = 5.0  # log lines: at most one per this many seconds (and the last one)
DEFAULT_DELAY_S = 1.0

_quiet = False  # set by `set_quiet` (the CLI's --quiet): no progress anywhere in the process


def set_quiet(quiet: bool = True) -> None:
    global _quiet
    _quiet = bool(quiet)


def note(message: str, stream=None) -> None:
    """One line about long work (a calibration, a cache rebuilt) on stderr, unless the process is quiet."""
    if not _quiet:
        print(message, file=sys.stderr if stream is None else stream, flush=True)


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """Counts `total` units of work (see the module docstring). unit "B": counts bytes, shown in MB /
    GB. `stream`: where to write (stderr); `enabled`: False shows nothing (nor after `set_quiet`)."""

    def __init__(
        self, total: int, desc: str, unit: str = "it", delay: float = DEFAULT_DELAY_S, enabled: bool = True, stream=None
    ):
        self.total, self.desc, self.unit, self.delay = max(int(total), 0), desc, unit, delay
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and not _quiet
        self.n = 0
        self.t0 = time.perf_counter()
        self._last_log = None  # when the last log line was written (None: none yet)
        self._bar = None
        if self.enabled and _isatty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                desc=desc,
                unit=unit,
                unit_scale=unit == "B",
                delay=delay,
                file=self.stream,
                leave=False,
                dynamic_ncols=True,
            )

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        elapsed = now - self.t0
        if elapsed < self.delay:
            return
        if self._last_log is None or now - self._last_log >= LOG_EVERY_S or self.n >= self.total:
            self._last_log = now
            self._log(elapsed)

    def _log(self, elapsed: float) -> None:
        if self.unit == "B":
            line = f"{self.desc}: {self.n / 1e6:.0f}/{self.total / 1e6:.0f} MB"
        else:
            line = f"{self.desc}: {self.n}/{self.total} {self.unit}"
        if self.total:
            line += f" ({100 * self.n / self.total:.0f}%), {_fmt_s(elapsed)}"
            if 0 < self.n < self.total:
                line += f", ~{_fmt_s(elapsed * (self.total - self.n) / self.n)} left"
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
