"""megabase.eval: held-out scoring binned by prior context, Markov baselines, reports (DESIGN.md, Evaluation)."""

from .bins import BinAccumulator, default_edges
from .markov import MarkovModel
from .probe import recall_probe
from .score import ModelScorer, markov_scorer, truncated

__all__ = ["BinAccumulator", "default_edges", "MarkovModel", "ModelScorer", "markov_scorer",
           "recall_probe", "truncated"]
