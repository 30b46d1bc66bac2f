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


def test_streamed_control_pieces_equal_whole_pieces(bundled_store):
    """The model's control streams each piece in the scorer's segments: the numbers of scoring
    every piece whole, in a process with no streaming at all."""
    import torch

    from megabase.eval.score import ModelScorer
    from megabase.model import build_model

    torch.manual_seed(0)
    model = build_model("debug")
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)  # zero-started: every base would score log 4
    tokens = np.array(bundled_store.tokens("chr22")[:1_037])
    streamed = truncated(ModelScorer(model, segment=64), 100)(tokens)
    whole = truncated(ModelScorer(model), 100)(tokens)
    assert np.isfinite(streamed).sum() > 1_000
    assert np.allclose(streamed, whole, rtol=1e-5, atol=1e-5, equal_nan=True)
    full = ModelScorer(model)(tokens)
    assert not np.allclose(streamed[200:], full[200:], rtol=1e-3, atol=1e-3, equal_nan=True)
