import numpy as np
import pytest
import torch


@pytest.fixture(scope="session")
def real_tokens(bundled_store):
    """20,001 real bases of U. maydis chr01 as int64 ``[1, T]``."""
    tokens, _ = bundled_store.fetch("chr01", 1_000_000, 1_020_001)
    return torch.from_numpy(tokens.astype(np.int64))[None]


def live_model(preset: str = "debug", **overrides):
    """A freshly built model (seed 0) whose zero-started head and k-mer tables are drawn at random:
    at initialisation the zero head sends no gradient into the layers, and a gradient test would
    then compare zeros."""
    from megabase.model import build_model

    torch.manual_seed(0)
    model = build_model(preset, **overrides)
    with torch.no_grad():
        if model.head is not None:
            model.head.weight.normal_(0, 0.5)
        if model.kmers is not None:
            model.kmers.table.normal_(0, 0.3)
    return model
