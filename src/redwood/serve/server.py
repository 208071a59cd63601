"""uvicorn's server with a draining shutdown and redwood's ready line.

uvicorn on SIGTERM closes its sockets, waits for open responses and then re-raises the signal (the
process dies of it). Here the first SIGTERM / SIGINT only starts draining: the app answers 503 to new
requests while the engine finishes the running ones; once none is left in flight uvicorn's normal
shutdown runs (the streams end, the engine thread stops) and `run` returns, so the process exits 0.
A second SIGINT forces the exit.
"""

from __future__ import annotations

import logging
import signal

import uvicorn

log = logging.getLogger("redwood.serve")


class DrainingServer(uvicorn.Server):
    """state: the app's ServeState (its draining flag and engine loop). banner: the ready line's start
    ("serving NAME"); " on http://HOST:PORT" is added once the socket listens (the real port for 0)."""

    def __init__(self, config: uvicorn.Config, state, banner: str):
        super().__init__(config)
        self.state, self.banner = state, banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            print(f"{self.banner} on http://{host}:{port}", flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.state.draining:
            self.state.draining = True
            log.info(
                "%s: draining — new requests get 503; %d running request(s) finish first",
                signal.Signals(sig).name,
                self.state.loop.in_flight,
            )
        elif sig == signal.SIGINT:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.state.loop.fatal is not None:  # (a tensor-parallel rank died: `redwood serve` exits with its error)
            self.force_exit = True
            return True
        if self.state.draining and self.state.loop.in_flight == 0:
            return True
        return await super().on_tick(counter)
