"""Layer offloading: offloaded forwards equal resident ones exactly, and the ring behaves as designed.

On the CPU the offload code runs with no-op streams/events and CPU "device" slots, so these tests check
the ring and prefetch schedule (which layer is copied into which slot, when, and that each layer's
parameters point into its slot only during its own forward). The CUDA-only checks (side stream,
events, pinned host buffers, no device-wide synchronize) run when a GPU is present.
"""

from __future__ import annotations

import json

import pytest
import torch

from redwood import LLM, SamplingParams
from redwood.config import ModelConfig
from redwood.engine.prefill import prefill_batch as prefill
from redwood.errors import ConfigError
from redwood.models.offload import get_offload, offload_layers, restore_layers
from redwood.models.transformer import build_model
from redwood.speculation.config import SpeculativeConfig
from tests.conftest import random_hf_model, save_target_and_draft, tiny_hf_config

NUM_LAYERS = 5
PROMPTS = [[5, 17, 42, 99, 7, 3, 250], [11, 3, 8]]


def _hf(arch: str, layers: int = NUM_LAYERS):
    return random_hf_model(tiny_hf_config(arch, num_hidden_layers=layers), seed=11)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def hf_model(request):
    return _hf(request.param)


def _build(hf):
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return build_model(config, state, torch.float32, "cpu")


@torch.inference_mode()
def _run(model, steps: int = 4) -> list[torch.Tensor]:
    """Logits of a ragged prefill then `steps` greedy decode steps (batch of 2)."""
    cache = model.new_cache(len(PROMPTS), 32)
    logits = prefill(model, cache, PROMPTS)
    out = [logits]
    for _ in range(steps):
        tokens = logits.argmax(-1)
        logits = model(tokens[:, None], cache.lengths[:, None], cache)[:, 0]
        cache.commit(1)
        out.append(logits)
    return out


def _params_in(tensor: torch.Tensor, params) -> bool:
    ptr = tensor.untyped_storage().data_ptr()
    return all(p.untyped_storage().data_ptr() == ptr for p in params)


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("prefetch", [1, 2, 3, NUM_LAYERS, NUM_LAYERS + 2])
def test_offloaded_logits_equal_resident(hf_model, prefetch):
    ref = _run(_build(hf_model))
    model = _build(hf_model)
    manager = offload_layers(model, "cpu", prefetch=prefetch)
    assert manager.num_slots == min(prefetch, NUM_LAYERS)
    for _ in range(2):  # the ring carries over from one forward (and one generation) to the next
        got = _run(model)
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    assert manager.stats.restarts == 0


def test_forwards_read_the_weights_from_the_host_buffers():
    hf = _hf("qwen2")
    ref = _run(_build(hf), steps=0)
    model = _build(hf)
    m = offload_layers(model, "cpu", prefetch=2)
    with torch.no_grad():
        m.host[NUM_LAYERS - 1].mul_(0.5)  # not yet in the ring: the forward must copy it from here
    assert not torch.equal(_run(model, steps=0)[0], ref[0])


def test_restore_layers_gives_a_resident_model(hf_model):
    ref = _run(_build(hf_model))
    model = _build(hf_model)
    offload_layers(model, "cpu", prefetch=2)
    _run(model, steps=1)
    restore_layers(model)
    assert get_offload(model) is None
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model.layers)
    for a, b in zip(_run(model), ref):
        assert torch.equal(a, b)
    restore_layers(model)  # a no-op on a resident model


# ------------------------------------------------------------------ the ring


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_ring_holds_at_most_prefetch_layers_and_runs_ahead(prefetch):
    L = NUM_LAYERS
    model = _build(_hf("qwen2"))
    m = offload_layers(model, "cpu", prefetch=prefetch, trace=True)
    assert len(m.slots) == prefetch and all(s.numel() == m.layer_numel for s in m.slots)
    layer_numel = sum(p.numel() for p in model.layers[0].parameters())
    assert layer_numel <= m.layer_numel < layer_numel + 64 * len(m.layout)  # one layer (+ alignment)
    seen = []

    def check(i):
        def hook(module, args):  # runs after the offload pre-hook
            seen.append(i)
            assert m.layers_on_device() == [i]  # only the computing layer points into the ring
            layer, s = m.active
            assert layer == i and _params_in(m.slots[s], m.params[i])
            # The slots hold this layer and the next prefetch - 1 (cyclic: the next forward's first).
            ahead = [(i + k) % L for k in range(prefetch)]
            assert sorted(x for x in m.slot_layer if x is not None) == sorted(ahead)
            assert [j for j, _ in m.queue] == ahead[1:]

        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(check(i))

    def off_device():
        assert m.layers_on_device() == [] and m.active is None
        for i in range(L):
            assert _params_in(m.host[i], m.params[i])
            assert all(p.device.type == "cpu" for p in m.params[i])

    off_device()  # before any forward: the first `prefetch` layers are already on their way
    assert [j for j, _ in m.queue] == list(range(prefetch)) and m.stats.copies == prefetch
    steps = 3
    _run(model, steps=steps)
    off_device()
    forwards = steps + 1
    assert seen == list(range(L)) * forwards
    assert m.stats.copies == prefetch + L * forwards and m.stats.skipped == 0
    assert m.stats.bytes == m.stats.copies * m.layer_bytes

    # Event order per slot: copy(j) → compute(j) → release(j) → copy(next) …; each compute reads the
    # layer most recently copied into its slot, and by then the copies have run prefetch - 1 layers
    # ahead of it (prefetch 1: the next copy waits for this layer to release the slot).
    last_copy, state = {}, {s: "free" for s in range(prefetch)}
    copies = computes = 0
    for kind, j, s in m.stats.trace:
        if kind == "copy":
            assert state[s] in ("free", "released")
            last_copy[s], state[s] = j, "copied"
            copies += 1
        elif kind == "compute":
            assert state[s] == "copied" and last_copy[s] == j
            state[s] = "computing"
            assert copies == computes + prefetch
            computes += 1
        else:
            assert kind == "release" and state[s] == "computing"
            state[s] = "released"
    assert computes == L * forwards


def test_prefetch_as_deep_as_the_model_copies_each_layer_once():
    model = _build(_hf("qwen2", layers=3))
    m = offload_layers(model, "cpu", prefetch=3)
    _run(model, steps=2)
    assert m.stats.copies == 3 and m.stats.skipped == 3 * 3  # each post-hook finds its layer in place


def test_out_of_order_and_failed_forwards_restart_the_ring():
    hf = _hf("qwen2")
    ref = _run(_build(hf))
    model = _build(hf)
    m = offload_layers(model, "cpu", prefetch=2)
    boom = {"on": True}
    mlp = model.layers[2].mlp
    orig = mlp.forward

    def failing(x):
        if boom["on"]:
            raise RuntimeError("boom")
        return orig(x)

    mlp.forward = failing
    with pytest.raises(RuntimeError, match="boom"):
        _run(model)
    boom["on"] = False
    assert m.layers_on_device() == []  # the failed layer was released (post-hook always runs)
    for a, b in zip(_run(model), ref):
        assert torch.equal(a, b)
    assert m.stats.restarts == 1

    # A layer run on its own (out of order) gets its weights too, and the next forward restarts.
    x = torch.randn(1, 3, model.config.hidden_size)
    pos = torch.arange(3)[None]
    cache = model.new_cache(1, 8)
    cos, sin = model.rotary(pos, x.dtype)
    from redwood.attention.reference import AttentionMetadata

    slots = cache.physical(cache.slots(3))
    meta = AttentionMetadata(lengths=cache.lengths, num_new=3, kv_len=3, q_positions=pos)
    with torch.inference_mode():
        model.layers[3](x, cos, sin, cache, slots, meta)
    assert m.stats.restarts == 2 and m.layers_on_device() == []
    for a, b in zip(_run(model), ref):
        assert torch.equal(a, b)
    assert m.stats.restarts == 3


def test_bad_arguments():
    model = _build(_hf("qwen2", layers=2))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError):
            offload_layers(model, "cpu", prefetch=bad)
    offload_layers(model, "cpu")
    with pytest.raises(ConfigError, match="already offloaded"):
        offload_layers(model, "cpu")


# ------------------------------------------------------------------ through LLM / speculation / CLI


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    """A 4-layer target (clear greedy margins, as in test_speculative) and a noisy copy as its draft."""
    root = tmp_path_factory.mktemp("offload-models")
    save_target_and_draft(root, tokenizer, noise=0.01, num_hidden_layers=4)
    return root


def _spec_prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (40, 71, 23)]


@pytest.fixture(scope="module")
def ar_reference(model_dirs):
    llm = LLM(str(model_dirs / "target"))
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, ignore_eos=True)
    prompts = _spec_prompts()
    return {
        "greedy": [o.token_ids for o in llm.generate(prompts, greedy)],
        "sampled": [o.token_ids for o in llm.generate(prompts, sampled)],
    }


@pytest.mark.parametrize("prefetch", [1, 3])
def test_llm_offload_generation_equals_resident(model_dirs, ar_reference, prefetch):
    llm = LLM(str(model_dirs / "target"), offload=True, offload_prefetch=prefetch)
    m = get_offload(llm.model)
    assert m is not None and m.num_slots == prefetch
    prompts = _spec_prompts()
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == ar_reference["greedy"]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == ar_reference["sampled"]
    assert m.layers_on_device() == [] and m.stats.restarts == 0


SPEC_CONFIGS = {
    "self-streaming": lambda d: SpeculativeConfig(
        self_speculate=True, draft_kv="streaming", draft_budget=16, sinks=4, num_draft_tokens=3
    ),
    "draft-full": lambda d: SpeculativeConfig(draft_model=str(d / "draft"), num_draft_tokens=4),
    "draft-tree": lambda d: SpeculativeConfig(draft_model=str(d / "draft"), tree="chains:2x3"),
}


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_speculative_with_offloaded_target_equals_ar(model_dirs, ar_reference, name):
    spec = SPEC_CONFIGS[name](model_dirs)
    llm = LLM(str(model_dirs / "target"), speculative=spec, offload=True, offload_prefetch=2)
    prompts = _spec_prompts()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == ar_reference["greedy"]
    stats = outs[0].stats["speculative"]
    assert 0 < stats["accepted"] < stats["drafted"]  # both accept and reject paths ran
    m = get_offload(llm.model)
    assert m.layers_on_device() == [] and m.stats.restarts == 0
    if name.startswith("draft"):  # the standalone draft stays resident
        assert get_offload(llm.drafter.model) is None


def test_cli_offload_flags(model_dirs, capsys):
    from redwood.cli import main

    base = [
        "generate",
        "--model",
        str(model_dirs / "target"),
        "--prompt",
        "Paris is",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ]
    assert main(base) == 0
    ref = json.loads(capsys.readouterr().out)
    assert main(base + ["--offload", "--offload-prefetch", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ref["token_ids"]
    assert main(base + ["--offload-prefetch", "2"]) == 2
    assert "--offload" in capsys.readouterr().err
    assert main(base + ["--offload", "--offload-prefetch", "0"]) == 2


def test_llm_rejects_bad_prefetch_before_loading(tmp_path):
    with pytest.raises(ConfigError):
        LLM(str(tmp_path / "missing"), offload=True, offload_prefetch=0)


# ------------------------------------------------------------------ CUDA only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_streams_events_pinned_memory_and_no_device_sync(monkeypatch):
    hf = _hf("qwen2", layers=6)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())

    def build(device):
        return build_model(config, {k: v.detach().clone() for k, v in hf.state_dict().items()}, torch.float32, device)

    ref = [t.cpu() for t in _run(build("cuda"))]
    model = build("cpu")
    m = offload_layers(model, "cuda", prefetch=3)
    assert model.device.type == "cuda" and model.rotary.inv_freq.device.type == "cuda"
    assert all(p.device.type == "cpu" for layer in model.layers for p in layer.parameters())
    assert all(h.is_pinned() for h in m.host)
    assert all(s.device.type == "cuda" for s in m.slots) and len(m.slots) == 3
    assert isinstance(m.copy_stream, torch.cuda.Stream) and m.copy_stream != torch.cuda.current_stream()
    assert all(isinstance(e, torch.cuda.Event) for e in m.copy_done + m.compute_done)

    def forbidden(*args, **kwargs):
        raise AssertionError("device-wide or host-blocking synchronize during an offloaded forward")

    for steps in (0, 3):
        monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", forbidden)
        monkeypatch.setattr(torch.cuda.Event, "synchronize", forbidden)
        got = _run(model, steps=steps)  # reading the logits below blocks on the compute stream only
        monkeypatch.undo()
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
    assert m.stats.copies == 3 + 6 * 5 and m.stats.restarts == 0
    assert all(p.device.type == "cpu" for layer in model.layers for p in layer.parameters())
    restore_layers(model)
    assert all(p.device.type == "cuda" for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_llm_offload_generation_and_speculation(model_dirs):
    prompts = _spec_prompts()
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(model_dirs / "target"), device="cuda").generate(prompts, params)]
    llm = LLM(str(model_dirs / "target"), device="cuda", offload=True, offload_prefetch=2)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    spec = SpeculativeConfig(self_speculate=True, draft_kv="streaming", draft_budget=16, sinks=4, num_draft_tokens=3)
    llm = LLM(str(model_dirs / "target"), device="cuda", speculative=spec, offload=True, offload_prefetch=3)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert get_offload(llm.model).stats.restarts == 0
