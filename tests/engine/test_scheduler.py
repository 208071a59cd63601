"""The scheduler: chunked prefill, decode rows, preemption by recompute, the prefix cache, and a randomized
simulation of a fake engine that checks the bookkeeping invariants after every step."""

import random

import pytest

from redwood.engine.scheduler import Scheduler, SeqState, Status
from redwood.errors import ConfigError, ContextLengthError
from redwood.kv.blocks import BlockPool


def token(rid: str, j: int) -> int:
    """The j-th generated token of request rid: what a deterministic model would produce, however the
    request is scheduled (so a dropped or duplicated token shows in the output)."""
    return (sum(map(ord, rid)) * 7919 + j * 104729) % 1000


def make(
    max_num_seqs=4,
    budget=8,
    num_blocks=64,
    block_size=4,
    lookahead=1,
    max_model_len=1000,
    prefix=False,
    prefills=1,
    prefill_first=False,
):
    pool = BlockPool(num_blocks, block_size, enable_prefix_cache=prefix)
    return Scheduler(
        max_num_seqs, budget, pool, lookahead, max_model_len, max_prefill_requests=prefills, prefill_first=prefill_first
    )


def req(rid, n_prompt, max_new=10, base=0):
    return SeqState(rid, [base + i for i in range(n_prompt)], max_new)


def run_step(s: Scheduler, out, accept=lambda r: 1):
    """Play the engine for one scheduled step: every chunk, then every decode row committing accept(r)
    tokens (the fed token + accept - 1 drafts; the last is the bonus)."""
    for c in out.prefill:
        r = c.request
        s.update_after_step(r, c.length, [token(r.request_id, len(r.output_token_ids))] if c.is_last else [])
    for r in out.decode:
        k = accept(r)
        n = len(r.output_token_ids)
        s.update_after_step(r, k, [token(r.request_id, n + i) for i in range(k)])


def test_constructor_and_add_errors():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        make(max_num_seqs=0)
    with pytest.raises(ConfigError, match="lookahead"):
        make(lookahead=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make(budget=0)
    s = make(num_blocks=4, block_size=4, max_model_len=20, lookahead=3)
    with pytest.raises(ContextLengthError, match="at most 19 tokens"):
        s.add(req("a", 20))
    with pytest.raises(ContextLengthError, match="more than the whole pool's 4 blocks"):
        s.add(req("b", 10, max_new=8))  # final 18 tokens: last decode writes positions 16..18 -> 5 blocks
    s.add(req("c", 10, max_new=5))  # final 15: positions up to 15 -> 4 blocks
    with pytest.raises(ConfigError, match="already in use"):
        s.add(req("c", 3))
    with pytest.raises(ConfigError, match="empty prompt"):
        s.add(req("d", 0))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        s.add(req("e", 3, max_new=0))
    assert s.has_unfinished() and len(s.waiting) == 1


def test_chunked_prefill_covers_every_token_once():
    s = make(budget=4)
    r = req("a", 10, max_new=3)
    s.add(r)
    spans = []
    for step in range(3):
        out = s.schedule()
        assert out.decode == [] and len(out.prefill) == 1
        c = out.prefill[0]
        spans.append((c.start, c.length, c.is_last))
        assert out.admitted == ([r] if step == 0 else [])
        run_step(s, out)
        assert r.output_token_ids == ([token("a", 0)] if c.is_last else [])
    assert spans == [(0, 4, False), (4, 4, False), (8, 2, True)]
    # Prefill done: 10 computed, 11 known tokens; decode rows hold num_computed == num_tokens - 1.
    assert r.num_computed == 10 and r.num_tokens == 11 and not r.is_prefilling
    out = s.schedule()
    assert out.prefill == [] and out.decode == [r] and r.block_table.capacity >= 11
    run_step(s, out)
    assert r.num_computed == 11 and r.output_token_ids == [token("a", 0), token("a", 1)]
    run_step(s, s.schedule())
    assert r.status is Status.FINISHED_LENGTH and r.output_token_ids == [token("a", j) for j in range(3)]
    assert s.pool.num_free == s.pool.num_blocks and not s.has_unfinished()


def test_one_prefill_per_step_beside_decode_rows_and_lowest_slot():
    s = make(budget=8, max_num_seqs=3)
    a, b, c = req("a", 8), req("b", 12), req("c", 3)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [ch.request for ch in out.prefill] == [a] and a.slot == 0 and out.decode == []
    run_step(s, out)
    out = s.schedule()  # a decodes, b's first chunk
    assert out.decode == [a] and [(ch.request, ch.start, ch.length) for ch in out.prefill] == [(b, 0, 8)]
    assert b.slot == 1 and c.slot is None
    run_step(s, out)
    out = s.schedule()  # b's prefill continues before c is admitted
    assert out.decode == [a] and [(ch.request, ch.start, ch.length) for ch in out.prefill] == [(b, 8, 4)]
    run_step(s, out)
    s.abort("a")  # frees slot 0: c takes the lowest free slot
    out = s.schedule()
    assert out.decode == [b] and out.prefill[0].request is c and c.slot == 0
    assert out.num_running == 2 and out.num_waiting == 0


def test_length_limits_and_stop():
    s = make(lookahead=4)
    r = req("a", 5, max_new=4)
    s.add(r)
    run_step(s, s.schedule())
    s.schedule()
    kept = s.update_after_step(r, 4, [1, 2, 3, 4])  # a speculative commit past max_new_tokens
    assert kept == [1, 2, 3] and r.status is Status.FINISHED_LENGTH and len(r.output_token_ids) == 4
    assert s.pool.num_free == s.pool.num_blocks
    # max_model_len bounds prompt + output.
    s = make(max_model_len=8, lookahead=2)
    r = req("b", 6, max_new=100)
    s.add(r)
    run_step(s, s.schedule())
    s.schedule()
    assert s.update_after_step(r, 2, [7, 8]) == [7] and r.num_tokens == 8
    assert r.status is Status.FINISHED_LENGTH
    # A stop token as the last kept token finishes with STOPPED, even at the length limit.
    s = make()
    r = req("c", 3, max_new=2)
    s.add(r)
    s.schedule()
    s.update_after_step(r, 3, [5])
    s.schedule()
    assert s.update_after_step(r, 1, [6], stopped=True) == [6] and r.status is Status.FINISHED_STOPPED
    r = req("d", 3)
    s.add(r)
    s.schedule()
    s.update_after_step(r, 3, [0], stopped=True)  # a stop right out of the prefill
    assert r.status is Status.FINISHED_STOPPED and r.output_token_ids == [0]


def test_update_rejects_dropped_or_duplicated_tokens():
    s = make(budget=4)
    r = req("a", 6)
    s.add(r)
    s.schedule()
    with pytest.raises(ValueError, match="only the chunk that ends a prefill"):
        s.update_after_step(r, 4, [1])
    assert r.num_computed == 0  # a rejected update changes nothing
    s.update_after_step(r, 4)
    s.schedule()
    with pytest.raises(ValueError, match="ran past its prefill"):
        s.update_after_step(r, 3, [1])
    with pytest.raises(ValueError, match="would be dropped or duplicated"):
        s.update_after_step(r, 2, [])  # the prefill ends: it must sample a token
    s.update_after_step(r, 2, [1])
    s.schedule()
    with pytest.raises(ValueError, match="would be dropped or duplicated"):
        s.update_after_step(r, 1, [2, 3])
    with pytest.raises(ValueError, match="cannot have computed 106 tokens"):
        s.update_after_step(r, 100, [0] * 100)
    with pytest.raises(ValueError, match="cannot have computed"):
        s.update_after_step(r, -1, [])
    assert (r.num_computed, r.output_token_ids) == (6, [1])
    w = req("w", 3)
    s.add(w)
    with pytest.raises(ValueError, match="is waiting"):
        s.update_after_step(w, 1)


def test_preemption_recomputes_the_newest_and_completes():
    # 6 blocks of 2 tokens; a and b each grow to 10 tokens (5 blocks): they cannot both fit.
    s = make(num_blocks=6, block_size=2, budget=16, lookahead=1, max_num_seqs=2)
    a, b = req("a", 4, max_new=6), req("b", 4, max_new=6, base=50)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # a prefills
    run_step(s, s.schedule())  # a decodes, b prefills
    preempted_seen = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        out = s.schedule()
        preempted_seen += out.preempted
        if out.preempted:
            assert out.admitted == []  # no admission in a step that preempted
        for p in out.preempted:
            assert p.status is Status.WAITING and p.slot is None and p.block_table.blocks == []
            assert p.num_computed == 0 and s.waiting[0] is p
        for ch in out.prefill:
            if ch.request.num_preemptions and ch.start == 0:  # readmitted: prefills prompt + output so far
                assert ch.request.prefill_len == ch.request.num_tokens > len(ch.request.prompt_token_ids)
        run_step(s, out)
        assert s.pool.num_free + s.pool.num_used == 6
    assert preempted_seen and all(p is b for p in preempted_seen)  # the later arrival
    for r in (a, b):
        assert r.status is Status.FINISHED_LENGTH
        assert r.output_token_ids == [token(r.request_id, j) for j in range(6)]
    assert s.pool.num_free == 6


def test_pool_too_small_for_the_only_request_is_a_clear_error():
    s = make(num_blocks=3, block_size=2, lookahead=1)
    s.add(req("x", 4, max_new=2))
    run_step(s, s.schedule())
    s.lookahead = 8  # more room than add() vetted
    with pytest.raises(RuntimeError, match="cannot hold request 'x' alone"):
        s.schedule()


def test_abort_and_finish_from_every_state():
    s = make(budget=4, max_num_seqs=2)
    a, b, c = req("a", 3), req("b", 9), req("c", 3)
    for r in (a, b, c):
        s.add(r)
    run_step(s, s.schedule())  # a prefilled
    run_step(s, s.schedule())  # a decodes, b's first chunk
    assert a.slot == 0 and b.is_prefilling and c.status is Status.WAITING
    assert s.abort("b") and b.status is Status.FINISHED_ABORTED and b.slot is None  # mid-prefill
    assert s.abort("c") and c not in s.waiting  # waiting
    assert s.finish(a, Status.FINISHED_STOPPED)  # decoding
    assert not s.abort("a") and not s.abort("nope") and not s.finish(a, Status.FINISHED_ABORTED)
    assert a.status is Status.FINISHED_STOPPED
    with pytest.raises(ValueError):
        s.finish(a, Status.RUNNING)
    assert not s.has_unfinished() and s.pool.num_free == s.pool.num_blocks
    assert s.running == [] and s.waiting == []
    s.add(req("a", 3))  # a finished id can be reused


def test_prefix_cache_admission_counts_matched_blocks_as_computed():
    s = make(prefix=True, block_size=4, budget=64)
    a = req("a", 10)  # blocks [0..3], [4..7] are full prompt blocks
    s.add(a)
    run_step(s, s.schedule())
    assert s.pool.num_cached == 2
    b = SeqState("b", list(range(8)) + [77, 78, 79], 5)
    s.add(b)
    out = s.schedule()
    ch = out.prefill[0]
    assert ch.request is b and (ch.start, ch.length) == (8, 3)
    assert b.block_table.blocks[:2] == a.block_table.blocks[:2]
    run_step(s, out)
    c = SeqState("c", list(range(8)), 5)  # the whole prompt is cached: still computes its last block
    s.add(c)
    out = s.schedule()
    assert (out.prefill[0].start, out.prefill[0].length) == (4, 4)
    run_step(s, out)
    assert s.pool.refcount(a.block_table.blocks[0]) == 3 and s.pool.refcount(a.block_table.blocks[1]) == 2
    for r in (a, b, c):
        s.abort(r.request_id)
    assert s.pool.num_free == s.pool.num_blocks and s.pool.num_cached >= 2


def test_admission_waits_when_no_block_is_free():
    s = make(num_blocks=4, block_size=2, budget=16, lookahead=1, max_num_seqs=4)
    a, b = req("a", 6, max_new=2), req("b", 2, max_new=1)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # a's prefill takes 3 blocks
    out = s.schedule()  # a's decode room takes the 4th: b cannot get a block, and waits at the head
    assert out.decode == [a] and out.admitted == [] and out.num_blocks_free == 0 and b.slot is None
    run_step(s, out)  # a finishes (2 tokens)
    assert a.status is Status.FINISHED_LENGTH
    out = s.schedule()
    assert out.admitted == [b] and b.slot == 0


def test_several_prefills_share_the_step_budget():
    """With max_prefill_requests > 1 an unfinished prefill continues first, then waiting heads start in
    arrival order while the step's token budget and the slots last."""
    s = make(budget=10, max_num_seqs=3, prefills=4)
    a, b, c, d = req("a", 6), req("b", 3), req("c", 5), req("d", 2)
    for r in (a, b, c, d):
        s.add(r)
    out = s.schedule()
    assert [(ch.request, ch.start, ch.length) for ch in out.prefill] == [(a, 0, 6), (b, 0, 3), (c, 0, 1)]
    assert [r.slot for r in (a, b, c)] == [0, 1, 2] and out.admitted == [a, b, c]
    run_step(s, out)
    out = s.schedule()  # c continues; no slot for d
    assert [(ch.request, ch.start, ch.length) for ch in out.prefill] == [(c, 1, 4)] and out.decode == [a, b]


# --- randomized simulation --------------------------------------------------------------------------


def check_invariants(s: Scheduler, out, kv: dict, admitted_order: list, prefix: bool):
    pool = s.pool
    assert pool.num_free + pool.num_used == pool.num_blocks
    assert len(s.running) <= s.max_num_seqs
    slots = [r.slot for r in s.running]
    assert len(set(slots)) == len(slots) and all(0 <= x < s.max_num_seqs for x in slots)
    assert all(r.slot is None and r.block_table.blocks == [] and r.num_computed == 0 for r in s.waiting)
    assert [r.arrival for r in s.waiting] == sorted(r.arrival for r in s.waiting)
    # Preempted requests wait ahead of every request never admitted.
    flags = [r.num_preemptions > 0 for r in s.waiting]
    assert flags == sorted(flags, reverse=True)
    assert len(out.prefill) <= s.max_prefill_requests and sum(c.length for c in out.prefill) <= s.max_num_batched_tokens
    owners: dict[int, list] = {}
    for r in s.running:
        for i, b in enumerate(r.block_table.blocks):
            owners.setdefault(b, []).append((r, i))
    for b, holders in owners.items():
        assert pool.refcount(b) == len(holders)
        if len(holders) > 1:  # shared only through the prefix cache, as a full registered prompt block
            assert prefix and pool.block_hash(b) is not None
            assert all(i < len(r.block_table.hashes) for r, i in holders)
    assert pool.num_used == len(owners)
    # Every computed position holds its token in the (simulated) paged cache.
    for r in s.running:
        toks = r.all_token_ids
        assert r.num_computed <= r.block_table.capacity and r.num_computed <= len(toks)
        for p in range(r.num_computed):
            assert kv[r.block_table.slot(p)] == toks[p], (r.request_id, p)
        if not r.is_prefilling:
            assert r.num_computed == len(toks) - 1
    # FCFS: requests are admitted for the first time in arrival order.
    assert admitted_order == sorted(admitted_order)


@pytest.mark.parametrize("prefill_first", [False, True])
@pytest.mark.parametrize("prefills", [1, 3])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize(
    "num_blocks,lookahead,max_num_seqs,budget",
    [
        (12, 1, 3, 8),  # tiny pool: constant preemption
        (16, 5, 4, 6),  # speculative lookahead, small chunks, preemption
        (200, 3, 8, 32),  # roomy: no preemption
    ],
)
def test_random_simulation(prefix, num_blocks, lookahead, max_num_seqs, budget, prefills, prefill_first):
    rng = random.Random(1234 + num_blocks + lookahead)
    block_size, max_model_len = 4, 40
    s = make(max_num_seqs, budget, num_blocks, block_size, lookahead, max_model_len, prefix, prefills, prefill_first)
    bases = [[rng.randrange(50) for _ in range(20)] for _ in range(3)]  # shared prompt stems
    kv: dict = {}  # (block, offset) -> token: the simulated paged cache
    reqs, stop_at, first_admission = [], {}, []
    n_requests, step = 300, 0
    decode_steps = mixed_steps = 0
    while len(reqs) < n_requests or s.has_unfinished():
        step += 1
        assert step < 20000
        for _ in range(rng.choice([0, 0, 1, 2]) if len(reqs) < n_requests else 0):
            n = rng.randrange(1, 30)
            prompt = rng.choice(bases)[:n] if rng.random() < 0.5 else [rng.randrange(50) for _ in range(n)]
            max_new = rng.randrange(1, 15)
            final = min(n + max_new, max_model_len)
            r = SeqState(f"r{len(reqs)}", prompt, max_new)
            if s.pool.blocks_for(max(final - 1, final - 2 + lookahead)) > num_blocks:
                with pytest.raises(ContextLengthError):
                    s.add(r)
                continue
            s.add(r)
            reqs.append(r)
            stop_at[r.request_id] = rng.randrange(40) if rng.random() < 0.3 else None
        if rng.random() < 0.03 and s.has_unfinished():
            victim = rng.choice([r for r in reqs if not r.status.finished])
            assert s.abort(victim.request_id) and victim.status is Status.FINISHED_ABORTED
        out = s.schedule()
        decode_steps += bool(out.decode)
        mixed_steps += bool(out.decode and out.prefill)
        for r in out.admitted:
            if r.num_preemptions == 0:
                first_admission.append(r.arrival)
        for c in out.prefill:
            r, toks = c.request, c.request.all_token_ids
            assert c.start == r.num_computed and c.start + c.length <= r.prefill_len == len(toks)
            for p in range(c.start, c.start + c.length):
                kv[r.block_table.slot(p)] = toks[p]
            new = [token(r.request_id, len(r.output_token_ids))] if c.is_last else []
            stopped = bool(new) and stop_at[r.request_id] == len(r.output_token_ids)
            s.update_after_step(r, c.length, new, stopped)
        for r in out.decode:
            assert r.status is Status.RUNNING and r.slot is not None
            n_out, base = len(r.output_token_ids), r.num_computed
            assert r.block_table.capacity >= base + lookahead
            k = rng.randint(1, lookahead)
            new = [token(r.request_id, n_out + i) for i in range(k)]
            fed = [r.all_token_ids[-1]] + new[:-1]  # the newest token, then the accepted drafts
            for i in range(lookahead):  # rejected draft positions get garbage
                kv[r.block_table.slot(base + i)] = fed[i] if i < k else -1
            stopped = False
            sa = stop_at[r.request_id]
            if sa is not None and n_out <= sa < n_out + k:
                new, stopped = new[: sa - n_out + 1], True  # the engine cuts after the stop token
            s.update_after_step(r, len(new), new, stopped)
        check_invariants(s, out, kv, first_admission, prefix)
    assert s.pool.num_free == num_blocks and s.pool.num_used == 0
    assert s.running == [] and s.waiting == []
    for r in reqs:
        assert r.status.finished
        n = len(r.output_token_ids)
        assert r.output_token_ids == [token(r.request_id, j) for j in range(n)]
        if r.status is Status.FINISHED_LENGTH:
            assert n == min(r.max_new_tokens, max_model_len - len(r.prompt_token_ids))
        elif r.status is Status.FINISHED_STOPPED:
            assert n == stop_at[r.request_id] + 1
    if prefill_first and num_blocks == 200:  # (room for every prompt: a step with prefill work runs it alone)
        assert decode_steps > 0 and mixed_steps == 0
    elif not prefill_first:
        assert mixed_steps > 0
    if num_blocks == 12:
        assert sum(r.num_preemptions for r in reqs) > 20  # the tiny pool did exercise preemption
        assert all(r.status is not Status.WAITING for r in reqs)


def test_prefill_backlog_counts_the_prefills_that_can_proceed_now():
    """Unfinished prefills of running requests, and waiting prompts up to the free slots, in steps of the budget
    (what the automatic policy weighs against the decoding rows' remaining tokens)."""
    s = make(max_num_seqs=2, budget=8, num_blocks=64)
    assert s.prefill_backlog_steps() == 0
    for rid, n in (("a", 20), ("b", 6), ("c", 30)):
        s.add(req(rid, n))
    assert s.prefill_backlog_steps() == -(-(20 + 6) // 8)  # two free slots: a and b; c waits for a slot
    out = s.schedule()  # a's first chunk (8 of 20)
    run_step(s, out)
    assert s.prefill_backlog_steps() == -(-(12 + 6) // 8)
    while any(r.is_prefilling for r in s.running) or s.waiting[:1] and s._free_slots:
        run_step(s, s.schedule())
    assert s.prefill_backlog_steps() == 0  # c waits for a decoding row to finish, not for prefill budget


def test_the_backlog_then_decodes_what_its_requests_are_sure_to_generate():
    """The fewest output tokens any request of the prefill backlog is sure to generate (its sure_new_tokens, less
    what a preempted one already has); 0 with no backlog, a request that may stop early, or a queue behind it."""
    s = make(max_num_seqs=2, budget=8, num_blocks=64)
    assert s.backlog_then_decodes() == 0
    a, b = req("a", 20), req("b", 6)
    a.sure_new_tokens, b.sure_new_tokens = 40, 30
    s.add(a)
    s.add(b)
    assert s.backlog_then_decodes() == 30
    b.output_token_ids.extend([7, 7, 7])  # (as a preempted request waits with its output so far)
    assert s.backlog_then_decodes() == 27
    c = req("c", 30)
    c.sure_new_tokens = 100
    s.add(c)  # two free slots, three waiting: c waits for a slot, so a decoding row's early end counts
    assert s.backlog_then_decodes() == 0
    s2 = make(max_num_seqs=2, budget=8, num_blocks=64)
    s2.add(req("d", 20))  # sure_new_tokens 0: it may stop at its first token
    assert s2.backlog_then_decodes() == 0


def test_a_backlog_that_came_after_the_rows_began_counts_nothing():
    """Requests added together are one burst: the one still prefilling counts its sure tokens while another
    decodes. A request added after a decoding row's first token is a stream's (closed-loop clients send the
    next request when one ends): the backlog then counts nothing."""
    s = make(max_num_seqs=3, budget=8, num_blocks=64)
    a, b = req("a", 6, max_new=50), req("b", 30, max_new=50, base=100)
    a.sure_new_tokens = b.sure_new_tokens = 50
    s.add(a)
    s.add(b)
    while not a.output_token_ids:
        run_step(s, s.schedule())
    assert b.num_computed < 30 and s.backlog_then_decodes() == 50
    c = req("c", 30, max_new=50, base=200)
    c.sure_new_tokens = 50
    s.add(c)
    assert s.backlog_then_decodes() == 0


def test_prefill_first_runs_prefill_alone_then_decodes_the_burst_together():
    """Prefill first: while prompts can proceed, a step runs their chunks and no decoding row; the rows then decode
    together. A waiting prompt whose whole prefill would leave no block for every decoding row is not admitted
    that way (the next decode step would preempt it): the step falls back to decoding beside its first chunk."""
    s = make(max_num_seqs=4, budget=8, num_blocks=64, prefill_first=True)
    a, b, c = req("a", 8), req("b", 12), req("c", 3)
    for r in (a, b, c):
        s.add(r)
    steps = []
    while any(r.is_prefilling for r in s.running) or s.waiting:
        out = s.schedule()
        assert out.decode == []  # a has finished its prefill in step 1, yet waits for b and c
        steps.append([(ch.request.request_id, ch.start, ch.length) for ch in out.prefill])
        run_step(s, out)
    assert steps == [[("a", 0, 8)], [("b", 0, 8)], [("b", 8, 4)], [("c", 0, 3)]]  # (one chunk a step here)
    out = s.schedule()
    assert out.prefill == [] and out.decode == [a, b, c]
    # the default order decodes a beside b's first chunk
    m = make(max_num_seqs=4, budget=8, num_blocks=64)
    for r in (req("a", 8), req("b", 12)):
        m.add(r)
    run_step(m, m.schedule())
    assert [r.request_id for r in m.schedule().decode] == ["a"]
    # a small pool: d's 16-token prompt (4 blocks) would leave 0 of 5 blocks for e's decoding row
    t = make(max_num_seqs=4, budget=32, num_blocks=5, block_size=4, prefill_first=True)
    e, d = req("e", 3, max_new=2), req("d", 16, max_new=1)
    t.add(e)
    run_step(t, t.schedule())  # e prefilled (1 block)
    t.add(d)
    out = t.schedule()
    assert out.decode == [e] and [ch.request for ch in out.prefill] == [d]  # the default order's step
