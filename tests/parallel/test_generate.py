"""Greedy decoding under tensor parallelism equals one process's, token for token, on a tiny clear-margin model
(float32, gloo, 2 ranks): through `LLM(tensor_parallel_size=2)` (this test's subprocess is rank 0 and spawns rank
1), `redwood generate --tensor-parallel-size 2` and `torchrun --nproc_per_node 2 -m redwood generate`. A rank
killed mid-run ends every rank within seconds with a line naming it; bad input is one line before any rank
starts. Every subprocess is bounded in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from redwood import LLM, SamplingParams
from redwood.parallel.group import pid_alive
from redwood.speculation.config import SpeculativeConfig
from tests.parallel.ranks import subprocess_env

PROMPTS = [[5, 17, 3, 99, 42], [250, 11, 64, 8, 1, 33, 90, 12, 77], [7, 7, 7]]
MAX_NEW = 24

LLM_SCRIPT = """
import json, sys
from redwood import LLM, SamplingParams
from redwood.speculation.config import SpeculativeConfig
target, draft, mode, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
spec = {
    "ar": None,
    "chain-draft": SpeculativeConfig(draft_model=draft, num_draft_tokens=3),
    "chain-draft-replicated": SpeculativeConfig(draft_model=draft, num_draft_tokens=3, draft_tensor_parallel="replicate"),
    "auto": SpeculativeConfig(policy="auto", draft_model=draft),
    "chain-draft-subset": SpeculativeConfig(draft_model=draft, num_draft_tokens=3, draft_tensor_parallel=1),
    "auto-subset": SpeculativeConfig(policy="auto", draft_model=draft, draft_tensor_parallel=1),
}[mode]
llm = LLM(target, tensor_parallel_size=2, speculative=spec, max_num_seqs=2)
outs = llm.generate(prompts, SamplingParams(max_new_tokens=int(sys.argv[5]), ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
extra = {}
if mode.startswith("auto"):
    extra["plans"] = llm.engine.policy.report()["plans"]
if mode in ("chain-draft-replicated", "chain-draft-subset", "auto-subset"):
    drafter = llm.drafter  # (the model drafter: the fixed plan's, or the first of the auto policy's)
    extra["draft"] = {"whole": drafter.own_model.shard is None, "replicas": drafter.replicas.world}
print(json.dumps(extra))
"""

KILL_SCRIPT = """
import json, sys
from redwood import LLM, SamplingParams
from redwood.errors import RedwoodError
llm = LLM(sys.argv[1], tensor_parallel_size=2)
print(json.dumps({"rank1": llm.tp.procs[1].pid}), flush=True)
try:
    while True:
        llm.generate([[5, 6, 7], [9, 9]], SamplingParams(max_new_tokens=64, ignore_eos=True))
except RedwoodError as e:
    print(f"redwood: error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def _run(args: list[str], timeout: float = 90, **env) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=subprocess_env(**env))


def _tp1(folder, draft=None) -> list[list[int]]:
    spec = None if draft is None else SpeculativeConfig(draft_model=str(draft), num_draft_tokens=3)
    llm = LLM(str(folder), speculative=spec, max_num_seqs=2)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "mode", ["ar", "chain-draft", "chain-draft-replicated", "chain-draft-subset", "auto", "auto-subset"]
)
def test_llm_greedy_tp2_equals_tp1(folders, mode, tmp_path):
    """Greedy tokens are the target's whatever the plan: TP=2 (a draft chain — the draft sharded, whole on every
    rank, or whole on rank 0 alone — or the automatic policy over the draft model and ngram — rank 0 plans from
    costs calibrated at TP=2, its plans run on both ranks) equals TP=1 autoregressive decoding (and TP=1's draft
    chain). The script is a file without an `if __name__ == "__main__"` guard: the rank redwood spawns does not
    run it again."""
    target, draft = folders
    want = _tp1(target, draft if mode.startswith("chain-draft") else None)
    args = [str(target), str(draft), mode, json.dumps(PROMPTS), str(MAX_NEW)]
    script = tmp_path / "script.py"  # (a file with no `__main__` guard: the spawned rank must not run it again)
    script.write_text(LLM_SCRIPT)
    out = _run([sys.executable, str(script), *args], REDWOOD_HOME=str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == want
    extra = json.loads(lines[-1])
    if mode in ("chain-draft-replicated", "chain-draft-subset", "auto-subset"):
        assert extra["draft"] == {"whole": True, "replicas": 2}  # (rank 0's proposals broadcast over 2 ranks)
    if mode.startswith("auto"):
        assert sum(extra["plans"].values()) > 0  # (steps were planned)
        [costs] = (tmp_path / "costs").glob("*.json")  # rank 0 saved the TP=2 calibration
        key = json.loads(costs.read_text())["key"]
        assert key["tensor_parallel"] == 2
        assert key["draft"] is not None  # (the draft's curve: calibrated on its ranks — rank 0 alone for a subset)


def _generate_args(target, *extra) -> list[str]:
    return [
        "generate",
        "--model",
        str(target),
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "20",
        "--json",
        *extra,
    ]


def test_cli_spawned_and_torchrun_equal_one_process(folders):
    target, _ = folders
    one = _run([sys.executable, "-m", "redwood", *_generate_args(target)])
    assert one.returncode == 0, one.stderr
    want = json.loads(one.stdout)["token_ids"]
    spawned = _run([sys.executable, "-m", "redwood", *_generate_args(target, "--tensor-parallel-size", "2")])
    assert spawned.returncode == 0, spawned.stderr
    assert json.loads(spawned.stdout)["token_ids"] == want
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "redwood"]
    ran = _run([*torchrun, *_generate_args(target)])
    assert ran.returncode == 0, ran.stderr
    lines = [line for line in ran.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # (rank 0 prints)
    assert json.loads(lines[0])["token_ids"] == want


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--tensor-parallel-size", "3"], "tensor_parallel_size 3 must divide the model's 4 attention heads"),
        (["--tensor-parallel-size", "2", "--offload"], "offloading streams one process's layers"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
        (
            ["--tensor-parallel-size", "2", "--draft-model", "{draft}", "--draft-tensor-parallel", "4"],
            "draft_tensor_parallel 4 is more ranks than tensor_parallel_size 2",
        ),
        (["--draft-model", "{draft}", "--draft-tensor-parallel", "half"], "unknown draft_tensor_parallel 'half'"),
    ],
)
def test_bad_input_is_one_line(folders, extra, words):
    target, draft = folders
    extra = [arg.format(draft=draft) for arg in extra]
    out = _run([sys.executable, "-m", "redwood", *_generate_args(target, *extra)], timeout=60)
    assert out.returncode == 2
    assert words in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _start_killable(target) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(REDWOOD_TP_TIMEOUT="20"),
    )
    line = proc.stdout.readline()  # (after LLM(): both ranks loaded, generation starts)
    assert line, proc.stderr.read()
    time.sleep(0.5)  # (mid-run)
    return proc, json.loads(line)["rank1"]


def test_a_killed_rank_ends_every_rank_with_its_name(folders):
    target, _ = folders
    # rank 1 killed: rank 0 stops within seconds, naming it
    proc, rank1 = _start_killable(target)
    t0 = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 15
    assert f"tensor-parallel rank 1 (pid {rank1}) died (killed by SIGKILL)" in err, err
    # rank 0 killed: rank 1 stops within seconds, naming it
    proc, rank1 = _start_killable(target)
    t0 = time.monotonic()
    proc.kill()
    _, err = proc.communicate(timeout=30)  # (rank 1 holds the same stderr: EOF once it exited too)
    assert time.monotonic() - t0 < 15
    assert not pid_alive(rank1)
    assert f"tensor-parallel rank 0 (pid {proc.pid}) died; rank 1 stops" in err, err
