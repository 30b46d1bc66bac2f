import numpy as np
import pytest

from megabase.data.augment import plant_repeats
from megabase.core.vocab import PAD


def _windows(store, n, length):
    tokens = np.array(store.tokens("chr01"))
    start = 1_000_000  # away from the telomeric repeats at the chromosome end
    return [tokens[start + i * length : start + (i + 1) * length] for i in range(n)]


def _repeated_16mers(x: np.ndarray) -> float:
    """Fraction of positions that end a 16-mer seen earlier in ``x``."""
    code = np.zeros(len(x) - 15, dtype=np.int64)
    for j in range(16):
        code = code * 5 + x[j : len(x) - 15 + j].astype(np.int64)
    first = np.unique(code, return_index=True)[1]
    return 1 - len(first) / len(code)


def test_planted_copies_repeat_earlier_sequence_of_the_window(bundled_store):
    for i, w in enumerate(_windows(bundled_store, 4, 8192)):
        out = plant_repeats(w, np.random.default_rng(i), frac=0.2, length=(50, 400))
        assert 0.05 < (out != w).mean() < 0.3  # about frac of the bases, minus agreeing copies
        assert _repeated_16mers(w) < 0.02 < 0.12 < _repeated_16mers(out)


def test_plant_repeats_is_seeded_and_keeps_padding_and_length():
    w = np.random.default_rng(0).integers(0, 4, 3000).astype(np.uint8)
    w[2500:] = PAD
    a = plant_repeats(w, np.random.default_rng(7), 0.3, (20, 200), divergence=0.1)
    b = plant_repeats(w, np.random.default_rng(7), 0.3, (20, 200), divergence=0.1)
    assert np.array_equal(a, b) and a.dtype == np.uint8 and len(a) == 3000
    assert (a[2500:] == PAD).all() and (a[:2500] < 4).all()
    assert np.array_equal(plant_repeats(w, np.random.default_rng(7), 0.0), w)


def test_divergence_substitutes_bases():
    w = np.random.default_rng(1).integers(0, 4, 20000).astype(np.uint8)
    exact = plant_repeats(w, np.random.default_rng(3), 0.5, (500, 500))
    mutated = plant_repeats(w, np.random.default_rng(3), 0.5, (500, 500), divergence=0.5)
    assert (exact != mutated).mean() > 0.02


@pytest.mark.parametrize("frac", [0.1, 0.5])
def test_short_windows_are_left_alone_or_covered(frac):
    w = np.zeros(30, np.uint8)
    assert np.array_equal(plant_repeats(w, np.random.default_rng(0), frac, (20, 100)), w)
