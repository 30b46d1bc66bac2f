"""The nucleotide vocabulary: the single definition every stage and every manifest uses.

One token per base. Case is not a token: lower case (soft-masked repeats) maps to the same base and
is recorded in a parallel repeat mask instead. Every IUPAC ambiguity code (``R Y K M S W B D H V N``,
and ``U``, which never occurs in a DNA reference) and the gap characters ``-`` and ``.`` become ``N``.

=====  =========  ===========================================
 id    symbol     meaning
=====  =========  ===========================================
 0     ``A``
 1     ``C``
 2     ``G``
 3     ``T``
 4     ``N``      unknown base, ambiguity code or gap
 5     ``<pad>``  padding; never a loss target
 6     ``<sep>``  document separator / start of a window
=====  =========  ===========================================

Complementing is ``3 - id`` for the four bases, so reverse complement is exact and self-inverse.
"""

from __future__ import annotations

import numpy as np

A, C, G, T, N, PAD, SEP = range(7)
SYMBOLS: tuple[str, ...] = ("A", "C", "G", "T", "N", "<pad>", "<sep>")
VOCAB_SIZE = len(SYMBOLS)
N_BASES = 4

INVALID = 255
IUPAC_AMBIGUOUS = "NRYKMSWBDHVU"
GAPS = "-."


def _token_table() -> bytes:
    table = bytearray([INVALID]) * 256
    for token, base in enumerate("ACGT"):
        table[ord(base)] = table[ord(base.lower())] = token
    for code in IUPAC_AMBIGUOUS:
        table[ord(code)] = table[ord(code.lower())] = N
    for gap in GAPS:
        table[ord(gap)] = N
    return bytes(table)


TOKEN_TABLE: bytes = _token_table()
"""``bytes.translate`` table: ASCII FASTA byte -> token id, ``INVALID`` for anything else."""

RC_LUT = np.array([T, G, C, A, N, PAD, SEP], dtype=np.uint8)
"""Complement of each token id (specials map to themselves)."""

_DECODE = np.frombuffer(b"ACGTN", dtype=np.uint8)


def vocab_dict() -> dict:
    """The vocabulary as recorded in every manifest and checkpoint."""
    return {
        "symbols": list(SYMBOLS),
        "pad": PAD,
        "sep": SEP,
        "n": N,
        "case": "folded; lower case recorded in the repeat mask",
        "ambiguous": f"IUPAC {IUPAC_AMBIGUOUS} and gaps {GAPS!r} -> N",
    }


def tokenize(seq: str | bytes | bytearray | memoryview) -> np.ndarray:
    """Map a nucleotide string to token ids.

    Args:
        seq: bases as ``str`` (ASCII) or bytes-like; any case; IUPAC codes and gaps allowed.

    Returns:
        ``uint8`` array ``[len(seq)]`` of ids in ``0..4``.

    Raises:
        ValueError: on a character that is neither a base, an IUPAC code nor a gap (whitespace
            included), naming the character and its 0-based position.
    """
    raw = seq.encode("latin-1", errors="replace") if isinstance(seq, str) else bytes(seq)
    tokens = raw.translate(TOKEN_TABLE)
    bad = tokens.find(INVALID)
    if bad >= 0:
        raise ValueError(f"invalid nucleotide {chr(raw[bad])!r} at position {bad}")
    return np.frombuffer(tokens, dtype=np.uint8).copy()


def repeat_mask(seq: str | bytes) -> np.ndarray:
    """``bool`` array ``[len(seq)]``: True where the base is lower case (soft-masked)."""
    raw = seq.encode("latin-1", errors="replace") if isinstance(seq, str) else bytes(seq)
    return np.frombuffer(raw, dtype=np.uint8) >= ord("a")


def detokenize(tokens, skip_special: bool = False) -> str:
    """Inverse of :func:`tokenize` (upper case): ids ``0..4`` -> ``ACGTN``.

    Args:
        tokens: integer array or tensor ``[T]``.
        skip_special: drop ``<pad>``/``<sep>`` instead of raising.
    """
    ids = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens).astype(np.int64).ravel()
    special = ids >= N_BASES + 1
    if special.any():
        if not skip_special:
            raise ValueError(f"token {int(ids[special][0])} is not a base; pass skip_special=True")
        ids = ids[~special]
    if ids.size and (ids.min() < 0):
        raise ValueError(f"token {int(ids.min())} is not in the vocabulary")
    return _DECODE[ids].tobytes().decode("ascii")


def reverse_complement(tokens):
    """Reverse complement of token ids; exact and self-inverse. numpy or torch ``[..., T]``."""
    if hasattr(tokens, "flip"):
        import torch

        lut = torch.as_tensor(RC_LUT, device=tokens.device).to(tokens.dtype)
        return lut[tokens.long()].flip(-1)
    return RC_LUT[np.asarray(tokens)][..., ::-1]


def is_gc(tokens) -> np.ndarray:
    """Where ``tokens`` (any array of ids) are C or G: a bool array of their shape."""
    return np.isin(np.asarray(tokens), (C, G))


def gc_fraction(tokens) -> float:
    """Share of ``tokens`` (any array of ids) that are C or G; NaN for none."""
    gc = is_gc(tokens)
    return float(gc.mean()) if gc.size else float("nan")
