"""The `weights` option from the loader up (load_model, LLM / Engine for the target and the draft, the
CLI's --weights): what "auto" resolves to, and the ConfigErrors for bad values and CUDA / offload."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from redwood.cpu_kernels import kquant
from redwood.errors import ConfigError
from redwood.loading import load_model
from redwood.models.cpu_weights import auto_formats, check_weights, gguf_default, resolve_weights, w8a8_exact
from tests.conftest import save_target_and_draft
from tests.loading.test_gguf import QWEN_TYPES, random_state_dict, write_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny Qwen2 GGUF (hidden 256, vocabulary 300: int4 packs its projections but not its head)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen.gguf"
    write_gguf(path, "qwen2", random_state_dict(10, qkv_bias=True, tied=True), types=QWEN_TYPES)
    return path


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("weights-option")
    save_target_and_draft(root, tokenizer, noise=0.01)
    return root / "target", root / "draft"


def test_auto_is_the_files_own_types_for_gguf_on_the_cpu_and_float32_otherwise(gguf_file, hf_pair):
    from pathlib import Path

    from redwood.loading.gguf import read_gguf
    from redwood.models.transformer import build_model

    assert resolve_weights("auto", torch.device("cpu"), Path("m/model.gguf")) == gguf_default()
    # (the kquant kernel where it builds; else fbgemm's exact int8 sums: AVX512-VNNI)
    assert gguf_default() == ("kquant" if kquant.available() else "w8a8" if w8a8_exact() else "gguf")
    assert resolve_weights("auto", torch.device("cuda"), Path("m/model.gguf")) == "float32"
    assert resolve_weights("int4", torch.device("cpu"), Path("m")) == "int4"
    assert load_model(hf_pair[0], weights="auto").model.weights == "float32"  # a float checkpoint stays exact
    assert load_model(hf_pair[0]).model.weights == "float32"  # load_model's own default: as loaded
    assert load_model(hf_pair[0], weights="int4").model.weights == "int4"
    g = read_gguf(gguf_file)
    int4 = build_model(g.config, g.tensors, torch.float32, "cpu", rope_freqs=g.rope_freqs)
    int4.quantize_cpu("int4")
    assert int4.weights == "int4" and int4.packed_head is None  # 300 rows: the head stays float
    ids = torch.tensor([[1, 2, 3, 4]])
    assert int4(ids, torch.arange(4)[None], int4.new_cache(1, 8)).shape == (1, 4, 300)


def test_draft_auto_is_int4_for_a_gguf_draft_on_the_cpu_and_falls_back_where_int4_does_not_fit(
    gguf_file, tmp_path, monkeypatch
):
    from pathlib import Path

    from tests.conftest import random_hf_model, tiny_hf_config

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weights("auto", cpu, Path("m/draft.gguf"), draft=True) == gguf_default(draft=True)
    assert gguf_default(draft=True) == ("q4k" if kquant.available() else "w8a8" if w8a8_exact() else "int4")
    assert resolve_weights("auto", cuda, Path("m/draft.gguf"), draft=True) == "float32"
    assert resolve_weights("auto", cpu, Path("m"), draft=True) == "float32"  # a float checkpoint stays exact
    assert resolve_weights("int8", cpu, Path("m/draft.gguf"), draft=True) == "int8"
    from redwood.loading import ModelInfo
    from redwood.loading.gguf import read_gguf_config

    info = ModelInfo(config=read_gguf_config(gguf_file), tokenizer=None, source="tiny", path=gguf_file)
    assert load_model(info, weights="auto", draft=True).model.weights == gguf_default(draft=True)
    assert load_model(info, weights="auto").model.weights == gguf_default()
    assert auto_formats("int4") == ("int4", "int8", "float32") and auto_formats("bfloat16") == ("bfloat16",)
    assert auto_formats("w8a8") == ("w8a8", "int8", "float32")
    # hidden 48 is not whole 32-input int4 groups: "auto" resolving to int4 takes int8 instead (as a GGUF
    # draft of that shape would), where an explicit int4 is an error
    config = tiny_hf_config("qwen2", hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    random_hf_model(config).save_pretrained(tmp_path / "odd")
    monkeypatch.setattr("redwood.loading.resolve_weights", lambda *a, **k: "int4")
    assert load_model(tmp_path / "odd", weights="auto", draft=True).model.weights == "int8"
    with pytest.raises(ConfigError, match="int4 needs out_features % 16 == 0"):
        load_model(tmp_path / "odd", weights="int4", draft=True)


@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_packed_as_it_loads_equals_the_loaded_model_packed(tmp_path, tied):
    """load_model packs each projection of a GGUF as it is dequantized (`cpu_weights.packer`): the same
    buffers, biases and logits as loading the float model and packing it (quantize_cpu)."""
    from redwood.loading import ModelInfo
    from redwood.loading.gguf import read_gguf, read_gguf_config
    from redwood.models.transformer import build_model

    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", random_state_dict(3, qkv_bias=True, tied=tied), types=QWEN_TYPES)
    info = ModelInfo(config=read_gguf_config(path), tokenizer=None, source="m", path=path)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for kind in ("int8", "int4", "bfloat16"):
        streamed = load_model(info, weights=kind).model
        g = read_gguf(path)
        ref = build_model(g.config, g.tensors, torch.float32, "cpu", rope_freqs=g.rope_freqs)
        ref.quantize_cpu(kind)
        assert streamed.weights == kind and (streamed.packed_head is None) == (ref.packed_head is None)
        a, b = dict(streamed.named_buffers()), dict(ref.named_buffers())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind
        assert streamed.layers[0].self_attn.q_proj.bias is not None
        assert torch.equal(
            streamed(ids, torch.arange(5)[None], streamed.new_cache(1, 8)),
            ref(ids, torch.arange(5)[None], ref.new_cache(1, 8)),
        )


def test_bad_values_and_cuda_are_config_errors():
    with pytest.raises(ConfigError, match="unknown weights 'fp8'; choose one of auto, float32, bfloat16, int8, int4"):
        check_weights("fp8", torch.device("cpu"))
    with pytest.raises(ConfigError, match="weights='int8' is a CPU format; on CUDA"):
        check_weights("int8", torch.device("cuda"))
    with pytest.raises(ConfigError, match="weights='int4' is a CPU format"):
        check_weights("int4", torch.device("cpu"), offload=True)
    with pytest.raises(ConfigError, match="draft_weights='int4' is a CPU format; on CUDA"):
        resolve_weights("int4", torch.device("cuda"), "d.gguf", draft=True)
    with pytest.raises(ConfigError, match="unknown draft_weights 'int2'"):
        check_weights("int2", torch.device("cpu"), name="draft_weights")
    check_weights("auto", torch.device("cuda"))
    check_weights("float32", torch.device("cuda"))


def test_llm_quantizes_target_and_draft(hf_pair):
    from redwood import LLM, SamplingParams
    from redwood.speculation.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="unknown weights 'int3'"):
        LLM(str(hf_pair[0]), weights="int3")
    spec = SpeculativeConfig(draft_model=str(hf_pair[1]), num_draft_tokens=3)
    llm = LLM(str(hf_pair[0]), weights="int8", speculative=spec)  # --weights is the target's alone
    assert llm.model.weights == "int8" and llm.engine.drafter.own_model.weights == "float32"  # (auto: a float folder)
    ar = LLM(str(hf_pair[0]), weights="int8")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = [[5, 17, 40, 9, 33, 120]]
    want = ar.generate(prompt, params)[0].token_ids
    assert llm.generate(prompt, params)[0].token_ids == want
    for kind in ("int8", "int4"):
        llm = LLM(str(hf_pair[0]), weights="int8", speculative=replace(spec, draft_weights=kind))
        assert llm.model.weights == "int8" and llm.engine.drafter.own_model.weights == kind
        assert f"{kind} weights" in llm.draft_name
        assert llm.generate(prompt, params)[0].token_ids == want  # the draft's format moves acceptance only


def test_draft_weights_needs_a_draft_model(hf_pair):
    from redwood import LLM
    from redwood.speculation.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="unknown draft_weights 'int3'"):
        SpeculativeConfig(draft_model=str(hf_pair[1]), draft_weights="int3")
    with pytest.raises(ConfigError, match="draft_weights moved to SpeculativeConfig\\(draft_weights=...\\)"):
        LLM(str(hf_pair[0]), draft_weights="int4")
    with pytest.raises(ConfigError, match="self-speculation drafts with the target's weights"):
        SpeculativeConfig(
            self_speculate=True, draft_kv="streaming", draft_budget=8, num_draft_tokens=2, draft_weights="int4"
        )


def test_draft_weights_on_each_device():
    """What SpeculativeConfig.draft_weights means where the draft runs: every CPU format on the CPU; on CUDA
    auto / float32 (the model's dtype) or int8 (int8 copies for the one-token forwards), else a ConfigError."""
    from redwood.models.cpu_weights import WEIGHT_CHOICES, draft_weights_on

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert all(draft_weights_on(w, cpu) == (w, None) for w in WEIGHT_CHOICES)
    assert draft_weights_on("auto", cuda) == ("auto", None) and draft_weights_on("float32", cuda) == ("float32", None)
    assert draft_weights_on("int8", cuda) == ("auto", "int8")
    for w in ("bfloat16", "int4", "w8a8", "q4k", "gguf", "kquant"):
        with pytest.raises(
            ConfigError,
            match=f"draft_weights='{w}' is a CPU format; on CUDA a draft model takes "
            f"auto or float32 \\(its dtype\\) or int8",
        ):
            draft_weights_on(w, cuda)
    with pytest.raises(ConfigError, match="unknown draft_weights 'int3'"):
        draft_weights_on("int3", cpu)


def test_cuda_draft_format_is_refused_before_loading(hf_pair, monkeypatch):
    """A CPU format for a CUDA draft: the error comes before any weight loads (any machine: nothing loads)."""
    import redwood.engine.loaded as loaded
    from redwood import LLM
    from redwood.speculation.config import SpeculativeConfig

    def no_loading(*a, **k):
        raise AssertionError("weights loaded before the draft format was checked")

    monkeypatch.setattr(loaded, "load_model", no_loading)
    monkeypatch.setattr(loaded, "inspect_model", no_loading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (the check needs no GPU)
    spec = SpeculativeConfig(draft_model=str(hf_pair[1]), draft_weights="int4")
    with pytest.raises(ConfigError, match="draft_weights='int4' is a CPU format; on CUDA"):
        LLM(str(hf_pair[0]), device="cuda", speculative=spec)


def test_cli_weights_flag(hf_pair, capsys):
    from redwood.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--model", str(hf_pair[0]), "--weights", "int3", "--prompt", "hi"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [
        ["generate"],
        ["serve"],
        ["acceptance"],
        ["profile"],
        ["bench", "ar"],
        ["bench", "standalone"],
        ["bench", "selfspec"],
        ["bench", "throughput"],
    ],
)
def test_every_command_that_loads_a_model_takes_weights(command, capsys):
    """Each command passes args.weights to what it loads, so each parser must define --weights."""
    from redwood.cli import main

    with pytest.raises(SystemExit):
        main(command + ["--help"])
    assert "--weights {auto,float32,bfloat16,int8,int4,w8a8,q4k,gguf,kquant}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "command", [["generate"], ["serve"], ["acceptance"], ["profile"], ["bench", "standalone"], ["bench", "throughput"]]
)
def test_every_command_with_a_draft_model_takes_draft_weights(command, capsys):
    from redwood.cli import main

    with pytest.raises(SystemExit):
        main(command + ["--help"])
    out = capsys.readouterr().out
    assert "--draft-model" in out and "--draft-weights {auto,float32,bfloat16,int8,int4,w8a8,q4k,gguf,kquant}" in out


@pytest.mark.parametrize(
    "command, flags, msg",
    [
        (["generate", "--prompt", "x"], ["--draft-weights", "int4"], "--draft-weights only applies when speculating"),
        (
            ["generate", "--prompt", "x"],
            ["--self-speculate", "--draft-weights", "int4"],
            "self-speculation drafts with the target's weights",
        ),
        (
            ["profile", "--output", "p.json"],
            ["--draft-weights", "int8"],
            "--draft-weights only applies with --draft-model",
        ),
        (
            [
                "acceptance",
                "--width",
                "2",
                "--mode",
                "dynamic",
                "--temperature",
                "0",
                "--dataset",
                "humaneval",
                "--output",
                "a.json",
            ],
            ["--self-speculate", "--draft-kv", "streaming", "--draft-budget", "8", "--draft-weights", "int4"],
            "self-speculation drafts with the target's weights",
        ),
    ],
)
def test_draft_weights_flag_errors(command, flags, msg, tmp_path, capsys):
    """One line on stderr, exit status 2, before any model loads (the model path does not exist)."""
    from redwood.cli import main

    assert main(command + ["--model", str(tmp_path / "nope")] + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and msg in err and err.count("\n") == 1, err


def test_draft_weights_flag_choices(capsys):
    from redwood.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--draft-model", "d", "--draft-weights", "int3", "--prompt", "hi"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_bench_ar_reports_the_weights_and_refuses_hf_comparison_of_packed_weights(hf_pair):
    from redwood import LLM
    from redwood.bench.ar import format_result, run_ar_bench

    llm = LLM(str(hf_pair[0]), weights="int8")
    with pytest.raises(ConfigError, match="--compare-hf runs Hugging Face transformers on the same float weights"):
        run_ar_bench(llm, 1, 8, 4, compare_hf=True)
    result = run_ar_bench(llm, 1, 8, 4)
    assert result["weights"] == "int8" and "int8 weights" in format_result(result)


def test_auto_says_why_when_the_kquant_kernel_did_not_build(monkeypatch):
    """A CPU that could run kquant but whose kernel did not build (no compiler, a failed build): "auto" warns
    with the reason and falls back; a CPU without the instructions falls back quietly."""
    import warnings

    monkeypatch.setattr(kquant, "why_unavailable", lambda: "no C++ compiler (install g++) to build the kernel")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler .*CPU weights fall back to (w8a8|gguf)"):
        assert gguf_default() == ("w8a8" if w8a8_exact() else "gguf")
    monkeypatch.setattr(kquant, "why_unavailable", lambda: "this CPU lacks avx512_vnni")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gguf_default(draft=True) == ("w8a8" if w8a8_exact() else "int4")
