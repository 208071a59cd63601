"""The Python API, shaped like vLLM's: `LLM(model=...)` then `llm.generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from redwood.config import SpeculativeConfig
from redwood.engine.generate import autoregressive, make_requests
from redwood.engine.request import RequestState
from redwood.engine.runner import RunnerPool
from redwood.errors import ConfigError
from redwood.loading import load_model
from redwood.sampling_params import SamplingParams

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"  # shares the target's tokenizer

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    """The result for one prompt: generated text and token ids (the prompt excluded), and stats."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


@dataclass
class StreamDelta:
    """A piece of one request's output as it is generated (`index` = position in the prompt list)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict | None = None  # set on the request's last delta


class LLM:
    """A loaded model ready to generate.

    model: a zoo name (`redwood models list`), a Hugging Face folder, or a .gguf file.
    dtype: "float32" | "bfloat16" | "float16"; device: "cpu" | "cuda".
    speculative: a SpeculativeConfig (draft model or self-speculation, draft KV policy, γ, verifier);
    None decodes autoregressively. Either way the output is the target model's.
    offload: keep the target's decoder-layer weights in (pinned) host memory and stream them to the
    device, `offload_prefetch` layers at a time (see `redwood.engine.offload`).
    cuda_graphs: capture decode / draft / verify steps in CUDA graphs, once per step shape, and keep the
    KV caches across calls (`redwood.engine.runner`); None → on for CUDA. An offloaded target always runs
    eagerly (its weights stream in between kernels); a draft model next to it still runs graphed.
    """

    def __init__(self, model: str | Path = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", speculative: SpeculativeConfig | None = None,
                 offload: bool = False, offload_prefetch: int = 2, cuda_graphs: bool | None = None):
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
        if offload:
            from redwood.engine.offload import check_prefetch, offload_layers
            from redwood.loading import parse_device

            check_prefetch(offload_prefetch)
            parse_device(device)
        loaded = load_model(model, dtype=dtype, device="cpu" if offload else device)
        if offload:  # loaded on the host: the layers stay there, the rest moves to the device
            offload_layers(loaded.model, device, prefetch=offload_prefetch)
        self.model = loaded.model
        on_cuda = self.model.device.type == "cuda"  # (load_model fused its projections there)
        if cuda_graphs and not on_cuda:
            raise ConfigError("cuda_graphs needs device='cuda'")
        # With offloading the target's forwards run eagerly; a draft model (resident) still uses graphs.
        self.runners = RunnerPool(use_graphs=on_cuda if cuda_graphs is None else cuda_graphs)
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.model_name = loaded.source
        self.model_path = loaded.path
        self.speculative = speculative
        self.drafter = None
        self.draft_name = None
        self.tree = None
        if speculative is not None:
            self.tree = speculative.make_tree()
            self.drafter = self._make_drafter(speculative, dtype, device)

    def _make_drafter(self, spec: SpeculativeConfig, dtype, device):
        from redwood.spec.drafters import ModelDrafter, SelfDrafter, check_compatible

        policy = spec.make_policy()
        if spec.self_speculate:
            self.draft_name = f"self ({policy.describe()})"
            return SelfDrafter(self.model, policy)
        draft = load_model(spec.draft_model, dtype=dtype, device=device)
        check_compatible(self.tokenizer, draft.tokenizer, self.config.vocab_size, draft.config.vocab_size)
        if spec.draft_quant:
            draft.model.quantize_skinny(spec.draft_quant)
        quant = f", {spec.draft_quant} weights" if spec.draft_quant else ""
        self.draft_name = f"{draft.source} ({policy.describe()}{quant})"
        return ModelDrafter(draft.model, policy, self.config.vocab_size)

    def _run(self, requests: list[RequestState]):
        """The generation loop for these requests: speculative when configured, else autoregressive."""
        if self.drafter is None:
            return autoregressive(self.model, requests, self.runners)
        from redwood.engine.speculative import speculative

        spec = self.speculative
        return speculative(self.model, self.drafter, requests, self.tree, spec.verifier, self.runners)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids for a text prompt (through the chat template when `chat`), or ids as given."""
        if not isinstance(prompt, str):
            if chat:
                raise ConfigError("chat=True needs text prompts, not token ids")
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ConfigError(f"{self.model_name} has no tokenizer; pass token ids instead of text")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(f"{self.model_name} has no chat template; drop --chat / chat=True")
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            ))
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def _requests(self, prompts, params, chat) -> tuple[list, list[RequestState]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ConfigError("no prompts given")
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise ConfigError(f"expected SamplingParams, got {type(p).__name__}")
            if p.stop and self.tokenizer is None:
                raise ConfigError("stop strings need a tokenizer; this model has none")
        ids = [self.encode(p, chat) for p in prompts]
        return prompts, make_requests(ids, plist, self.config, self.tokenizer)

    # ------------------------------------------------------------------ generation
    def stream(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[StreamDelta]:
        """Yield each request's new text and tokens as they are generated."""
        _, requests = self._requests(prompts, params, chat)
        sent = [0] * len(requests)
        for rows in self._run(requests):
            for b in rows:
                r = requests[b]
                delta_ids = r.output_ids[sent[b]:]
                sent[b] = len(r.output_ids)
                yield StreamDelta(index=b, text=r.pop_delta(), token_ids=delta_ids, finish_reason=r.finish_reason,
                                  stats=r.stats.to_dict() if r.finished else None)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (a batch); one RequestOutput per prompt, in order."""
        prompt_list, requests = self._requests(prompts, params, chat)
        for _ in self._run(requests):
            pass
        return [
            RequestOutput(
                prompt=p if isinstance(p, str) else None, prompt_token_ids=r.prompt_ids, text=r.text,
                token_ids=list(r.output_ids), finish_reason=r.finish_reason, stats=r.stats.to_dict(),
            )
            for p, r in zip(prompt_list, requests)
        ]
