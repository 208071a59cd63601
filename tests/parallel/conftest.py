"""The tensor-parallel tests' models: one clear-margin tiny target and its noisy copy as the draft, written once."""

from __future__ import annotations

import pytest

from tests.conftest import save_target_and_draft


@pytest.fixture(scope="session")
def folders(tmp_path_factory, tokenizer):
    """(target folder, draft folder): a clear-margin random Qwen2 model (4 attention heads, 2 KV heads: it splits
    over 2 and 4 ranks) and the same weights plus N(0, 0.01²) noise (a draft that agrees often)."""
    root = tmp_path_factory.mktemp("tp-models")
    save_target_and_draft(root, tokenizer, noise=0.01)
    return root / "target", root / "draft"
