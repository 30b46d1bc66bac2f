"""Scoring held-out windows: per-base NLL from a model or a baseline, the truncation control (the
recall probe is in :mod:`megabase.eval.probe`).

A *scorer* maps a window's tokens (``uint8 [n]``) to per-base NLL in nats (``float64 [n]``, NaN
where the target is not A/C/G/T); the target at offset ``i`` is predicted from the ``i`` bases
before it in the same window (and a ``<sep>`` start token for the model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from megabase.data.vocab import N_BASES, SEP

Scorer = Callable[[np.ndarray], np.ndarray]


class ModelScorer:
    """A :class:`~megabase.model.HybridLM` as a scorer; windows longer than ``segment`` are
    streamed (KDA states and DSA caches carried), which equals the full pass exactly."""

    def __init__(self, model, segment: int | None = None):
        self.model, self.segment = model.eval(), segment

    @contextmanager
    def counting_load(self):
        """Yields a ``[n_moe_layers, E]`` tensor that counts the tokens each expert is routed while
        the block runs (a streamed window's replayed tile boundaries, < 1,024 tokens per piece, are
        counted twice)."""
        from megabase.model.moe import MoE

        layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        load = torch.zeros(len(layers), self.model.cfg.n_experts)

        def hook(i):
            def add(module, args, out):
                load[i] += out[2][:, 0].cpu()
            return add

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
        try:
            yield load
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        from megabase.model import log_probs

        seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
        seg = self.segment if self.segment and len(tokens) > self.segment else None
        nll = -log_probs(self.model, seq, segment=seg)[0].double().numpy()
        nll[tokens >= N_BASES] = np.nan
        return nll


def markov_scorer(model) -> Scorer:
    """An order-k :class:`~megabase.eval.markov.MarkovModel` as a scorer."""
    return lambda tokens: -model.log_probs(tokens)


def truncated(scorer: Scorer, limit: int) -> Scorer:
    """The control: every target scored with at most ~``limit`` bases of context.

    Targets at offsets ``< limit`` keep their full context (it is already short); a target at
    offset ``i >= limit`` is scored inside the piece ``[(k-1) limit, (k+1) limit)`` with
    ``k = i // limit``, so its context is between ``limit`` and ``2 limit`` bases. Comparing the
    model's curve with this one separates "more context helps" from "later positions are easier".
    """
    if limit < 1:
        raise ValueError(f"context limit must be positive, got {limit}")

    def score(tokens: np.ndarray) -> np.ndarray:
        n = len(tokens)
        out = np.full(n, np.nan)
        out[: min(limit, n)] = scorer(tokens[: min(limit, n)])
        for k in range(1, -(-n // limit)):
            start = (k - 1) * limit
            piece = scorer(tokens[start : (k + 1) * limit])
            out[k * limit : (k + 1) * limit] = piece[limit : 2 * limit]
        return out

    return score
