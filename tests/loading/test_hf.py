"""Hugging Face folder loading: single and sharded safetensors, tokenizer, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from redwood.errors import ModelLoadError, UnsupportedModelError
from redwood.loading import load_model
from tests.conftest import random_hf_model, tiny_hf_config


def test_sharded_folder_loads_same_weights(tmp_path, tiny_model_dir):
    hf = random_hf_model(tiny_hf_config("llama"), seed=3)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    hf.save_pretrained(tmp_path / "single")
    a = load_model(tmp_path / "sharded").model.state_dict()
    b = load_model(tmp_path / "single").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tokenizer_loaded_with_folder(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template


def test_dtype_applied(tiny_model_dir):
    assert load_model(tiny_model_dir, dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16


def test_folder_errors(tmp_path, tiny_model_dir):
    # no weights at all
    (tmp_path / "empty").mkdir()
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(tmp_path / "empty")
    # only a PyTorch checkpoint
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="convert them to safetensors"):
        load_model(tmp_path / "empty")
    # a truncated safetensors file
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(bad)
    # weights that do not fit the config
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny_model_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(wrong)
    # an unsupported architecture
    cfg["model_type"] = "gpt2"
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(wrong)
    # a bad config.json
    (wrong / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(wrong)


def test_inspect_reads_no_weights_and_load_reuses_its_tokenizer(tiny_model_dir, monkeypatch):
    import redwood.loading.hf as hf
    from redwood.loading import inspect_model

    def refuse(*args):
        raise AssertionError("inspect_model read the weights")

    with monkeypatch.context() as m:
        m.setattr(hf, "read_hf_folder", refuse)
        info = inspect_model(str(tiny_model_dir))
    assert info.tokenizer is not None and info.path == tiny_model_dir and info.source == str(tiny_model_dir)
    assert inspect_model(info) is info
    loaded = load_model(info)
    assert loaded.config == info.config and loaded.tokenizer is info.tokenizer and loaded.source == info.source
