"""`redwood serve`'s OpenAI API through the official `openai` client (sync and async), against a real
server process: the text equals offline `LLM.generate` of the same model, token for token."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from redwood import LLM, SamplingParams
from tests.serve.conftest import API_KEY, MODEL_NAME

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of", "for i in range(10):"]
N = 24  # generated tokens per request


@pytest.fixture(scope="module")
def client(server_url):
    with openai.OpenAI(base_url=server_url + "/v1", api_key=API_KEY, timeout=60, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir))


def greedy(llm, prompt, n=N, chat=False, **kw):
    return llm.generate([prompt], SamplingParams(max_new_tokens=n, **kw), chat=chat)[0]


def test_completions_match_offline_generate(client, offline):
    for prompt in PROMPTS[:2]:
        want = greedy(offline, prompt, ignore_eos=True)
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.object == "text_completion" and r.model == MODEL_NAME
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), N)
        assert r.usage.total_tokens == r.usage.prompt_tokens + N
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=N,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_matches_offline_generate_with_the_template(client, offline):
    want = greedy(offline, "hello there", chat=True)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello there"}], max_completion_tokens=N, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=N,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_chat_takes_the_whole_conversation(client, offline):
    """System + user + assistant + user messages go through the template (not just the last message)."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "and print?"},
    ]
    ids = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = greedy(offline, list(ids))
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids)


def test_stream_usage_chunk(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert all(c.usage is None for c in body)


def test_stop_strings_end_the_text_before_them(client, offline):
    full = greedy(offline, PROMPTS[2], ignore_eos=True).text
    stop = full[6:9]
    assert stop and full.find(stop) > 0
    want = full[: full.find(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[2],
            max_tokens=N,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_seeds(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0, n=3, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1  # greedy: all the same
    assert r.usage.completion_tokens == 24

    def sample(seed, n):
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=1.0,
            n=n,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    a = sample(7, 2)
    assert sample(7, 2) == a  # reproducible
    assert sample(8, 1) == a[1:]  # choice i is seeded seed + i
    assert len({*a, *sample(9, 1)}) > 1  # (and seeds matter)


def test_n_choices_stream(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            n=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.add(choice.index)
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]


def test_logprobs_in_each_endpoints_format(client, offline):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for tok in content:
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # greedy picks the most likely token: it is the first alternative, with the same logprob
        assert tok.token == tok.top_logprobs[0].token and tok.logprob == pytest.approx(tops[0])
        assert tok.logprob <= 0 and bytes(tok.bytes).decode("utf-8", "replace") == tok.token
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert all(x <= 0 for x in lp.token_logprobs)
    streamed = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            max_tokens=6,
            temperature=0,
            logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert [
        v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ] == pytest.approx(lp.token_logprobs)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None  # off unless asked


def test_async_client_concurrent_requests(server_url, offline):
    async def main():
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key=API_KEY, timeout=60, max_retries=0) as c:

            async def one(prompt):
                r = await c.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
                )
                return r.choices[0].text

            async def streamed(prompt):
                s = await c.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=N,
                    temperature=0,
                    stream=True,
                )
                return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

            return await asyncio.gather(*(one(p) for p in PROMPTS), *(streamed(p) for p in PROMPTS))

    got = asyncio.run(asyncio.wait_for(main(), 120))
    assert got[:4] == [greedy(offline, p, ignore_eos=True).text for p in PROMPTS]
    assert got[4:] == [greedy(offline, p, chat=True).text for p in PROMPTS]


def test_models_health_metrics_and_page(server_url, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    health = httpx.get(server_url + "/health", timeout=10)  # (open without the key)
    assert health.status_code == 200
    metrics = httpx.get(server_url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "redwood:num_requests_running" in metrics.text
    assert httpx.get(server_url + "/speculation", timeout=10).json() == {"policy": "off"}  # (no drafter)
    page = httpx.get(server_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<html" in page.text.lower()


def test_stats_extension_without_speculation(server_url):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(
        server_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    ).json()
    assert "redwood" not in plain  # off unless asked
    stats = httpx.post(
        server_url + "/v1/completions",
        json={**body, "redwood": {"stats": True}},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()["redwood"]
    assert stats["acceptance_rate"] is None and stats["drafted"] is None and stats["tokens_per_s"] > 0


def test_a_full_context_is_length_on_the_wire_and_context_in_the_extension(server_url):
    """No max_tokens, a prompt 4 tokens short of the context: OpenAI's "length" (it has no other value),
    the Engine's "context" in the `redwood` extension; a max_tokens limit stays "length" in both."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    card = httpx.get(f"{server_url}/v1/models/{MODEL_NAME}", headers=headers, timeout=10).json()
    prompt = [5 + i % 200 for i in range(card["max_model_len"] - 4)]  # (token ids)
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": None,
        "temperature": 0,
        "ignore_eos": True,
        "redwood": {"stats": True},
    }
    r = httpx.post(server_url + "/v1/completions", json=body, headers=headers, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 4
    assert r["redwood"]["finish_reasons"] == ["context"]
    with httpx.stream(
        "POST", server_url + "/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["redwood"]["finish_reason"] == "context"
    limited = httpx.post(
        server_url + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers, timeout=60
    ).json()
    assert limited["choices"][0]["finish_reason"] == "length" and limited["redwood"]["finish_reasons"] == ["length"]
