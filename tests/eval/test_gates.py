"""The DSA gates' profile: recorded by position, streamed or whole, split by repeat mask and bin."""

import numpy as np
import pytest
import torch

from megabase.core.vocab import SEP
from megabase.eval.gates import gate_profile, recording_gates
from megabase.model import log_probs
from tests.model.conftest import live_model
from tests.model.test_dsa_gate import _dsa_layers, _gated


def test_recorded_gates_are_the_layers_gates_whole_or_streamed(bundled_store):
    model = _gated(live_model("debug", dsa_gate=True)).eval()
    tokens, _ = bundled_store.fetch("chr22", 40_000, 43_001)
    x = torch.from_numpy(tokens.astype(np.int64))[None]
    with recording_gates(model, 3_000) as whole:
        log_probs(model, x)
    with recording_gates(model, 3_000) as streamed:
        log_probs(model, x, segment=[1, 1_499, 7, 1_493])
    assert len(whole) == len(_dsa_layers(model))
    for a, b in zip(whole, streamed):
        assert not np.isnan(a).any() and np.abs(a - b).max() <= 1e-5
        assert a.min() < 0.9 and a.max() > 1.1  # drawn gates: not open everywhere
    # the first layer's gate is read from its input: the same numbers by hand
    layer = _dsa_layers(model)[0].mixer
    inputs = {}
    handle = layer.register_forward_hook(lambda m, args, out: inputs.update(x=args[0]))
    with torch.no_grad():
        model(x[:, :-1])
        handle.remove()
        expected = 2 * torch.sigmoid(inputs["x"][0] @ layer.gate_proj.weight.T)
    assert np.abs(whole[0] - expected.numpy()).max() <= 1e-5


def test_the_profile_splits_unique_and_repeat_bases_by_bin(hsap_store):
    model = _gated(live_model("debug", dsa_gate=True)).eval()
    tokens, repeat = hsap_store.fetch("chr22", 40_000_000, 40_004_000)
    assert repeat.any() and (~repeat).any()
    rows = gate_profile(model, tokens, repeat, [0, 1_000, 4_000], segment=1_500)
    seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
    with recording_gates(model, len(tokens)) as gates:
        log_probs(model, seq)
    first = rows[0]["bins"][1]
    keep = (repeat[1_000:4_000]) & (tokens[1_000:4_000] < 4)
    assert first["repeat"]["n_bases"] == int(keep.sum())
    assert first["repeat"]["mean_gate"] == pytest.approx(gates[0][1_000:4_000][keep].mean(0),
                                                         abs=1e-5)
    assert len(rows) == len(gates) and len(first["unique"]["mean_gate"]) == model.cfg.dsa_heads


def test_a_model_without_gates_is_refused():
    with pytest.raises(ValueError, match="no DSA gates"):
        with recording_gates(live_model("debug"), 10):
            pass
