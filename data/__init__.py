"""megabase.data: FASTA reading, the tokenizer, the token store, windows and PyTorch datasets.

torch is imported only by the dataset helpers, so ``prepare`` and ``windows`` start fast.
"""

from megabase.core.errors import InputError
from .names import Region, aliases, parse_region, resolve_name
from .store import PrepareResult, TokenStore, prepare
from megabase.core.vocab import (
    N,
    PAD,
    SEP,
    SYMBOLS,
    VOCAB_SIZE,
    detokenize,
    repeat_mask,
    reverse_complement,
    tokenize,
    vocab_dict,
)
from .windows import Window, make_windows, read_bed, windows_comment, write_bed

_LAZY = {
    "WindowDataset": ".dataset",
    "ResumableSampler": ".dataset",
    "to_hf_dataset": ".hf",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_genome():
    """Path of the bundled genome: *U. maydis* ``chr01``, ``chr02``, ``chr22`` (bgzip FASTA)."""
    from importlib.resources import files

    return files(__name__) / "genomes" / "umaydis_chr01_chr02_chr22.fa.gz"


__all__ = [
    "InputError", "Region", "aliases", "parse_region", "resolve_name", "PrepareResult",
    "TokenStore", "prepare", "N", "PAD", "SEP", "SYMBOLS", "VOCAB_SIZE", "detokenize",
    "repeat_mask", "reverse_complement", "tokenize", "vocab_dict", "Window", "make_windows",
    "read_bed", "windows_comment", "write_bed", "WindowDataset", "ResumableSampler", "to_hf_dataset", "default_genome",
]
