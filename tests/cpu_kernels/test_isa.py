"""redwood.cpu_kernels.isa: REDWOOD_CPU_ISA caps the CPU features every capability probe sees, so one machine
answers them as an AVX2-only CPU would (the kquant kernel unavailable, no exact w8a8)."""

from __future__ import annotations

from redwood import envs
from redwood.cpu_kernels import isa, kquant
from redwood.models import cpu_weights


def test_the_avx2_cap_drops_avx512_vnni_and_amx(monkeypatch):
    monkeypatch.setattr(
        isa, "_host_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile"})
    )
    isa._flags.cache_clear()
    try:
        monkeypatch.delenv(envs.CPU_ISA, raising=False)
        assert "avx512_vnni" in isa.cpu_flags() and isa.allows("avx512_vnni") and isa.capped() is None
        monkeypatch.setenv(envs.CPU_ISA, "avx2")
        assert isa.cpu_flags() == {"avx2", "fma", "f16c"}
        assert not isa.allows("avx512_vnni") and isa.allows("avx2") and isa.capped() == "avx2"
    finally:
        isa._flags.cache_clear()


def test_capped_probes_answer_as_an_avx2_cpu(monkeypatch):
    monkeypatch.setenv(envs.CPU_ISA, "avx2")
    kquant.why_unavailable.cache_clear()
    monkeypatch.setattr(cpu_weights, "_W8A8_EXACT", [])
    try:
        why = kquant.why_unavailable()
        assert why.startswith("this CPU lacks avx512") and why.endswith("(under REDWOOD_CPU_ISA=avx2)")
        assert not cpu_weights.w8a8_exact()
        assert cpu_weights.gguf_default() == "gguf" and cpu_weights.gguf_default(draft=True) == "int4"
    finally:
        kquant.why_unavailable.cache_clear()
