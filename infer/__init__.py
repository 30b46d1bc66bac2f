"""megabase.infer: use a trained model — score tracks, embeddings, generation, variant effects.

Every function streams through the carried state (KDA states, conv tails, DSA caches), so memory
is bounded by the streamed piece, not by the sequence. Names are imported on first use (torch is
not loaded by ``import megabase.infer``).
"""

from __future__ import annotations

import importlib

_NAMES = {"score": "surprisal", "score_tokens": "surprisal", "Track": "surprisal",
          "ScoreResult": "surprisal", "generate": "sampling", "generate_tokens": "sampling",
          "Sample": "sampling", "embed": "embedding", "embed_tokens": "embedding",
          "EmbedResult": "embedding", "score_variants": "variants", "score_tile": "variants",
          "read_vcf": "variants"}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_NAMES)
