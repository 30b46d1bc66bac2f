"""Seed candidates of the indexer's candidate stage: keys that continue an earlier copy of the
query's last bases, found through a table of earlier k-mers (as exact-repeat models of DNA
compressors and minimap2's seeds find them).

A DSA query at position ``t`` hashes the ``seed`` tokens ending at ``t``; the key at ``s``
hashes the ones ending at ``s - 1``. Where the ``k``-mer ending at ``u`` occurred before, ending
at ``e``, key ``e + 1`` holds the base that followed the earlier copy: the one a copying head
wants. The reverse complement reads backwards: if the ``k``-mer ending at ``e`` is the reverse
complement of ``u``'s, the base after ``u`` pairs with the one before ``e - k + 1``, key ``e - k``.
A query follows the hits of the last ``carry + 1`` positions along their diagonals (key ``e + 1 +
d`` for the hit of ``u = t - d``, ``e - k - d`` on the other strand), so a copy with a mismatch
stays found while the ``k``-mers that hold the mismatch have no hit (the substitution-tolerant
repeat models of GeCo3 / JARVIS). Each ``k``-mer follows at most ``seed_cap`` earlier
occurrences per strand (the most recent): a low-complexity ``k``-mer seen thousands of times
costs no more than a rare one. Keys inside the query's local window are left out (the stage keeps
them anyway), repeats too, and at most ``Stage.max_seeds`` are kept, in the order found: ``d``
ascending, forward before reverse, newest occurrence first.

``seed_keys(tokens [B, Tk], offset, stage) -> [B, Tk - offset, S]`` int32, -1 padded, ``S`` the
largest count of any query (possibly 0), for the queries at ``offset .. Tk``: a function of the
tokens up to each query only, so a streamed sequence gets the full pass's seeds. The C kernel
(``seeds.c``) builds the table in one pass, O(Tk); :func:`reference_seed_keys` is the plain-Python
definition it is tested against.
"""

from __future__ import annotations

import bisect
import ctypes
from pathlib import Path

import numpy as np
import torch

from megabase.kernels import native

from .candidates import Stage

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _lib():
    return native.bind(str(Path(__file__).with_name("seeds.c")), {
        "megabase_dsa_seeds": [_P] + [_I] * 9 + [_P, _P, ctypes.c_int]})


def seed_keys(tokens: torch.Tensor, offset: int, stage: Stage) -> torch.Tensor:
    """Seed candidates of the queries at ``offset .. Tk`` (see module docs), in the C kernel, or
    the reference where it cannot be built."""
    lib = _lib()
    if lib is None:
        return reference_seed_keys(tokens, offset, stage)
    B, Tk = tokens.shape
    Tq, smax = Tk - offset, stage.max_seeds
    if not stage.seed or Tq <= 0:
        return torch.full((B, max(Tq, 0), 0), -1, dtype=torch.int32)
    tok = tokens.detach().to("cpu", torch.int64).contiguous()
    out = torch.empty(B, Tq, smax, dtype=torch.int32)
    most = ctypes.c_int64()
    status = lib.megabase_dsa_seeds(tok.data_ptr(), B, Tk, offset, stage.seed, stage.seed_cap,
                                    stage.carry, stage.block, stage.local, smax, out.data_ptr(),
                                    ctypes.byref(most), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"the seed table of {Tk:,} positions could not be allocated")
    return out[..., : most.value].contiguous().to(tokens.device)


def reference_seed_keys(tokens: torch.Tensor, offset: int, stage: Stage) -> torch.Tensor:
    """:func:`seed_keys` in plain Python (a dictionary of k-mer occurrences): the definition."""
    B, Tk = tokens.shape
    k, rows = stage.seed, []
    for b in range(B):
        seq = tokens[b].tolist()
        codes = [_code(seq[p - k + 1 : p + 1]) if k and p >= k - 1 else None for p in range(Tk)]
        seen: dict[tuple, list[int]] = {}
        for p, c in enumerate(codes):
            if c is not None:
                seen.setdefault(c, []).append(p)
        per_query = []
        for t in range(offset, Tk):
            local0 = int(stage.local_start(torch.tensor(t)))
            keys: list[int] = []
            for d in range(stage.carry + 1 if k else 0):
                u = t - d
                if u < 0 or len(keys) == stage.max_seeds:
                    break
                if codes[u] is None:
                    continue
                rc = tuple(3 - x for x in reversed(codes[u]))
                for code, key in ((codes[u], lambda e: e + 1 + d), (rc, lambda e: e - k - d)):
                    hits = seen.get(code, [])
                    for e in hits[: bisect.bisect_left(hits, u)][::-1][: stage.seed_cap]:
                        s = key(e)
                        if 0 <= s < local0 and s not in keys and len(keys) < stage.max_seeds:
                            keys.append(s)
            per_query.append(keys)
        rows.append(per_query)
    S = max((len(keys) for per_query in rows for keys in per_query), default=0)
    out = np.full((B, max(Tk - offset, 0), S), -1, dtype=np.int32)
    for b, per_query in enumerate(rows):
        for i, keys in enumerate(per_query):
            out[b, i, : len(keys)] = keys
    return torch.from_numpy(out).to(tokens.device)


def _code(bases: list[int]) -> tuple | None:
    return tuple(bases) if all(0 <= x <= 3 for x in bases) else None
