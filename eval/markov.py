"""Order-k Markov baselines: counts vectorised in numpy, scored per base like the model.

Smoothing: additive (Krichevsky–Trofimov, ``alpha = 0.5`` pseudo-count per base):
``p(b | c) = (n(c, b) + alpha) / (n(c) + 4 alpha)``, where ``c`` are the ``k`` bases before ``b``.
Counts are kept for every order ``0..k``; a base with fewer than ``k`` clean bases before it (the
start of a window, or an ``N`` inside the last ``k``) is scored by the longest clean context it has,
so a model never looks across a window start or an ``N``. ``N`` is never a target.
"""

from __future__ import annotations

import numpy as np

from megabase.core.vocab import N_BASES

MAX_ORDER = 14
ALPHA = 0.5


def _clean_run(tokens: np.ndarray) -> np.ndarray:
    """For each position, how many A/C/G/T bases directly precede it (stops at an N)."""
    idx = np.arange(len(tokens))
    last_n = np.maximum.accumulate(np.where(tokens < N_BASES, -1, idx))
    ending_here = idx - last_n  # clean bases ending at each position (0 at an N)
    return np.concatenate([[0], ending_here[:-1]]).astype(np.int64)


def _contexts(tokens: np.ndarray, k: int) -> np.ndarray:
    """Base-4 code of the ``k`` bases before each position (garbage where fewer are clean)."""
    x = np.minimum(tokens, 3).astype(np.int64)
    code = np.zeros(len(tokens), dtype=np.int64)
    for j in range(1, k + 1):
        shifted = np.zeros(len(tokens), dtype=np.int64)
        shifted[j:] = x[:-j]
        code = code * 4 + shifted
    return code


class MarkovModel:
    """Counts for orders ``0..order`` over training sequences; ``log_probs`` scores a window."""

    def __init__(self, order: int, alpha: float = ALPHA):
        if not 0 <= order <= MAX_ORDER:
            raise ValueError(f"Markov order must be within 0..{MAX_ORDER}, got {order}")
        self.order, self.alpha = order, alpha
        self.counts = [np.zeros(4 ** (k + 1), dtype=np.int64) for k in range(order + 1)]
        self._totals: list[np.ndarray] | None = None

    def fit(self, tokens: np.ndarray) -> "MarkovModel":
        """Add the transitions of one sequence (``uint8`` tokens); callable repeatedly."""
        tokens = np.asarray(tokens)
        clean = _clean_run(tokens)
        target = tokens < N_BASES
        for k in range(self.order + 1):
            ok = target & (clean >= k)
            code = _contexts(tokens, k)[ok] * 4 + tokens[ok]
            if len(code) * 8 < len(self.counts[k]):  # a short sequence: no table-sized temporary
                seen, times = np.unique(code, return_counts=True)
                self.counts[k][seen] += times
            else:
                self.counts[k] += np.bincount(code, minlength=4 ** (k + 1))
        self._totals = None
        return self

    def log_probs(self, tokens: np.ndarray) -> np.ndarray:
        """``log p(x_t | x_<t)`` (nats) for every position of a window scored from its start;
        NaN where the target is not a base."""
        tokens = np.asarray(tokens)
        if self._totals is None:
            self._totals = [c.reshape(-1, 4).sum(-1) for c in self.counts]
        use = np.minimum(_clean_run(tokens), self.order)  # the window holds all context there is
        out = np.full(len(tokens), np.nan)
        target = tokens < N_BASES
        for k in range(self.order + 1):
            sel = target & (use == k)
            if not sel.any():
                continue
            ctx = _contexts(tokens, k)[sel]
            hits = self.counts[k][ctx * 4 + tokens[sel]]
            out[sel] = np.log((hits + self.alpha) / (self._totals[k][ctx] + 4 * self.alpha))
        return out
