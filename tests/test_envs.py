"""redwood.envs: one registry of REDWOOD_* settings; bad values are ConfigErrors naming the choices."""

from __future__ import annotations

import pytest

from redwood import envs
from redwood.errors import ConfigError


def test_a_setting_reads_its_default_its_value_and_rejects_others(monkeypatch):
    monkeypatch.delenv(envs.CPU_ISA, raising=False)
    assert envs.get(envs.CPU_ISA) == "native"
    monkeypatch.setenv(envs.CPU_ISA, "avx2")
    assert envs.get(envs.CPU_ISA) == "avx2"
    monkeypatch.setenv(envs.CPU_ISA, "avx9000")
    with pytest.raises(ConfigError, match="REDWOOD_CPU_ISA='avx9000' is not one of native, avx2"):
        envs.get(envs.CPU_ISA)


def test_every_setting_is_documented_and_its_default_is_a_choice():
    assert envs.SETTINGS
    for s in envs.SETTINGS.values():
        assert s.name.startswith("REDWOOD_") and s.doc
        assert s.choices is None or s.default in s.choices
    assert {name for name, _, _ in envs.describe()} == set(envs.SETTINGS)


def test_the_registry_holds_only_what_users_set():
    """Execution switches are ExecutionConfig fields and benchmark switches benchmark arguments, not settings.
    (REDWOOD_TP_TIMEOUT is a deployment's: every tensor-parallel rank reads it before any config reaches it, as
    torch's own NCCL timeouts are set.)"""
    assert set(envs.SETTINGS) == {"REDWOOD_HOME", "REDWOOD_CPU_ISA", "REDWOOD_CPU_KERNEL", "REDWOOD_TP_TIMEOUT"}
