"""The engine thread under load: 32 concurrent streaming clients on 16 slots, a third of them gone
mid-stream. The others get exactly the offline text; the gone ones are aborted at the next step, so
afterwards /metrics shows nothing running and no KV block in use, and the server is still up."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai

from redwood import LLM, SamplingParams
from tests.serve.conftest import API_KEY, MODEL_NAME

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Paris is the capital of",
    "for i in range(10):",
    "Speculative decoding",
    "Rome is",
    "print(i * i)",
    "The lazy dog",
]
N = 40
N_CANCELLED = 200  # (long enough that the client is gone before the engine could finish it)


def metric(text: str, name: str) -> float:
    """The value of redwood:NAME in a /metrics text, summed over its label sets."""
    values = re.findall(rf"^redwood:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def test_concurrent_streams_with_cancellations(server, tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=N, ignore_eos=True))]

    async def client_task(c, i):
        cancel = i % 3 == 0
        stream = await c.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=N_CANCELLED if cancel else N,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, chunks = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            chunks += 1
            if cancel and chunks == 3:  # this client goes away mid-stream
                await stream.close()
                return None
        return text

    before = httpx.get(server.url + "/metrics", timeout=10).text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=90, max_retries=0) as c:
            return await asyncio.gather(*(client_task(c, i) for i in range(32)))

    got = asyncio.run(asyncio.wait_for(main(), 150))
    for i, text in enumerate(got):
        if i % 3:
            assert text == want[i % len(PROMPTS)], i
        else:
            assert text is None
    deadline = time.monotonic() + 20
    while True:  # (the aborts land at the engine's next step boundary)
        m = httpx.get(server.url + "/metrics", timeout=10).text
        idle = (metric(m, "num_requests_running"), metric(m, "num_requests_waiting"), metric(m, "kv_blocks_used"))
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle == (0, 0, 0)
    assert metric(m, "kv_blocks_free") > 0
    assert server.alive

    def grew(name):
        return metric(m, name) - metric(before, name)

    # the cancelled requests were cut short (not run to their N tokens) and are not successes
    assert grew("request_success_total") == 21
    assert 21 * N < grew("generation_tokens_total") < 21 * N + 11 * N_CANCELLED
    assert grew("time_to_first_token_seconds_count") == 32
    assert grew("e2e_request_latency_seconds_count") == 21
