import numpy as np
import pytest
import torch

from megabase.eval.probe import probe_distances, recall_probe, recall_windows
from megabase.eval.score import ModelScorer
from megabase.model import build_model


def test_recall_windows_repeat_a_real_segment(bundled_store):
    tokens = np.array(bundled_store.tokens("chr22"))
    for d, window, m, _ in recall_windows(tokens, [1_000, 4_000], 50, 2, seed=1):
        assert len(window) == d + m and np.array_equal(window[d:], window[:m])
        assert (window < 4).all()


def test_recall_windows_in_a_gapped_assembly_keep_the_copy_clean(hsap_store):
    tokens = np.array(hsap_store.tokens("chr22")[40_000_000:])
    starts = set()
    for d, window, m, _ in recall_windows(tokens, [16_000], 200, 32, seed=0):
        assert (window[:m] < 4).all() and (window[d:] < 4).all()
        assert (window >= 4).mean() <= 0.5
        starts.add(bytes(window[:m]))
    assert len(starts) == 32


def test_several_copies_per_window_each_repeat_d_later(hsap_store):
    tokens = np.array(hsap_store.tokens("chr22")[40_000_000:41_000_000])
    seen = 0
    for d, window, m, offsets in recall_windows(tokens, [65_536], 200, 3, seed=2, pairs=8):
        assert len(window) == d + 8_000 and len(offsets) == 8 and offsets == sorted(offsets)
        assert all(o % m == 0 and o + m <= 8_000 for o in offsets)
        for o in offsets:
            assert (window[o : o + m] < 4).all() and np.array_equal(window[o + d : o + d + m],
                                                                    window[o : o + m])
        seen += 1
    assert seen == 3

    def copier(w):  # knows every base it saw 65,536 back
        nll = np.full(len(w), np.log(4.0))
        nll[65_536:] = np.where(w[65_536:] == w[: len(w) - 65_536], 0.01, np.log(4.0))
        return nll

    row = recall_probe(copier, tokens, [65_536], n_per_distance=3, n_boot=50, pairs=8)[0]
    assert row["n_windows"] == 3 and row["n_copies"] == 24
    assert row["second_copy_bits_per_base"] < 0.1 < 1.9 < row["first_copy_bits_per_base"]


def test_probe_distances_reach_the_window_length():
    assert probe_distances(16_384, 200) == [1_000, 4_000, 16_000]
    assert probe_distances(8_192, 200) == [1_000, 4_000, 7_992]
    assert probe_distances(1_048_576, 200) == [1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000]


def test_a_copying_scorer_shows_the_second_copy_cheaper(bundled_store):
    tokens = np.array(bundled_store.tokens("chr22"))

    def copier(w):  # predicts perfectly whatever it has seen 1000+ bases before, else uniform
        nll = np.full(len(w), np.log(4.0))
        nll[1_000:1_050] = np.where(w[1_000:1_050] == w[:50], 0.01, np.log(4.0))
        return nll

    rows = recall_probe(copier, tokens, [1_000], copy_len=50, n_per_distance=8, n_boot=100)
    row = rows[0]
    assert row["n_windows"] == row["n_copies"] == 8 and row["dsa_hit_rate"] is None
    assert row["first_copy_bits_per_base"] == pytest.approx(2.0)
    assert row["second_copy_bits_per_base"] < 0.1
    lo, hi = row["second_copy_ci"]
    assert lo - 1e-12 <= row["second_copy_bits_per_base"] <= hi + 1e-12
    assert row["gain_ci"][0] > 1.5


def test_hit_rate_counts_the_aligned_key(bundled_store):
    """With topk >= the window every key is selected: the hit rate is 1; with a tiny top-k and
    keep_recent only the most recent keys are, never the first copy: 0."""
    tokens = np.array(bundled_store.tokens("chr22"))
    torch.manual_seed(0)
    dense = ModelScorer(build_model("debug", topk=512))
    row = recall_probe(dense, tokens, [300], copy_len=50, n_per_distance=2, n_boot=10)[0]
    assert row["dsa_hit_rate"] == [1.0] and row["chance_hit_rate"] == 1.0
    local = ModelScorer(build_model("debug", topk=8, keep_recent=8))
    row = recall_probe(local, tokens, [300], copy_len=50, n_per_distance=2, n_boot=10)[0]
    assert row["dsa_hit_rate"] == [0.0]
    assert row["chance_hit_rate"] == pytest.approx(np.mean(8 / np.arange(301, 351)))
