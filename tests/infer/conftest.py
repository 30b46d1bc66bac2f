"""A debug-preset checkpoint whose outputs depend on the sequence (the zero-started head and k-mer
tables drawn at random), shared by the tests of megabase.infer."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from megabase.model import build_model, save_checkpoint

    torch.manual_seed(0)
    model = build_model("debug")
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
        model.kmers.table.normal_(0, 0.3)
    return save_checkpoint(model, tmp_path_factory.mktemp("infer") / "ckpt")
