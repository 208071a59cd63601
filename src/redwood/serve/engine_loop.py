"""The one thread that steps the Engine, and the asyncio handles requests read their deltas from.

The Engine is not thread-safe, so exactly one thread touches it: `EngineLoop`'s. The server's event loop
hands it commands (add a group of requests, abort one) through a queue; the thread drains that queue at
every step boundary, runs `Engine.step()`, and passes each delta to its request's `asyncio.Queue` with
`loop.call_soon_threadsafe` (one call per step). With nothing to do it sleeps on a `threading.Event`
that every command sets — it never spins.

A group (the n choices of one HTTP request) is added all or none: the first request the Engine rejects
(too long a prompt, a pool too small for it) aborts the ones added before it, and the error goes back to
the caller, who answers 400.

The loop also keeps what /metrics reads: a snapshot of running / waiting counts and KV blocks after each
step, and per-request timings (arrival, first token, each delta) that it reports to `observer` — the
`ServerMetrics` — from its own thread (prometheus-client is thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from redwood.errors import RankFailure, RedwoodError
from redwood.sampling_params import SamplingParams

log = logging.getLogger("redwood.serve")


class QueueFull(Exception):
    """More requests would wait than --max-queue allows (answered 503)."""


class EngineFailed(Exception):
    """The Engine raised inside a step; the requests it held were dropped (answered 500)."""


@dataclass
class RequestHandle:
    """One Engine request as the event loop sees it: deltas arrive on `queue`, an `EngineFailed` instance
    when the engine broke. `finished` once the last delta (finish_reason set) was queued."""

    request_id: str
    prompt_len: int
    queue: asyncio.Queue
    finished: bool = False
    started: bool = False  # (event loop) its first delta came: it no longer waits
    # (engine thread only) timings for the metrics, and the preemptions already counted
    t_arrival: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    preemptions: int = 0


@dataclass
class _Add:
    items: list[tuple[RequestHandle, list[int], SamplingParams]]
    done: asyncio.Future  # → None, or the RedwoodError that rejected the group


@dataclass
class _Report:
    done: asyncio.Future  # → the speculation report (`EngineLoop.speculation_report`)


class EngineLoop:
    """Steps `engine` on a background thread; `submit` / `abort` from the event loop.

    max_queue: most requests waiting — submitted, and no delta yet (in the command queue, or in the
    Engine's waiting queue or first prefill); `submit` raises QueueFull beyond it (None: no limit). The
    count is kept on the event loop, so admission never reads a stale snapshot. observer: an object with
    `on_request(handle, delta, now)` and `on_step(loop)` (the metrics), or None.
    """

    def __init__(self, engine, max_queue: int | None = None, observer=None):
        self.engine = engine
        self.max_queue = max_queue
        self.observer = observer
        self._commands: deque = deque()  # appended by the event loop, popped by the engine thread
        self._wake = threading.Event()
        self._stop = False
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._queued = 0  # requests submitted without a delta yet (event loop's count)
        self._in_flight = 0  # requests submitted and not finished (event loop's count)
        # snapshots the engine thread refreshes after every step (read by /metrics and admission)
        self.num_running = 0
        self.num_waiting = 0
        self.num_steps = 0
        # a tensor-parallel rank that died: the engine cannot go on, the server exits with it (`DrainingServer`)
        self.fatal: RankFailure | None = None
        # how often an idle loop asks a tensor-parallel engine whether its ranks live (None: one process)
        self._idle_check_s = 1.0 if getattr(engine, "tensor_parallel_size", 1) > 1 else None

    # ------------------------------------------------------------------ event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="redwood-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (after its current step) and wait for it."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def in_flight(self) -> int:
        """Requests submitted whose last delta has not been queued yet."""
        return self._in_flight

    async def submit(
        self, items: list[tuple[str, list[int], SamplingParams]], queue: asyncio.Queue | None = None
    ) -> list[RequestHandle]:
        """Add a group of requests (request id, prompt ids, params); → their handles, in order, all
        delivering to `queue` (default: a new one for the group).

        Raises QueueFull when the group would overflow --max-queue, or the RedwoodError with which the
        Engine rejected one of them (none of the group runs then).
        """
        if self.max_queue is not None and self._queued + len(items) > self.max_queue:
            raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
        now = time.perf_counter()
        queue = asyncio.Queue() if queue is None else queue
        handles = [RequestHandle(rid, len(ids), queue, t_arrival=now) for rid, ids, _ in items]
        done = self._loop.create_future()
        self._queued += len(items)
        self._in_flight += len(items)
        self._send(_Add([(h, ids, p) for h, (_, ids, p) in zip(handles, items)], done))
        try:
            error = await asyncio.shield(done)
        except asyncio.CancelledError:  # the caller went away before the engine took the group
            done.add_done_callback(lambda f: self._orphaned(handles, f.result()))
            raise
        if error is not None:
            self._queued -= len(items)
            self._in_flight -= len(items)
            raise error
        return handles

    async def speculation_report(self) -> dict:
        """What the engine's speculation policy holds now, read on the engine thread between two steps: the
        policy ("auto", "fixed" or "off"), under auto its report (plans, expected vs achieved tokens, the
        acceptance it plans with, realized ratios, measured / predicted step times), and `capture_s`, the seconds
        of CUDA-graph captures and kernel compiles so far (absent while none)."""
        if self.fatal is not None or self._thread is None or not self._thread.is_alive():
            raise EngineFailed("the engine is not running")
        done = self._loop.create_future()
        self._send(_Report(done))
        return await done

    def _orphaned(self, handles: list[RequestHandle], error) -> None:
        if error is None:
            for h in handles:
                self.abort(h)
        else:
            self._queued -= len(handles)
            self._in_flight -= len(handles)

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request that is still running (its client went away); its blocks are freed at the next
        step boundary. Nothing further arrives on its queue."""
        if not handle.finished:
            self._started(handle)
            handle.finished = True
            self._in_flight -= 1
            self._send(("abort", handle.request_id))

    def _started(self, handle: RequestHandle) -> None:
        if not handle.started:
            handle.started = True
            self._queued -= 1

    def _send(self, command) -> None:
        self._commands.append(command)
        self._wake.set()

    def _deliver(self, batch: list[tuple[RequestHandle, object]]) -> None:
        """(event loop) Queue one step's deltas; the one that ends a request marks it finished."""
        for handle, item in batch:
            if handle.finished:
                continue  # aborted by its client meanwhile
            self._started(handle)
            if isinstance(item, EngineFailed) or item.finish_reason is not None:
                handle.finished = True
                self._in_flight -= 1
            handle.queue.put_nowait(item)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            self._wake.clear()  # (before draining: a command sent after this wakes the next wait)
            self._drain_commands()
            try:
                if not engine.has_unfinished():
                    self._snapshot()
                    self._wake.wait(self._idle_check_s)
                    if self._idle_check_s is not None:
                        engine.check_ranks()
                    continue
                deltas = engine.step()
            except RankFailure as e:  # a tensor-parallel rank is gone: nothing can run any more
                log.error("%s", e)
                self.fatal = e
                self._fail_all(e)
                return
            except Exception as e:  # a bug in a step: drop its requests, keep serving
                log.exception("the engine failed in a step; dropping the %d requests it held", len(self._handles))
                self._fail_all(e)
                continue
            self.num_steps += 1
            now = time.perf_counter()
            batch = []
            for d in deltas:
                handle = self._handles.get(d.request_id)
                if handle is None:
                    continue  # aborted: nobody listens
                if self.observer is not None:
                    self.observer.on_request(handle, d, now)
                if d.token_ids:
                    handle.t_first = handle.t_first or now
                    handle.t_last = now
                if d.finish_reason is not None:
                    del self._handles[d.request_id]
                batch.append((handle, d))
            self._count_preemptions()
            self._snapshot()
            if batch:
                self._loop.call_soon_threadsafe(self._deliver, batch)

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Report):
                self._report(command)
            else:
                _, rid = command
                if self._handles.pop(rid, None) is not None:
                    self.engine.abort(rid, notify=False)

    def _add(self, command: _Add) -> None:
        added: list[str] = []
        error = None
        try:
            for handle, ids, params in command.items:
                self.engine.add_request(ids, params, request_id=handle.request_id)
                added.append(handle.request_id)
                self._handles[handle.request_id] = handle
        except RedwoodError as e:
            error = e
        except Exception as e:  # noqa: BLE001 — a bug; the client gets a 500, the server stays up
            log.exception("adding a request failed")
            error = EngineFailed(f"the engine could not add the request: {type(e).__name__}")
        if error is not None:
            for rid in added:
                self._handles.pop(rid, None)
                self.engine.abort(rid, notify=False)
        self._loop.call_soon_threadsafe(_resolve, command.done, error)

    def _report(self, command: _Report) -> None:
        policy = self.engine.policy
        if policy.auto:
            body = {"policy": "auto", "report": policy.report()}
        else:
            body = {"policy": "fixed" if policy.drafters else "off"}
        capture_s = self.engine.capture_s
        if capture_s:  # one-time CUDA-graph captures so far (seconds the steps' timings leave out)
            body["capture_s"] = round(capture_s, 3)
        self._loop.call_soon_threadsafe(_resolve, command.done, body)

    def _fail_all(self, error: Exception) -> None:
        failed = EngineFailed(f"the engine failed: {type(error).__name__}: {error}")
        batch = [(h, failed) for h in self._handles.values()]
        for rid in list(self._handles):
            try:
                self.engine.abort(rid, notify=False)
            except Exception:  # noqa: BLE001 — best effort on a broken engine
                log.exception("aborting %s after the failure", rid)
        self._handles.clear()
        if batch:
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _count_preemptions(self) -> None:
        if self.observer is None:
            return
        scheduler = self.engine.scheduler
        for rid, handle in self._handles.items():
            seq = scheduler.get(rid)
            if seq is not None and seq.num_preemptions > handle.preemptions:
                self.observer.on_preemptions(seq.num_preemptions - handle.preemptions)
                handle.preemptions = seq.num_preemptions

    def _snapshot(self) -> None:
        self.num_running, self.num_waiting = self.engine.num_running, self.engine.num_waiting
        if self.observer is not None:
            self.observer.on_step(self)


def _resolve(future: asyncio.Future, value) -> None:
    """(event loop) Complete a command's future with its answer — an error or None for `_Add`, the report for
    `_Report` — unless its waiter is gone."""
    if not future.done():
        future.set_result(value)
