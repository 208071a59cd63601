"""dieharder on RowRandom's 32-bit words, laid out as the engine reads them (issue 16, item 3).

Every uniform RowRandom draws comes from a 32-bit hash word h of its (row keys, counter, lane, element)
(float32: h's top 24 bits; float64: h, then the top 21 bits of a second word h2 of the same position).
This script writes those words, as raw little-endian uint32, in the orders in which a consumer sees
them, and pipes each stream into dieharder (Debian: `apt-get install -y dieharder`):

  counters  one row (seed S), lane 0, element 0, counter 0, 1, 2, … — successive draws of a row
  rows      seeds 0, 1, 2, …, counter S, lane 0, element 0 — one element across the rows of a batch
  lanes     one row (seed S), counter 0, lanes 0, 1, 2, … — the items (nodes) of one row in one draw
  elements  one row (seed S), counter 0, lane 0, elements 0, 1, 2, … — the elements of one item
  chain     one row (seed S), the exact word order of chain speculation with γ = 3: per step three
            draft draws (`uniform(rows, (1,))`, one word each) then the verifier's
            `uniform(rows, (4,))` (three acceptance tests, then the correction / bonus draw)
  low       the h2 words of `elements` (whose top 21 bits end float64 uniforms)

S is the dieharder test's index in the list below, so every test reads fresh words of the same layout.
The words come from a transcription of `RowRandom.uniform` into C (compiled with `cc -O2` on first
use: dieharder reads billions of words, too many to draw through torch one row at a time); at start its
output is checked word for word against RowRandom itself (float64 uniforms' top 32 bits, float32
uniforms' 24 bits; float64 uniforms' low 21 bits for `low`) on every stream, and the script stops if
they differ (RowRandom changed: update EMITTER_C).

    ./.venv/bin/python benchmarks/random_battery.py --out benchmarks/results/random-battery
    ./.venv/bin/python benchmarks/random_battery.py --emit elements --seed 0 | dieharder -g 200 -d 0

Writes <out>/dieharder-<stream>.txt (dieharder's own lines), <out>/run.json (command, time) and
<out>/summary.md (PASSED / WEAK / FAILED per stream and test; `--resummarize` rebuilds it from the others). dieharder's WEAK is p < 0.005 or p > 0.995 and FAILED p < 1e-6 or p > 1 − 1e-6 per
result, so about 1 in 100 results reads WEAK for a perfect generator; with `-Y 1` (resolve ambiguity)
dieharder adds p-samples to a WEAK result until it reads PASSED or FAILED.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from redwood.sample.random import RowRandom

STREAMS = ("counters", "rows", "lanes", "elements", "chain", "low")
GAMMA = 3

# (dieharder -d, -n) pairs: what `dieharder -a` runs, except diehard_sums ("do not use") and the
# lagged sums at lags 4-5, 7-14, 16-32 (lag n reads (n + 1)× the words: the whole set takes ~30 min
# per stream on one core); lag 6 is the chain stream's period (7 words per step).
TESTS = (
    tuple((d, None) for d in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 17, 100, 101, 102))
    + tuple((200, n) for n in range(1, 13))
    + tuple((201, n) for n in range(2, 6))
    + tuple((202, n) for n in range(2, 6))
    + tuple((203, n) for n in (0, 1, 2, 3, 6, 15))
    + tuple((d, None) for d in (204, 205, 206, 207, 208, 209))
)


EMITTER_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x5BD1E995u; return x ^ (x >> 16);
}
typedef struct { uint32_t k0, k1; } key_t2;
typedef struct { uint32_t x, y; } item_t2;
static inline key_t2 key_of(uint64_t s) {
    uint32_t hi = (uint32_t)(s >> 32), lo = (uint32_t)s;
    key_t2 k = {mix32(mix32(hi ^ 0x2545F491u) ^ lo), mix32(mix32(lo ^ 0x6C8E9CF5u) ^ hi)};
    return k;
}
static inline item_t2 item_of(key_t2 k, uint32_t counter, uint32_t lane) {
    item_t2 it = {mix32(mix32(k.k0 ^ counter) ^ lane), mix32(mix32(k.k1 ^ counter) ^ (lane * 0x9E3779B9u))};
    return it;
}
/* h: a uniform's high 32 bits (float32: its top 24); h2: the word whose top 21 bits end a float64 */
static inline uint32_t word(item_t2 it, uint32_t e) { return mix32(mix32(it.x ^ e) ^ it.y); }
static inline uint32_t low_word(item_t2 it, uint32_t e) { return mix32(mix32(it.y ^ e) ^ it.x); }
int main(int argc, char **argv) {
    const char *stream = argv[1];
    uint64_t seed = strtoull(argv[2], 0, 10), limit = argc > 3 ? strtoull(argv[3], 0, 10) : UINT64_MAX;
    int kind = !strcmp(stream, "counters") ? 0 : !strcmp(stream, "rows") ? 1 : !strcmp(stream, "lanes") ? 2
             : !strcmp(stream, "elements") ? 3 : !strcmp(stream, "chain") ? 4 : !strcmp(stream, "low") ? 5 : -1;
    if (kind < 0) return 2;
    const uint32_t gamma = GAMMA, per = 2 * GAMMA + 1;
    key_t2 key = key_of(seed);
    item_t2 item0 = item_of(key, 0, 0);
    uint32_t buf[1 << 14];
    for (uint64_t i = 0; i < limit;) {
        size_t n = 0;
        for (; n < sizeof buf / 4 && i < limit; n++, i++) {
            uint32_t w;
            switch (kind) {
            case 0: w = word(item_of(key, (uint32_t)i, 0), 0); break;
            case 1: w = word(item_of(key_of(i), (uint32_t)seed, 0), 0); break;
            case 2: w = word(item_of(key, 0, (uint32_t)i), 0); break;
            case 3: w = word(item0, (uint32_t)i); break;
            case 5: w = low_word(item0, (uint32_t)i); break;
            default: {  /* chain: γ draft draws (one element each), then the verify draw's γ + 1 elements */
                uint64_t step = i / per; uint32_t pos = (uint32_t)(i % per);
                uint32_t counter = (uint32_t)(step * (gamma + 1)) + (pos < gamma ? pos : gamma);
                w = word(item_of(key, counter, 0), pos < gamma ? 0 : pos - gamma);
            }
            }
            buf[n] = w;
        }
        if (fwrite(buf, 4, n, stdout) != n) return 0;  /* the reader is done */
    }
    return 0;
}
"""


def emitter() -> str:
    """Path of the compiled word emitter (built once per source version, in the system temp dir)."""
    import hashlib
    import tempfile

    src = EMITTER_C.replace("GAMMA", str(GAMMA))
    exe = Path(tempfile.gettempdir()) / f"redwood_rowrandom_emit_{hashlib.sha1(src.encode()).hexdigest()[:12]}"
    if not exe.exists():
        c = exe.with_suffix(".c")
        c.write_text(src)
        subprocess.run(["cc", "-O2", "-o", str(exe), str(c)], check=True)
    return str(exe)


def stream_words(stream: str, seed: int, n: int) -> np.ndarray:
    out = subprocess.run([emitter(), stream, str(seed), str(n)], capture_output=True, check=True).stdout
    return np.frombuffer(out, dtype="<u4")


def reference_words(stream: str, seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n words of a stream from RowRandom itself: (top 32 bits of the float64 uniforms,
    24 bits of the float32 uniforms)."""

    def draws(dtype):
        one = torch.zeros(1, dtype=torch.long)
        if stream == "counters":
            r = RowRandom([seed], "cpu")
            return torch.cat([r.uniform(one, (1,), dtype)[0] for _ in range(n)])
        if stream == "rows":  # (the seed is the counter: advance the batch)
            r = RowRandom(list(range(n)), "cpu")
            for _ in range(seed):
                r.uniform(None, (1,), dtype)
            return r.uniform(None, (1,), dtype)[:, 0]
        if stream == "lanes":
            return RowRandom([seed], "cpu").uniform(torch.zeros(n, dtype=torch.long), (1,), dtype)[:, 0]
        if stream in ("elements", "low"):
            return RowRandom([seed], "cpu").uniform(one, (n,), dtype)[0]
        r, out = RowRandom([seed], "cpu"), []  # chain
        while sum(len(o) for o in out) < n:
            out += [r.uniform(one, (1,), dtype)[0] for _ in range(GAMMA)]
            out.append(r.uniform(one, (GAMMA + 1,), dtype)[0])
        return torch.cat(out)[:n]

    u64, u32 = draws(torch.float64).numpy(), draws(torch.float32).double().numpy()
    if stream == "low":  # float64 uniforms' low 21 bits (the top 21 of the low word)
        return ((u64 * 2.0**53).astype(np.uint64) & np.uint64((1 << 21) - 1)).astype(np.uint32), None
    return np.floor(u64 * 2.0**32).astype(np.uint32), (u32 * 2.0**24).astype(np.uint32)


def check_against_rowrandom(n: int = 2048) -> None:
    for stream in STREAMS:
        for seed in (0, 3):
            mine = stream_words(stream, seed, n)
            ref, top24 = reference_words(stream, seed, n)
            same = (
                np.array_equal(mine >> np.uint32(11), ref)
                if stream == "low"
                else np.array_equal(mine, ref) and np.array_equal(mine >> np.uint32(8), top24)
            )
            if not same:
                sys.exit(f"{stream} (seed {seed}): the C transcription differs from RowRandom — update EMITTER_C")


RESULT = re.compile(r"^\s*(\S+)\|\s*(\d+)\|\s*(\d+)\|\s*(\d+)\|([0-9.]+)\|\s*(PASSED|WEAK|FAILED)")


def run_test(stream: str, test: tuple[int, int | None], seed: int) -> str:
    gen = subprocess.Popen([emitter(), stream, str(seed)], stdout=subprocess.PIPE)
    d, n = test
    dh = subprocess.run(
        ["dieharder", "-g", "200", "-d", str(d), "-Y", "1"] + ([] if n is None else ["-n", str(n)]),
        stdin=gen.stdout,
        capture_output=True,
        text=True,
    )
    gen.stdout.close()
    gen.kill()
    gen.wait()
    return dh.stdout


def final_round(rows: list[tuple]) -> list[tuple]:
    """With -Y 1 a test whose result reads WEAK is re-run with more p-samples (all its result lines
    again): the lines of the last round (the most p-samples) are its results."""
    most = max((int(r[3]) for r in rows), default=0)
    return [r for r in rows if int(r[3]) == most]


def summarize(out: Path, streams: list[str], tests: list[tuple], texts: dict[str, list[str]], meta: dict) -> str:
    """summary.md from each stream's per-test dieharder outputs (in the order of `tests`)."""
    parse = lambda text: [m.groups() for line in text.splitlines() if (m := RESULT.match(line))]  # noqa: E731
    lines = [
        "# dieharder on RowRandom's word streams",
        "",
        f"Command: `{meta['command']}`  ",
        f"dieharder {meta['dieharder']}, -g 200 (raw uint32 on stdin), -Y 1 (resolve ambiguity: a WEAK "
        f"result is re-run with more p-samples until it reads PASSED or FAILED); {meta['seconds']:.0f} s "
        f"on {meta['cores']} cores. Words checked equal to RowRandom's own (float64 top 32 bits, float32 "
        "24 bits; `low`: float64 low 21 bits) before the run.",
        "",
        "Counts are over each test's final round; `lines` also counts the rounds a WEAK result was re-run.",
        "",
        "| stream | results | PASSED | WEAK | FAILED | lowest p | highest p | lines |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in streams:
        every = [r for t in texts[s] for r in parse(t)]
        rows = [r for t in texts[s] for r in final_round(parse(t))]
        n = {a: sum(r[5] == a for r in rows) for a in ("PASSED", "WEAK", "FAILED")}
        ps = [float(r[4]) for r in rows]
        lines.append(
            f"| {s} | {len(rows)} | {n['PASSED']} | {n['WEAK']} | {n['FAILED']} | "
            f"{min(ps):.2g} | {max(ps):.6g} | {len(every)} |"
        )
    lines += [
        "",
        "## Per test (passed / results of the final round; seed = the test's position in the list)",
        "",
        "| test | " + " | ".join(streams) + " |",
        "|---" * (len(streams) + 1) + "|",
    ]
    for k, t in enumerate(tests):
        names, cells = set(), []
        for s in streams:
            every = parse(texts[s][k])
            rows = final_round(every)
            names |= {r[0] for r in rows}
            bad = [r for r in rows if r[5] != "PASSED"]
            cell = f"{len(rows) - len(bad)}/{len(rows)}"
            if bad:
                cell += " (" + ", ".join(f"{r[5]} ntup {r[1]} p={float(r[4]):.7g}" for r in bad) + ")"
            if len(every) > len(rows):
                cell += f" [re-run to {rows[0][3]} p-samples]"
            cells.append(cell)
        label = f"-d {t[0]}" + ("" if t[1] is None else f" -n {t[1]}")
        lines.append(f"| {label} {'/'.join(sorted(names))} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


BANNER = (
    "#=============================================================================#\n#            dieharder version"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emit", choices=STREAMS, help="write this stream's raw words to stdout and exit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="with --emit: stop after this many words")
    ap.add_argument("--streams", default=",".join(STREAMS))
    ap.add_argument(
        "--tests",
        default=",".join(str(d) if n is None else f"{d}:{n}" for d, n in TESTS),
        help="dieharder tests: -d number, or number:ntuple for -d number -n ntuple",
    )
    ap.add_argument("--jobs", type=int, default=2, help="dieharder processes at a time")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/random-battery"))
    ap.add_argument(
        "--resummarize",
        action="store_true",
        help="rebuild summary.md from the dieharder-<stream>.txt and run.json already in --out",
    )
    args = ap.parse_args()
    if args.emit:
        cmd = [emitter(), args.emit, str(args.seed)] + ([] if args.limit is None else [str(args.limit)])
        os.execv(cmd[0], cmd)
    streams = args.streams.split(",")
    tests = [(int(t.split(":")[0]), int(t.split(":")[1]) if ":" in t else None) for t in args.tests.split(",")]
    if args.resummarize:
        meta = json.loads((args.out / "run.json").read_text())
        texts = {}
        for s in streams:
            raw = (args.out / f"dieharder-{s}.txt").read_text()
            texts[s] = [BANNER + part for part in raw.split(BANNER)[1:]]
            assert len(texts[s]) == len(tests), (s, len(texts[s]), len(tests))
        print(summarize(args.out, streams, tests, texts, meta))
        return
    check_against_rowrandom()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    jobs = [(s, t, i) for s in streams for i, t in enumerate(tests)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run_test(*j), jobs))
    texts = {s: [] for s in streams}
    for (s, _, _), text in zip(jobs, results):
        texts[s].append(text)
    for s in streams:
        (args.out / f"dieharder-{s}.txt").write_text("".join(texts[s]))
    meta = {
        "command": "./.venv/bin/python benchmarks/random_battery.py " + " ".join(sys.argv[1:]),
        "dieharder": dieharder_version(),
        "seconds": time.time() - t0,
        "cores": os.cpu_count(),
    }
    (args.out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(summarize(args.out, streams, tests, texts, meta))


def dieharder_version() -> str:
    out = subprocess.run(["dieharder", "-l"], capture_output=True, text=True).stdout
    m = re.search(r"dieharder version (\S+)", out)
    return m.group(1) if m else "?"


if __name__ == "__main__":
    main()
