"""torch's CPU threads: `threads=` / `--threads N` over OMP_NUM_THREADS over the measured default."""

from __future__ import annotations

import pytest
import torch

from redwood.engine.threads import SMALL_MACHINE_CORES, apply_threads, default_threads, resolve_threads
from redwood.errors import ConfigError


def test_default_rule_is_one_thread_on_small_machines_and_torchs_own_above():
    from redwood.engine.threads import _TORCH_DEFAULT

    assert [default_threads(c) for c in (1, 2)] == [1, 1] and default_threads(SMALL_MACHINE_CORES) == 1
    assert [default_threads(c) for c in (3, 16)] == [_TORCH_DEFAULT] * 2


def test_precedence_explicit_then_environment_then_default():
    assert resolve_threads(3, env={"OMP_NUM_THREADS": "2"}) == 3  # an explicit count wins
    assert resolve_threads(None, env={"OMP_NUM_THREADS": "2"}) is None  # the user's variable: torch read it
    assert resolve_threads(None, env={"OMP_NUM_THREADS": " "}) == default_threads()  # (blank: unset)
    assert resolve_threads(None, env={}) == default_threads()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_counts_are_config_errors(bad):
    with pytest.raises(ConfigError, match="threads must be a positive integer"):
        resolve_threads(bad)


def test_apply_sets_torch_and_respects_the_environment(monkeypatch):
    torch.set_num_threads(2)
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(2)
    assert apply_threads(None) == 2  # left as it was
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert apply_threads(None) == default_threads() == torch.get_num_threads()


def test_llm_threads_sets_torch_before_loading(tiny_model_dir, monkeypatch):
    from redwood import LLM
    import redwood.engine.engine as engine_mod

    seen = []
    real_load = engine_mod.load_model

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "load_model", spy)
    torch.set_num_threads(1)
    llm = LLM(str(tiny_model_dir), threads=2)
    assert seen == [2] and torch.get_num_threads() == 2  # (loading ran on them too)
    from redwood import SamplingParams

    assert len(llm.generate("a b", SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2
    with pytest.raises(ConfigError, match="threads must be a positive integer"):
        LLM(str(tiny_model_dir), threads=0)


@pytest.mark.parametrize("kind", ["int8", "int4", "bfloat16"])
def test_packed_projections_give_the_same_rows_at_1_and_2_threads(kind):
    """A decode step's or a verify's rows (under the gemm threshold) do not depend on the thread count:
    the packed kernels split the output rows among threads, never a sum. (A prefill chunk of ≥ 128 rows
    takes oneDNN's bfloat16 gemm, whose sums do depend on it: NOTES.md session 13; not asserted here.)"""
    from redwood.models.cpu_weights import INT4_GEMM_ROWS, PackedLinear

    g = torch.Generator().manual_seed(0)
    p = PackedLinear(torch.randn(1024, 512, generator=g) * 0.05, torch.randn(1024, generator=g), kind)
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 4, 9, 17, 65, INT4_GEMM_ROWS - 1):
            x = torch.randn(rows, 512, generator=g)
            torch.set_num_threads(1)
            one = p(x)
            torch.set_num_threads(2)
            assert torch.get_num_threads() == 2 and torch.equal(p(x), one), rows
    finally:
        torch.set_num_threads(before)
