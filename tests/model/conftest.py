import numpy as np
import pytest
import torch


@pytest.fixture(scope="session")
def real_tokens(bundled_store):
    """20,001 real bases of U. maydis chr01 as int64 ``[1, T]``."""
    tokens, _ = bundled_store.fetch("chr01", 1_000_000, 1_020_001)
    return torch.from_numpy(tokens.astype(np.int64))[None]
