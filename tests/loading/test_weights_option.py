"""The `weights` option from the loader up (load_model, LLM / Engine for the target and the draft, the
CLI's --weights): what "auto" resolves to, and the ConfigErrors for bad values and CUDA / offload."""

from __future__ import annotations

import pytest
import torch

from redwood.errors import ConfigError
from redwood.loading import load_model
from redwood.models.cpu_weights import check_weights, resolve_weights
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


def test_auto_is_int8_for_gguf_on_the_cpu_and_float32_otherwise(gguf_file, hf_pair):
    from pathlib import Path

    from redwood.loading.gguf import read_gguf
    from redwood.models.transformer import build_model

    assert resolve_weights("auto", torch.device("cpu"), Path("m/model.gguf")) == "int8"
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


def test_bad_values_and_cuda_are_config_errors():
    with pytest.raises(ConfigError, match="unknown weights 'fp8'; choose one of auto, float32, bfloat16, int8, int4"):
        check_weights("fp8", torch.device("cpu"))
    with pytest.raises(ConfigError, match="weights='int8' is a CPU format; on CUDA"):
        check_weights("int8", torch.device("cuda"))
    with pytest.raises(ConfigError, match="weights='int4' is a CPU format"):
        check_weights("int4", torch.device("cpu"), offload=True)
    check_weights("auto", torch.device("cuda"))
    check_weights("float32", torch.device("cuda"))


def test_llm_quantizes_target_and_draft(hf_pair):
    from redwood import LLM, SamplingParams
    from redwood.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="unknown weights 'int3'"):
        LLM(str(hf_pair[0]), weights="int3")
    spec = SpeculativeConfig(draft_model=str(hf_pair[1]), num_draft_tokens=3)
    llm = LLM(str(hf_pair[0]), weights="int8", speculative=spec)
    assert llm.model.weights == "int8" and llm.engine.drafter.own_model.weights == "int8"
    ar = LLM(str(hf_pair[0]), weights="int8")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = [[5, 17, 40, 9, 33, 120]]
    assert llm.generate(prompt, params)[0].token_ids == ar.generate(prompt, params)[0].token_ids


def test_cli_weights_flag(hf_pair, capsys):
    from redwood.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--model", str(hf_pair[0]), "--weights", "int3", "--prompt", "hi"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["acceptance"], ["profile"], ["bench", "ar"],
                                     ["bench", "standalone"], ["bench", "selfspec"], ["bench", "throughput"]])
def test_every_command_that_loads_a_model_takes_weights(command, capsys):
    """Each command passes args.weights to what it loads, so each parser must define --weights."""
    from redwood.cli import main

    with pytest.raises(SystemExit):
        main(command + ["--help"])
    assert "--weights {auto,float32,bfloat16,int8,int4}" in capsys.readouterr().out


def test_bench_ar_reports_the_weights_and_refuses_hf_comparison_of_packed_weights(hf_pair):
    from redwood import LLM
    from redwood.bench.ar import format_result, run_ar_bench

    llm = LLM(str(hf_pair[0]), weights="int8")
    with pytest.raises(ConfigError, match="--compare-hf runs Hugging Face transformers on the same float weights"):
        run_ar_bench(llm, 1, 8, 4, compare_hf=True)
    result = run_ar_bench(llm, 1, 8, 4)
    assert result["weights"] == "int8" and "int8 weights" in format_result(result)
