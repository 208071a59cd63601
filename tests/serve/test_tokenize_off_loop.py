"""Prompts are encoded on the server's tokenizer pool, not on the event loop: while a slow encode runs,
the loop keeps serving (streams, /health, new requests), and several prompts encode at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from redwood.serve.app import _encode_text, _off_loop
from redwood.serve.protocol import APIError


def test_slow_encodes_run_off_the_loop_in_parallel():
    pool = ThreadPoolExecutor(2, thread_name_prefix="redwood-tokenize")
    state = SimpleNamespace(tokenize_pool=pool)
    names = []

    def slow(x):  # stands in for a long prompt's encode (the tokenizers library releases the GIL too)
        names.append(threading.current_thread().name)
        time.sleep(0.3)
        return x

    async def main():
        ticks = 0

        async def ticker():  # the loop's other work: it must keep running during the encodes
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.ensure_future(ticker())
        t0 = time.perf_counter()
        got = await asyncio.gather(_off_loop(state, slow, 1), _off_loop(state, slow, 2))
        elapsed = time.perf_counter() - t0
        tick.cancel()
        return got, elapsed, ticks

    try:
        got, elapsed, ticks = asyncio.run(main())
    finally:
        pool.shutdown()
    assert got == [1, 2]
    assert ticks >= 10  # ~30 would tick in 0.3 s; a blocked loop ticks once
    assert elapsed < 0.55  # the two ran side by side
    assert len(names) == 2 and all(n.startswith("redwood-tokenize") for n in names)


def test_errors_raised_on_the_pool_reach_the_route():
    pool = ThreadPoolExecutor(1)
    state = SimpleNamespace(tokenize_pool=pool, engine=SimpleNamespace(tokenizer=None))
    try:
        with pytest.raises(APIError, match="send the prompt as token ids"):
            asyncio.run(_off_loop(state, _encode_text, state, "hello"))
    finally:
        pool.shutdown()


def test_without_a_pool_it_runs_inline():
    state = SimpleNamespace(tokenize_pool=None)
    assert asyncio.run(_off_loop(state, lambda a, b: a + b, 2, 3)) == 5
