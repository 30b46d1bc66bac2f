"""Attention key/value caches of a streaming state that grow in place.

A cache entry of a layer's state (``state["k"]``, ``[B, n, ...]``) is a view of the first ``n``
positions of a larger buffer, so appending ``T`` positions writes ``T`` rows instead of copying
all ``n`` (``torch.cat``): one decoding step after a 65,536-base prompt then costs the step, not a
copy of every cached key. States are forked by copying their dicts
(:func:`megabase.model.stream.fork`), so two states may hold views of one buffer; the buffer
records how many positions were written, and a state whose view ends before that (another fork
appended since) copies its view into a new buffer instead of writing over the other's rows.
"""

from __future__ import annotations

import torch

GROWTH = 8  # spare room: 1/GROWTH of the length (decoding appends amortize to O(1) per step)
MIN_ROOM = 1024


class _Buffer:
    __slots__ = ("data", "used")

    def __init__(self, data: torch.Tensor, used: int):
        self.data, self.used = data, used


def extend(state: dict, name: str, new: torch.Tensor) -> torch.Tensor:
    """Append ``new [B, T, ...]`` to ``state[name]`` along dim 1 (creating it) and return the whole
    cache ``[B, n + T, ...]``, as ``torch.cat([state[name], new], 1)`` would, without copying the
    ``n`` cached positions when this state owns the end of its buffer."""
    old = state.get(name)
    if torch.is_grad_enabled() and new.requires_grad:  # autograd needs the copy
        state[name] = new if old is None else torch.cat([old, new], dim=1)
        return state[name]
    n, T = (0 if old is None else old.shape[1]), new.shape[1]
    buf: _Buffer | None = state.get(name + "#buffer")
    fits = (buf is not None and old is not None and buf.used == n and n + T <= buf.data.shape[1]
            and buf.data.dtype == new.dtype and buf.data.shape[0] == new.shape[0]
            and old.data_ptr() == buf.data.data_ptr())
    if not fits:
        room = n + T + max((n + T) // GROWTH, MIN_ROOM)
        data = new.new_empty(new.shape[0], room, *new.shape[2:])
        if n:
            data[:, :n] = old
        buf = _Buffer(data, n)
        state[name + "#buffer"] = buf
    buf.data[:, n : n + T] = new
    buf.used = n + T
    state[name] = buf.data[:, : n + T]
    return state[name]
