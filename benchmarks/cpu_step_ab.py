"""Before / after side by side in one run (docs/perf/cpu.md session 14): the 1.5B gguf target's decode on the
CPU from two source trees of redwood — `git archive REV src` (before) and this checkout's src (after) — step by
step in turn, and llama.cpp's llama-bench on the same file between blocks.

Usage: PYTHONPATH=src python benchmarks/cpu_step_ab.py [--before REV] [--threads 1 2] [--rounds 2] [--steps 24]
    [--ops model engine spec] [--llama-bench PATH|none] [--output runs.json]

Why step by step: this 2-core VM's speed drifts by ±15% over minutes with the host's load (the same code measured
172 and 223 ms a step half an hour apart), more than the change measured. So each tree runs in its own process
(both loaded, one idle while the other works), and the parent alternates single steps between them — before,
after, after, before, … — so a drift lands on both alike. Ops (one step each): `model` — a decode step through
the model directly (dense cache, greedy, after the 128-token code prompt; a new prefill every 64 steps, not
timed); `engine` — one Engine.step of AR decoding (paged cache; requests of 64 tokens on the code prompt and
the main job's chat prompt in turn; their prefill steps not timed); `spec` — the same with the int4 0.5B draft
(γ 3 chain). Per (tree, threads, op): tokens / seconds over all its timed steps, and whether the two trees
generated the same tokens. llama-bench: tg64 after a 128-token context (-d 128), -r 2, once per round and thread
count while both trees wait. The load average is printed with every block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def worker(ops: list[str]) -> None:
    """Serve one step per stdin line ({"op", "threads"}) → one stdout line {"s": seconds, "tokens": [...]}."""
    import torch
    from cpu_spec import CHAT
    from cpu_weights import held_out_texts

    from redwood import Engine, SamplingParams
    from redwood.engine.tokenization import encode_prompt
    from redwood.kv.policies import FullPolicy
    from redwood.loading import load_model
    from redwood.speculation.drafters import ModelDrafter
    from redwood.speculation.trees import Tree

    target = load_model(TARGET, weights="gguf")
    m = target.model
    code = held_out_texts(target.tokenizer, 1024)["code"][:128]
    prompts = [code, encode_prompt(target.tokenizer, CHAT, chat=True)]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    engines = {}
    if "engine" in ops:
        engines["engine"] = Engine.build(m, target.tokenizer, max_num_seqs=1, max_model_len=512)
    if "spec" in ops:
        draft = load_model(DRAFT, weights="int4")
        engines["spec"] = Engine.build(
            m,
            target.tokenizer,
            max_num_seqs=1,
            max_model_len=512,
            tree=Tree.chain(3),
            drafter=ModelDrafter(draft.model, FullPolicy(), target.config.vocab_size),
        )
    served = {name: 0 for name in engines}
    state = {}

    def prefill():
        c = m.new_cache(1, 128 + 65)
        lg = m(torch.tensor([code]), torch.arange(128)[None], c, logits_at=torch.tensor([[127]]))
        c.commit(128)
        state.update(cache=c, pos=128, tok=int(lg[0, -1].argmax()))

    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        torch.set_num_threads(req["threads"])
        op = req["op"]
        with torch.inference_mode():
            if op == "model":
                if not state or state["pos"] >= 128 + 64:
                    prefill()
                t0 = time.perf_counter()
                lg = m(torch.tensor([[state["tok"]]]), torch.tensor([[state["pos"]]]), state["cache"])
                state["cache"].commit(1)
                tok = int(lg[0, -1].argmax())
                dt = time.perf_counter() - t0
                state.update(pos=state["pos"] + 1, tok=tok)
                out = [tok]
            else:
                e = engines[op]
                if not e.has_unfinished():
                    e.add_request(prompts[served[op] % 2], params)
                    served[op] += 1
                    e.step()  # the prefill (and the first token): not timed
                t0 = time.perf_counter()
                out = [t for d in e.step() for t in d.token_ids]
                dt = time.perf_counter() - t0
        print(json.dumps({"s": dt, "tokens": out}), flush=True)


def llama_bench(path: str, threads: int) -> float:
    gguf = next(
        (Path(os.environ.get("REDWOOD_HOME", Path.home() / ".cache/redwood")) / "models" / TARGET).glob("*.gguf")
    )
    res = subprocess.run(
        [path, "-m", str(gguf), "-p", "0", "-n", "64", "-d", "128", "-t", str(threads), "-r", "2", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(res.stdout)[0]["avg_ts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="HEAD")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per tree, op, thread count and round")
    ap.add_argument("--ops", nargs="+", default=["model", "engine", "spec"], choices=["model", "engine", "spec"])
    default_lb = (
        Path(os.environ.get("REDWOOD_HOME", Path.home() / ".cache/redwood")) / "bench/llama.cpp/build/bin/llama-bench"
    )
    ap.add_argument("--llama-bench", default=str(default_lb) if default_lb.exists() else "none")
    ap.add_argument("--output")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.ops)
    tmp = Path(tempfile.mkdtemp(prefix="redwood-ab-"))
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", args.before, "src"], capture_output=True, check=True
    ).stdout
    (tmp / "src.tar").write_bytes(archive)
    with tarfile.open(tmp / "src.tar") as t:
        t.extractall(tmp / "before", filter="data")
    rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", args.before], capture_output=True, text=True
    ).stdout.strip()
    trees = {f"before ({rev})": tmp / "before" / "src", "after (checkout)": REPO / "src"}
    procs = {}
    for name, src in trees.items():
        env = dict(os.environ, PYTHONPATH=f"{src}:{REPO / 'benchmarks'}")
        procs[name] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", "--ops", *args.ops],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
    for name, p in procs.items():
        while (line := p.stdout.readline()) and line.strip() != "ready":
            pass
        if not line:
            sys.exit(f"{name} did not start")
    print(f"both trees loaded; load average {os.getloadavg()[0]:.2f}", flush=True)
    names = list(trees)
    steps = {}  # (tree, threads, op) → [(seconds, tokens)]
    lc = {n: [] for n in args.threads}
    loads = []
    for r in range(args.rounds):
        for n in args.threads if r % 2 == 0 else args.threads[::-1]:
            for op in args.ops:
                for i in range(args.steps):
                    for name in names if i % 2 == 0 else names[::-1]:
                        procs[name].stdin.write(json.dumps({"op": op, "threads": n}) + "\n")
                        reply = json.loads(procs[name].stdout.readline())
                        steps.setdefault((name, n, op), []).append((reply["s"], reply["tokens"]))
                loads.append(os.getloadavg()[0])
                print(
                    f"round {r}, {n} thread(s), {op}: "
                    + ", ".join(
                        f"{name} {sum(len(t) for _, t in steps[(name, n, op)][-args.steps :]) / sum(s for s, _ in steps[(name, n, op)][-args.steps :]):.2f} tok/s"
                        for name in names
                    )
                    + f"  (load {loads[-1]:.2f})",
                    flush=True,
                )
            if args.llama_bench != "none":
                lc[n].append(llama_bench(args.llama_bench, n))
                print(
                    f"round {r}, {n} thread(s), llama.cpp tg64 @ d128: {lc[n][-1]:.2f} tok/s  (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    for p in procs.values():
        p.stdin.close()
        p.wait()
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {"steps": {f"{k[0]}|{k[1]}|{k[2]}": v for k, v in steps.items()}, "llama.cpp": lc, "loads": loads}
            )
        )
    have_lc = args.llama_bench != "none"
    print(
        f"\nload average over the blocks {min(loads):.2f}–{max(loads):.2f}; {args.rounds} rounds × {args.steps} steps "
        "per tree, op and thread count, single steps alternating between the trees"
    )
    print(
        "| threads | op | "
        + " | ".join(f"{x} tok/s (median step ms)" for x in names)
        + " | after / before | tokens equal |"
        + (" llama.cpp tg64 @ d128 tok/s | after / llama.cpp |" if have_lc else "")
    )
    print("|---|---|" + "---|" * (len(names) + 2) + ("---|---|" if have_lc else ""))
    for n in args.threads:
        for op in args.ops:
            cells, rates = [], []
            for name in names:
                v = steps[(name, n, op)]
                rates.append(sum(len(t) for _, t in v) / sum(s for s, _ in v))
                cells.append(f"{rates[-1]:.2f} ({statistics.median(s for s, _ in v) * 1e3:.1f})")
            same = [t for _, t in steps[(names[0], n, op)]] == [t for _, t in steps[(names[1], n, op)]]
            tail = ""
            if have_lc:
                med = statistics.median(lc[n])
                tail = f" {'/'.join(f'{x:.2f}' for x in lc[n])} | {rates[1] / med:.2f} |" if op != "spec" else " | |"
            print(f"| {n} | {op} | " + " | ".join(cells) + f" | {rates[1] / rates[0]:.3f} | {same} |" + tail)


if __name__ == "__main__":
    main()
