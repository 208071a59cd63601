"""A real `redwood serve` in a subprocess, for tests (import `start_server` from other test packages).

    server = start_server(["--model", str(model_dir), "--max-num-seqs", "8"])
    ... server.url ...          # http://127.0.0.1:PORT, /health already answered 200
    server.stop()               # SIGTERM, then wait (kill after `timeout`); → the exit status

The server binds 127.0.0.1 on a free port (--port 0: it prints the port in its "serving … on URL" line,
so there is no race for a port picked beforehand). Its output is collected in `server.log()`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"^serving .* on (http://\S+)$")


class ServerProcess:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            m = READY.match(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # (the process ended)

    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not self._ready.wait(timeout) or self.url is None:
            raise RuntimeError(f"redwood serve did not start (exit {self.proc.poll()}):\n{self.log()[-4000:]}")
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"redwood serve's /health never answered 200:\n{self.log()[-4000:]}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30) -> int:
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            self._reader.join(timeout=5)


def start_server(
    flags: list[str],
    timeout: float = 120,
    env: dict | None = None,
    new_session: bool = False,
    launcher: list[str] | None = None,
) -> ServerProcess:
    """`redwood serve --host 127.0.0.1 --port 0 FLAGS` (FLAGS must include --model); → once /health is 200.
    new_session: the server leads a process group of its own (a test can signal it and its children together,
    as a terminal's Ctrl-C does). launcher: what runs `-m redwood serve …` instead of `python -m redwood.cli`
    (e.g. `python -m torch.distributed.run --nproc_per_node 2`)."""
    child_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), child_env.get("PYTHONPATH")]))
    child_env.update(env or {})
    head = [sys.executable, "-m", "redwood.cli"] if launcher is None else [*launcher, "-m", "redwood"]
    cmd = [*head, "serve", "--host", "127.0.0.1", "--port", "0", *flags]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=child_env,
        start_new_session=new_session,
    )
    server = ServerProcess(proc)
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop(timeout=10)
        raise
    return server
