"""`redwood bench ar`: autoregressive prefill time and decode tokens/s, optionally against HF transformers.

Both engines get the same weights (HF's model is built from redwood's tensors), the same prompts and
greedy decoding of exactly `gen_len` tokens (EOS ignored), in one process, measured side by side.
Decode tokens/s counts the tokens after the first (which comes out of the prefill).
"""

from __future__ import annotations

import time

import torch

from redwood.engine.runner import sync
from redwood.sampling_params import SamplingParams


def make_prompts(llm, batch_size: int, prompt_len: int, dataset: str | None, seed: int) -> list[list[int]]:
    """`batch_size` prompts of exactly `prompt_len` tokens: windows of a dataset's text, or random ids."""
    if dataset:
        from redwood.data.prompts import build_prompts

        prompts = build_prompts(llm.tokenizer, dataset, count=batch_size, length=prompt_len, seed=seed)
        return [list(p)[:prompt_len] for p in prompts]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, llm.config.vocab_size, (batch_size, prompt_len), generator=g).tolist()


def hf_decode_rate(hf, prompts: list[list[int]], gen_len: int) -> dict:
    """HF `generate` greedy: prefill time (1 new token) and decode tokens/s (the rest)."""
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def timed(n: int) -> tuple[float, torch.Tensor]:
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync(device)
        return time.perf_counter() - t0, out

    with torch.inference_mode():
        timed(2)  # warm-up
        t_prefill, _ = timed(1)
        t_total, out = timed(gen_len)
    decode_s = max(t_total - t_prefill, 1e-9)
    return {
        "prefill_s": t_prefill,
        "decode_s": decode_s,
        "decode_tokens_per_s": (gen_len - 1) * len(prompts) / decode_s,
        "token_ids": out[:, ids.shape[1] :].tolist(),
    }


def weight_bytes(model) -> int:
    """Bytes one decode step must read: every parameter, except an untied embedding matrix, of which
    the lookup reads one row per token (tied, it is the output projection and is read whole). Packed
    CPU projections (`Transformer.quantize_cpu`) count their packed bytes; a packed head is its own copy. A model
    with int8 copies for its one-token forwards (`Transformer.quantize_skinny`, a draft) reads those — the int8
    projections and head with their row scales — and its norms and biases, not its model-dtype projections."""
    from redwood.models.cpu_weights import PackedLinear

    q8 = getattr(model, "skinny_int8", None)
    if q8 is not None:
        pairs = [pair for layer in q8["layers"] for pair in layer.values()] + [q8["lm_head"]]
        small = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n or "bias" in n)
        return sum(q.numel() * q.element_size() + s.numel() * s.element_size() for q, s in pairs) + small
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.nbytes for m in model.modules() if isinstance(m, PackedLinear))
    if model.lm_head is not None or getattr(model, "packed_head", None) is not None:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + written), median of `repeats`."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return nbytes / sorted(times[2:])[len(times[2:]) // 2]


def decode_floor(model, batch_size: int, prompt_len: int, gen_len: int, bandwidth: float) -> dict:
    """The memory floor of decoding: weights plus the batch's KV read once per step, over bandwidth. Both are this
    model's own: under tensor parallelism a rank's weight shards and KV heads (`Transformer.kv_slot_bytes`)."""
    mean_context = prompt_len + gen_len / 2
    step_bytes = weight_bytes(model) + batch_size * mean_context * model.kv_slot_bytes
    step_s = step_bytes / bandwidth
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weight_bytes(model),
        "step_bytes": step_bytes,
        "floor_step_ms": step_s * 1e3,
        "floor_tokens_per_s": batch_size / step_s,
    }


def run_ar_bench(
    llm,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    compare_hf: bool = False,
    dataset: str | None = None,
    seed: int = 0,
    repeats: int = 1,
) -> dict:
    from redwood.errors import ConfigError

    if gen_len < 2:
        raise ConfigError("--gen-len must be at least 2 (one token from the prefill, the rest decoded)")
    weights = getattr(llm.model, "weights", "float32")
    if compare_hf and weights != "float32":
        raise ConfigError(
            f"--compare-hf runs Hugging Face transformers on the same float weights; the model holds "
            f"{weights} weights (--weights auto packs a .gguf file on the CPU): add --weights float32"
        )
    if compare_hf and getattr(llm, "tp", None) is not None:
        raise ConfigError("--compare-hf runs transformers over the whole model: not under tensor parallelism")
    prompts = make_prompts(llm, batch_size, prompt_len, dataset, seed)
    params = SamplingParams(max_new_tokens=gen_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
    best = None
    for _ in range(repeats):
        outs = llm.generate(prompts, params)
        decode_s = max(o.stats["decode_s"] for o in outs)
        run = {
            "prefill_s": outs[0].stats["prefill_s"],
            "decode_s": decode_s,
            "decode_tokens_per_s": (gen_len - 1) * batch_size / decode_s,
        }
        if best is None or run["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
            best = run
    result = {
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "weights": weights,
        "tensor_parallel_size": llm.engine_config.tensor_parallel_size,
        "redwood": best,
    }
    device = llm.model.device
    if device.type == "cuda":
        floor = decode_floor(llm.model, batch_size, prompt_len, gen_len, copy_bandwidth(device))
        floor["fraction_of_floor"] = best["decode_tokens_per_s"] / floor["floor_tokens_per_s"]
        result["floor"] = floor
    if compare_hf:
        from redwood.models.hf_compat import to_hf_model

        hf = to_hf_model(llm.model)
        ref = hf_decode_rate(hf, prompts, gen_len)
        result["hf_same_tokens"] = ref.pop("token_ids") == [o.token_ids for o in outs]
        result["hf"] = ref
        result["speedup_vs_hf"] = best["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        del hf
    return result


def format_result(r: dict) -> str:
    lines = [
        f"batch {r['batch_size']}, prompt {r['prompt_len']} tokens, {r['gen_len']} generated (greedy), "
        f"{r.get('weights', 'float32')} weights"
        + (f", {r['tensor_parallel_size']} tensor-parallel ranks" if r.get("tensor_parallel_size", 1) > 1 else ""),
        f"{'engine':<14}{'prefill s':>12}{'decode tok/s':>15}",
    ]
    for name in ("redwood", "hf"):
        if name in r:
            lines.append(f"{name:<14}{r[name]['prefill_s']:>12.3f}{r[name]['decode_tokens_per_s']:>15.2f}")
    if "floor" in r:
        f = r["floor"]
        lines.append(
            f"memory floor ({f['step_bytes'] / 1e9:.2f} GB per step at "
            f"{f['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s measured): {f['floor_tokens_per_s']:.0f} tok/s; "
            f"redwood reaches {100 * f['fraction_of_floor']:.0f}%"
        )
    if "speedup_vs_hf" in r:
        lines.append(
            f"redwood / HF decode tokens/s: {r['speedup_vs_hf']:.2f}x"
            f"  (same tokens: {'yes' if r['hf_same_tokens'] else 'NO'})"
        )
    return "\n".join(lines)
