"""What the DSA output gates (``dsa_gate``) do on real DNA: each head's gate, ``2 sigmoid(w_h . x)``
(1: open, as at the start; 0: closed), on unique and repeat bases per bin of prior context.

A trained gate that stays near 1 everywhere did nothing; one that closes on unique sequence far
into a window is what the gate was added for (docs/science.md §14).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from megabase.core.vocab import N_BASES, SEP
from megabase.model import log_probs
from megabase.model.dsa import DSALayer

from .score import forward_hooks


@contextmanager
def recording_gates(model, length: int):
    """Yields one ``[length, dsa_heads]`` float32 array per gated DSA layer (layer order), NaN
    until filled: the gate of each query position ``0..length`` of the first sequence, as the
    layers run, whole or streamed (a piece's position is read from the layer's cache)."""
    layers = [b.mixer for b in model.blocks
              if isinstance(b.mixer, DSALayer) and b.mixer.gate_proj is not None]
    if not layers:
        raise ValueError("the model has no DSA gates (dsa_gate is off)")
    out = [np.full((length, layer.HQ), np.nan, dtype=np.float32) for layer in layers]

    def hook(i):
        def record(module, args, _output):
            x, ctx = args[0], args[1]
            T = x.shape[1]
            state = ctx.state
            offset = state["k"].shape[1] - T if state is not None else ctx.sequence.offset(T)
            gate = 2 * torch.sigmoid(module.gate_proj(x[:1], ctx.untiled))[0].float().numpy()
            hi = min(offset + T, length)
            if hi > offset:
                out[i][offset:hi] = gate[: hi - offset]
        return record

    with forward_hooks(layers, hook):
        yield out


@torch.no_grad()
def gate_profile(model, tokens: np.ndarray, repeat: np.ndarray, edges: list[int],
                 segment: int | None = None) -> list[dict]:
    """Score one window ``tokens [n]`` (its repeat mask ``repeat [n]``; streamed in pieces of
    ``segment``) and summarize its gates: per gated DSA layer, per head, the mean gate on unique
    and on repeat bases in each bin ``edges[i] .. edges[i+1]`` of prior context (bases with
    context ``c`` are those at offset ``c`` of the window), with the bases counted."""
    seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
    with recording_gates(model, len(tokens)) as gates:
        log_probs(model.eval(), seq, segment=segment)
    base = tokens < N_BASES
    rows = []
    for layer, g in enumerate(gates):
        bins = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            part = slice(lo, min(hi, len(tokens)))
            entry = {"context_lo": lo, "context_hi": hi}
            for kind, keep in (("unique", ~repeat[part]), ("repeat", repeat[part])):
                keep = keep & base[part]
                vals = g[part][keep]
                entry[kind] = {"n_bases": int(keep.sum()),
                               "mean_gate": [float(v) for v in vals.mean(0)] if len(vals) else None}
            bins.append(entry)
        rows.append({"layer": layer, "bins": bins})
    return rows
