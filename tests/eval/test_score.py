import numpy as np
import pytest

from megabase.eval.markov import MarkovModel
from megabase.eval.score import markov_scorer, recall_probe, recall_windows, truncated


@pytest.fixture(scope="module")
def markov(bundled_store):
    return MarkovModel(3).fit(np.array(bundled_store.tokens("chr01")[:500_000]))


def test_truncation_control_is_exact_for_a_short_memory_scorer(markov, bundled_store):
    tokens = np.array(bundled_store.tokens("chr22")[:5_003])
    full = markov_scorer(markov)(tokens)
    control = truncated(markov_scorer(markov), 1_000)(tokens)
    # an order-3 model only looks 3 bases back: cutting context to >= 1000 changes nothing
    assert np.allclose(control, full, equal_nan=True)


def test_truncation_control_limits_context():
    seen = []

    def spy(tokens):
        seen.append(len(tokens))
        return np.zeros(len(tokens))

    out = truncated(spy, 100)(np.zeros(450, np.uint8))
    assert seen == [100, 200, 200, 200, 150] and out.shape == (450,)


def test_recall_windows_repeat_a_real_segment(bundled_store):
    tokens = np.array(bundled_store.tokens("chr22"))
    for d, window, m in recall_windows(tokens, [1_000, 4_000], 50, 2, seed=1):
        assert len(window) == d + m and np.array_equal(window[d:], window[:m])
        assert (window < 4).all()


def test_a_copying_scorer_shows_the_second_copy_cheaper(bundled_store):
    tokens = np.array(bundled_store.tokens("chr22"))

    def copier(w):  # predicts perfectly whatever it has seen 1000+ bases before, else uniform
        nll = np.full(len(w), np.log(4.0))
        nll[1_000:1_050] = np.where(w[1_000:1_050] == w[:50], 0.01, np.log(4.0))
        return nll

    rows = recall_probe(copier, tokens, [1_000], copy_len=50, n_per_distance=3)
    assert rows[0]["first_copy_bits_per_base"] == pytest.approx(2.0)
    assert rows[0]["second_copy_bits_per_base"] < 0.1
