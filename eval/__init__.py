"""megabase.eval: held-out scoring binned by prior context, Markov baselines, reports (DESIGN.md, Evaluation).

Names are imported on first use, so that reading :class:`megabase.eval.config.EvalConfig` (which
every ``megabase`` command's parser does) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"BinAccumulator": ".bins", "default_edges": ".bins", "MarkovModel": ".markov",
            "recall_probe": ".probe", "ModelScorer": ".score", "markov_scorer": ".score",
            "truncated": ".score"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
