"""Ablations: which mechanism carries what far context gives the model, or what it costs.

The truncation control (:func:`megabase.eval.score.truncated`) takes all far context away at
once. An ablation takes it from one kind of layer only, the rest reading the whole window:

* ``kda_reset``: every KDA layer's memory (its delta-rule state and conv tail) is emptied every
  ``limit`` bases, so it holds at most ``limit`` bases; the DSA layers keep every key.
* ``dsa_near``: every DSA layer drops its keys older than the piece before the current one,
  ``limit`` bases each, so it sees ``limit`` to ``2 limit`` bases back, as under the control; the
  KDA layers keep their whole memory. The candidate stage's seed table is cut with the keys (it
  indexes the same positions); DSA has no positional encoding, so the kept keys are scored as
  they were. (A dense attention layer's keys carry RoPE positions: it is not cut.)

A window is scored piece by piece (``limit`` bases, a multiple of the row tile, so every piece is
committed as a full pass would tile it) and the state is cut after each piece. Paired with the
model's own curve, per bin and repeat / unique apart: an ablation that *gains* where the full
context loses to the control names the layers that make far context cost.
"""

from __future__ import annotations


from megabase.model.layers import ROW_TILE

ABLATIONS = {
    "kda_reset": "KDA memory reset every {limit:,} bases",
    "dsa_near": "DSA keys beyond {limit:,}-{twice:,} bases dropped",
}


def check_ablation(name: str, limit: int | None = None) -> None:
    """A known ``name`` and (unless None) a ``limit`` that is a positive multiple of the row
    tile, else a ValueError."""
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; one of {', '.join(ABLATIONS)}")
    if limit is None:
        return
    if not isinstance(limit, int) or limit < ROW_TILE or limit % ROW_TILE:
        raise ValueError(f"an ablation's limit must be a multiple of {ROW_TILE}, got {limit}")


def label(name: str, limit: int) -> str:
    return ABLATIONS[name].format(limit=limit, twice=2 * limit)


def _trim(layer: dict, names: tuple[str, ...], keep: int) -> None:
    """The last ``keep`` positions of each cache ``names`` of ``layer``, in a buffer of their own
    (:func:`megabase.model.cache.extend` then grows that one)."""
    for name in names:
        if name in layer:
            layer[name] = layer[name][:, -keep:].clone()
            layer.pop(name + "#buffer", None)


def cut(model, state: list[dict], name: str, limit: int) -> None:
    """Apply ablation ``name`` to a streaming ``state`` after a piece of ``limit`` bases."""
    for block, layer in zip(model.blocks, state):
        if name == "kda_reset" and block.kind == "kda":
            layer.clear()
        elif name == "dsa_near" and block.kind == "dsa":
            _trim(layer, ("k", "v", "ki"), limit)
    if name == "dsa_near":
        _trim(state[-1], ("tokens",), limit)


def ablated(scorer, name: str, limit: int):
    """A scorer (:mod:`megabase.eval.score`'s contract) that scores with the model of ``scorer``
    (a :class:`~megabase.eval.score.ModelScorer`) under ablation ``name`` at ``limit``: the
    window streamed in pieces of ``limit``, the state cut after each."""
    check_ablation(name, limit)
    model = scorer.model
    return lambda tokens: scorer(tokens, segment=limit,
                                 between=lambda state: cut(model, state, name, limit))
