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

from megabase.core.vocab import N_BASES, SEP
from megabase.model import log_probs
from megabase.model.moe import N_MARGIN_BINS, MoE


Scorer = Callable[[np.ndarray], np.ndarray]


@contextmanager
def forward_hooks(modules, hook: Callable[[int], Callable]) -> Iterator[None]:
    """While the block runs, ``hook(i)`` is a forward hook of ``modules[i]``."""
    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class ModelScorer:
    """A :class:`~megabase.model.HybridLM` as a scorer; windows longer than ``segment`` are
    streamed (KDA states and DSA caches carried), which equals the full pass exactly."""

    def __init__(self, model, segment: int | None = None):
        self.model, self.segment = model.eval(), segment

    @contextmanager
    def counting_load(self, margins: bool = False):
        """Yields a ``[n_moe_layers, E]`` tensor that counts the tokens each expert is routed while
        the block runs (a streamed window's replayed tile boundaries, < 1,024 tokens per piece, are
        counted twice); with ``margins``, ``[n_moe_layers, E, 1 + N_MARGIN_BINS]``: the counts,
        then each expert's histogram of routing margins (``MoE.margins``)."""
        layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        E = self.model.cfg.n_experts
        load = torch.zeros(len(layers), E, 1 + N_MARGIN_BINS) if margins else torch.zeros(len(layers), E)

        def hook(i):
            def add(module, args, out):
                load[i] += (out[2] if margins else out[2][:, 0]).cpu()  # (y, aux, stats, experts)
            return add

        with forward_hooks(layers, hook):
            yield load

    @torch.no_grad()
    def __call__(self, tokens: np.ndarray, ctx=None, segment: int | None = None,
                 between=None) -> np.ndarray:
        """``ctx``: how the model's calls run (:meth:`HybridLM.context`; e.g. capturing the DSA
        layers' selections); ``segment``, ``between``: stream in pieces of ``segment`` (default
        the scorer's, for windows longer than it) and cut the state between them
        (:func:`megabase.model.stream.stream`)."""
        seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
        seg = segment or (self.segment if self.segment and len(tokens) > self.segment else None)
        nll = -log_probs(self.model, seq, segment=seg, ctx=ctx, between=between)[0].double().numpy()
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
    Pieces are scored one at a time, a :class:`ModelScorer` streaming each in its ``segment``:
    on 2 cores, 8 pieces of 32,768 bases as one batch cost 1.7x as much per token as one piece at
    a time in two segments of 16,384 (docs/benchmarks.md, bench_eval).
    """
    if limit < 1:
        raise ValueError(f"context limit must be positive, got {limit}")

    def score(tokens: np.ndarray) -> np.ndarray:
        n = len(tokens)
        out = np.full(n, np.nan)
        out[: min(limit, n)] = scorer(tokens[: min(limit, n)])
        for k in range(1, -(-n // limit)):
            s = (k - 1) * limit
            out[s + limit : s + 2 * limit] = scorer(tokens[s : s + 2 * limit])[limit:]
        return out

    return score
