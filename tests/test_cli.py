"""The `redwood` command line: generate (human and JSON output), bench ar, and clear errors."""

from __future__ import annotations

import json

from redwood.cli import main


def test_generate_human_output(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "Paris is", "--max-new-tokens", "6",
               "--ignore-eos"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.rstrip("\n").split("\n")
    assert lines[-1].startswith("[") and "6 generated (length)" in lines[-1] and "tokens/s" in lines[-1]


def test_generate_json_matches_api(tiny_model_dir, tiny_llm, capsys):
    from redwood import SamplingParams

    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "def add(a, b):", "--chat",
               "--max-new-tokens", "7", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--seed", "4",
               "--ignore-eos", "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) >= {"text", "token_ids", "stats"}
    ref = tiny_llm.generate(["def add(a, b):"], SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=4,
                                                                max_new_tokens=7, ignore_eos=True), chat=True)[0]
    assert obj["token_ids"] == ref.token_ids and obj["text"] == ref.text
    assert obj["stats"]["generated_tokens"] == 7


def test_bench_ar_compare_hf(tiny_model_dir, capsys, tmp_path):
    rc = main(["bench", "ar", "--model", str(tiny_model_dir), "--prompt-len", "16", "--gen-len", "8",
               "--batch-size", "2", "--compare-hf", "--json", "--output", str(tmp_path / "rep")])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["hf_same_tokens"] is True
    assert res["redwood"]["decode_tokens_per_s"] > 0 and res["speedup_vs_hf"] > 0
    assert (tmp_path / "rep" / "report.json").exists()


def test_errors_are_one_line_with_status_2(tmp_path, capsys):
    cases = [
        (["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"], "no such model or path"),
        (["generate", "--model", "x", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--model", "x", "--prompt", "x", "--top-p", "2"], "top_p"),
        (["generate", "--model", str(tmp_path), "--prompt", "x"], "neither a Hugging Face model folder"),
        (["bench", "ar", "--model", "x", "--gen-len", "0"], "--gen-len"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("redwood: error:") and msg in err and "Traceback" not in err


def test_dtype_device_errors(tiny_model_dir, capsys):
    import torch

    if not torch.cuda.is_available():
        assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--device", "cuda"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--device", "tpu"]) == 2
    assert "device" in capsys.readouterr().err


def test_bfloat16_runs(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "Paris", "--dtype", "bfloat16",
                 "--max-new-tokens", "4", "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
