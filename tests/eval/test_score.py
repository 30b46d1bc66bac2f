import numpy as np
import pytest

from megabase.eval.markov import MarkovModel
from megabase.eval.score import markov_scorer, truncated


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


def test_batched_control_equals_one_piece_at_a_time(bundled_store):
    import torch

    from megabase.eval.score import ModelScorer
    from megabase.model import build_model

    torch.manual_seed(0)
    scorer = ModelScorer(build_model("debug"))
    tokens = np.array(bundled_store.tokens("chr22")[:1_037])
    batched = truncated(scorer, 100, batch=3)(tokens)
    alone = truncated(lambda t: scorer(t), 100)(tokens)  # no ``many``: piece by piece
    assert np.isfinite(batched).sum() > 1_000
    assert np.allclose(batched, alone, rtol=1e-5, atol=1e-5, equal_nan=True)
