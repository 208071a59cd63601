"""`redwood serve --tensor-parallel-size 2` (a real subprocess on a free 127.0.0.1 port, /health answered) gives the
official `openai` client the greedy text one process gives — completions and streamed chat, requests at once
(continuous batching over both ranks) — and when a rank is killed the server exits non-zero within seconds with a
line naming it. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from redwood import LLM, SamplingParams
from tests.serve.server_process import start_server

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of", "for i in range(10):"]
N = 24
NAME = "tiny"


def spawned_ranks(pid: int) -> list[int]:
    """The pids of the ranks server `pid` spawned (multiprocessing's spawned children, not its resource tracker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                out.append(int(child))
    return out


def completes_through(client, send_signal) -> None:
    """A 200-token request runs; `send_signal()` then reaches the server, which drains: the request completes."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            client.completions.create,
            model=NAME,
            prompt=PROMPTS[0],
            max_tokens=200,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        time.sleep(0.5)  # (the request is running)
        send_signal()
        assert running.result(timeout=60).usage.completion_tokens == 200


def test_tp2_server_answers_the_openai_client_like_one_process_and_exits_when_a_rank_dies(folders):
    target, draft = folders
    one = LLM(str(target), max_num_seqs=4)
    greedy = SamplingParams(max_new_tokens=N, ignore_eos=True)
    want = [o.text for o in one.generate(PROMPTS, greedy)]
    want_chat = one.generate([PROMPTS[1]], greedy, chat=True)[0].text
    flags = ["--model", str(target), "--served-model-name", NAME, "--max-num-seqs", "4", "--tensor-parallel-size", "2"]
    flags += ["--draft-model", str(draft), "--gamma", "3"]  # (a draft chain: the draft sharded too)
    server = start_server(flags, timeout=120, env={"REDWOOD_TP_TIMEOUT": "20"})
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0) as client:

            def complete(prompt: str) -> str:
                r = client.completions.create(
                    model=NAME, prompt=prompt, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
                )
                return r.choices[0].text

            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # (at once: the rows batch on both ranks)
                assert list(pool.map(complete, PROMPTS)) == want
            stream = client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": PROMPTS[1]}],
                max_tokens=N,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat
        # rank 1 killed while the server idles: it exits non-zero within seconds, naming the rank
        [rank1] = spawned_ranks(server.proc.pid)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        code = server.wait(timeout=20)
        assert time.monotonic() - t0 < 15
        assert code != 0
        assert f"tensor-parallel rank 1 (pid {rank1}) died (killed by SIGKILL)" in server.log(), server.log()[-2000:]
    finally:
        server.stop(timeout=20)


def test_ctrl_c_drains_the_tp2_server_then_every_rank_ends_cleanly(folders):
    """A terminal's Ctrl-C reaches every process of the group at once: rank 1 leaves it to rank 0, which drains
    (the running request completes), releases rank 1 and exits 0."""
    from redwood.parallel.group import pid_alive

    target, _ = folders
    flags = ["--model", str(target), "--served-model-name", NAME, "--tensor-parallel-size", "2"]
    server = start_server(flags, timeout=120, env={"REDWOOD_TP_TIMEOUT": "20"}, new_session=True)
    try:
        [rank1] = spawned_ranks(server.proc.pid)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0) as client:
            completes_through(client, lambda: os.killpg(server.proc.pid, signal.SIGINT))
        assert server.wait(timeout=30) == 0, server.log()[-2000:]
        deadline = time.monotonic() + 10
        while pid_alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(rank1)
        assert "died" not in server.log(), server.log()[-2000:]
    finally:
        server.stop(timeout=20)


def test_torchrun_serve_answers_like_one_process_and_drains_on_sigterm(folders):
    """`torchrun --nproc_per_node 2 -m redwood serve …`: torchrun's processes are the ranks (rank 0 serves HTTP,
    rank 1 replays its engine); the client gets one process's greedy text; torchrun's SIGTERM (it forwards it to
    both ranks) drains rank 0 — the running request completes — and every rank ends cleanly (torchrun itself then
    exits 1 with its SignalException: its own way of ending on a signal)."""
    target, _ = folders
    one = LLM(str(target), max_num_seqs=2)
    want = one.generate([PROMPTS[2]], SamplingParams(max_new_tokens=N, ignore_eos=True))[0].text
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    flags = ["--model", str(target), "--served-model-name", NAME, "--max-num-seqs", "2"]
    server = start_server(flags, timeout=120, env={"REDWOOD_TP_TIMEOUT": "20"}, launcher=launcher)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0) as client:
            r = client.completions.create(
                model=NAME, prompt=PROMPTS[2], max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.choices[0].text == want
            # (torchrun forwards SIGTERM to both ranks)
            completes_through(client, lambda: server.proc.send_signal(signal.SIGTERM))
        server.wait(timeout=30)
        log = server.log()
        assert "Application shutdown complete" in log and "SignalException" in log, log[-2000:]
        assert "terminate called" not in log and "died" not in log, log[-2000:]  # (rank 0 ends without teardown)
    finally:
        server.stop(timeout=20)
