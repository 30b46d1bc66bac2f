"""Routing stays balanced on real DNA: the trainer's bias update, measured on held-out sequence.

The debug model with 8 experts, trained 40 steps on U. maydis, routes a held-out window unevenly
under DeepSeek-V3's sign update at its published rate (max/mean 2.42, and 1.99 once the short conv
ran in C, 1.77 with the demo's synthetic-repeat curriculum, now the default: a 40-step trajectory
moves with the last bits of a kernel and of what it is trained on; before the k-mer input and the
base-only head it collapsed outright, as the cpu-small demo did, with idle experts); with the
default update (``quantile``) every layer routes it evenly (<= 1.5, none idle: 1.09 at most). Both halves are
asserted, so the test would fail if the default collapsed and cannot pass by measuring nothing.
"""

import numpy as np
import pytest
import torch

from megabase.core.vocab import SEP
from megabase.model import load_checkpoint
from megabase.pipeline.cli import main


def _held_out_load(bundled_store, workdir, **overrides) -> torch.Tensor:
    sets = {"name": "moe", "workdir": str(workdir), "data.store": str(bundled_store.path),
            "data.window_length": "4096", "model.preset": "debug", "model.overrides.n_experts": "8",
            "train.steps": "40", "train.seq_warmup": "false", "train.checkpoint_every": "40",
            "eval.enabled": "false", **{f"model.overrides.{k}": str(v) for k, v in overrides.items()}}
    assert main(["train", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")],
                 "--quiet"]) == 0
    model = load_checkpoint(workdir / "runs" / "moe" / "checkpoints" / "step-000040").eval()
    tokens = np.array(bundled_store.tokens("chr22")[100_000:116_384])
    seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
    with torch.no_grad():
        return model(seq[:, :-1], seq[:, 1:]).expert_load


def _ratio(load: torch.Tensor) -> list[float]:
    return (load.max(-1).values / load.mean(-1)).tolist()


@pytest.mark.parametrize("update", ["default", "deepseek-sign"])
def test_routing_on_a_held_out_window(bundled_store, tmp_path, update):
    if update == "default":
        load = _held_out_load(bundled_store, tmp_path)
        assert max(_ratio(load)) <= 1.5, _ratio(load)
        assert int((load == 0).sum()) == 0
    else:
        load = _held_out_load(bundled_store, tmp_path, bias_update="sign", bias_update_rate=1e-3)
        # measured 2.42, 1.99, then 1.77 (1.88 without the curriculum): well above the 1.5 the
        # default must meet, so the test sees imbalance
        assert max(_ratio(load)) > 1.6, _ratio(load)
