"""Export windows to a Hugging Face ``datasets.Dataset`` (needs the ``datasets`` package: extra ``hf``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megabase.core.errors import InputError
from .store import TokenStore
from .windows import Window, select_windows


def to_hf_dataset(
    store: TokenStore | str | Path,
    windows: Sequence[Window] | str | Path,
    split: str | None = None,
    cache_dir: str | Path | None = None,
):
    """One row per window: ``chrom, start, end, split, tokens (uint8 ids), repeat_mask (bool)``.

    Rows are generated from the memory-mapped store, so the export streams and never holds all
    windows in memory. ``cache_dir`` is where ``datasets`` writes its Arrow files.
    """
    try:
        import datasets
    except ImportError:
        raise InputError("exporting needs the `datasets` package: pip install 'megabase[hf]'") from None
    store = store if isinstance(store, TokenStore) else TokenStore(store)
    rows = [(w.chrom, w.start, w.end, w.split) for w in select_windows(windows, split)]
    if not rows:
        raise InputError("no windows to export")

    def generate(rows, path):
        source = TokenStore(path)
        for chrom, start, end, name in rows:
            tokens, mask = source.fetch(chrom, start, end)
            yield {"chrom": chrom, "start": start, "end": end, "split": name,
                   "tokens": tokens, "repeat_mask": mask}

    features = datasets.Features({
        "chrom": datasets.Value("string"),
        "start": datasets.Value("int64"),
        "end": datasets.Value("int64"),
        "split": datasets.Value("string"),
        "tokens": datasets.Sequence(datasets.Value("uint8")),
        "repeat_mask": datasets.Sequence(datasets.Value("bool")),
    })
    return datasets.Dataset.from_generator(
        generate,
        gen_kwargs={"rows": rows, "path": str(store.path)},
        features=features,
        cache_dir=None if cache_dir is None else str(cache_dir),
    )
