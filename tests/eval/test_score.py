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
