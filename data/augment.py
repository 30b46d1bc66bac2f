"""Synthetic repeats: a training curriculum that plants copies of a window's own sequence in it.

Real genomes hold repeats (transposons, segmental duplications, tandem arrays), but in a few
megabases of a compact fungal genome they are too rare for a model to learn from them that it can
copy. This augmentation overwrites stretches of a training window with copies of earlier stretches
of the same window, so that predicting the second copy from the first pays from the first steps.
Evaluation never sees it: held-out scores, controls and the recall probe use real sequence.

A copy of ``m`` bases (``m`` log-uniform in ``length``) lands ``d`` bases after its source (``d``
log-uniform from ``m`` to what the window allows, so long distances are as common as short ones
per octave), each base substituted with probability ``u * divergence`` (``u`` uniform per copy):
repeats in genomes are rarely exact. Copies are planted until ``frac`` of the window's bases are
covered (later copies may overwrite earlier ones). Everything is drawn from ``rng``, so a seeded
generator makes it reproducible (training draws it from the seed and the step).
"""

from __future__ import annotations

import math

import numpy as np

from megabase.core.vocab import N_BASES, PAD


def plant_repeats(window: np.ndarray, rng: np.random.Generator, frac: float,
                  length: tuple[int, int] = (20, 1000), divergence: float = 0.0) -> np.ndarray:
    """A copy of ``window`` (``uint8 [n]`` tokens, ``<pad>`` at the end allowed) with repeats planted.

    Args:
        frac: fraction of the window's bases to cover with copies (0 returns an unchanged copy).
        length: ``(min, max)`` copy length in bases.
        divergence: the most a copy's substitution rate can be (drawn uniform in ``[0, divergence]``).
    """
    out = np.array(window, copy=True)
    n = int(np.count_nonzero(out != PAD))
    lo, hi = length
    if frac <= 0 or n < 2 * lo:
        return out
    budget = int(frac * n)
    planted = 0
    while planted < budget:
        m = int(math.exp(rng.uniform(math.log(lo), math.log(min(hi, n // 2)))))
        d_max = n - m
        if d_max < m:
            break
        d = int(math.exp(rng.uniform(math.log(m), math.log(d_max))))
        dest = int(rng.integers(d, n - m + 1))
        piece = out[dest - d : dest - d + m].copy()
        rate = rng.uniform(0.0, divergence) if divergence > 0 else 0.0
        if rate > 0:
            hit = (rng.random(m) < rate) & (piece < N_BASES)
            piece[hit] = (piece[hit] + rng.integers(1, N_BASES, int(hit.sum()))) % N_BASES
        out[dest : dest + m] = piece
        planted += m
    return out
