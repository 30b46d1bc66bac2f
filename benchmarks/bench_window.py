"""Reading one random 1,048,576-base window as a tensor: token store vs pyfaidx + tokenizing.

    python benchmarks/bench_window.py [FASTA] [--windows 30]

pyfaidx reads an uncompressed, indexed copy of the FASTA (its fastest case; from the bgzip file it
is slower still). Both sides read the same random intervals with a warm page cache. Prints the
ratio ``pyfaidx / store`` (target >= 50) for the store's zero-copy tensor view, and, for
reference, for a materialised copy and for a full dataset item (input, targets, loss mask, repeat
mask).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GENOMES, machine, timeit  # noqa: E402

from megabase.data import TokenStore, Window, WindowDataset, prepare  # noqa: E402
from megabase.core.vocab import TOKEN_TABLE  # noqa: E402

L = 1_048_576


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fasta", nargs="?", default=str(GENOMES / "hsap_chr22_subset.fa.gz"))
    parser.add_argument("--windows", type=int, default=30)
    args = parser.parse_args()
    from pyfaidx import Fasta

    work = Path(tempfile.mkdtemp(prefix="bench-window-"))
    try:
        prepare(args.fasta, work / "store", progress=False)
        store = TokenStore(work / "store")
        plain = work / "genome.fa"
        with gzip.open(args.fasta, "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst)
        faidx = Fasta(str(plain), as_raw=True, sequence_always_upper=False)
        lut = torch.from_numpy(np.frombuffer(TOKEN_TABLE, dtype=np.uint8).copy())

        rng = np.random.default_rng(0)
        names = [n for n in store.names if store.length(n) > L]
        picks = []
        for _ in range(args.windows):
            name = names[rng.integers(len(names))]
            start = int(rng.integers(0, store.length(name) - L))
            picks.append(Window(name, start, start + L))
        dataset = WindowDataset(store, picks)
        it = iter(range(10**9))

        def store_view():
            w = picks[next(it) % len(picks)]
            return store.tensors(w.chrom, w.start, w.end)[0]

        def store_copy():
            w = picks[next(it) % len(picks)]
            return store.tensors(w.chrom, w.start, w.end)[0].clone()

        def dataset_item():
            return dataset[next(it) % len(picks)]

        def pyfaidx_read():
            w = picks[next(it) % len(picks)]
            seq = faidx[w.chrom][w.start : w.end]
            raw = torch.frombuffer(bytearray(seq.encode("ascii")), dtype=torch.uint8)
            return lut[raw.long()]

        fns = (store_view, store_copy, dataset_item, pyfaidx_read)
        for fn in fns:  # warm the page cache for every reader
            for _ in picks:
                fn()
        n = len(picks) * 3
        t_view, t_copy, t_item, t_faidx = (timeit(fn, n) for fn in fns)
        check = picks[0]
        tokens, _ = store.fetch(check.chrom, check.start, check.end)
        seq = faidx[check.chrom][check.start : check.end].encode()
        assert np.array_equal(tokens, np.frombuffer(seq.translate(TOKEN_TABLE), np.uint8))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{len(picks)} random {L:,}-base windows of {Path(args.fasta).name}, machine: {machine()}")
    print(f"  store.tensors (zero-copy view)   {t_view * 1e3:8.3f} ms")
    print(f"  store.tensors + clone (copied)   {t_copy * 1e3:8.3f} ms")
    print(f"  WindowDataset item (4 tensors)   {t_item * 1e3:8.3f} ms")
    print(f"  pyfaidx fetch + tokenize         {t_faidx * 1e3:8.3f} ms")
    print(f"ratio pyfaidx / store view         {t_faidx / t_view:8.1f}x  (target >= 50)")
    print(f"ratio pyfaidx / store copy         {t_faidx / t_copy:8.1f}x")
    print(f"ratio pyfaidx / dataset item       {t_faidx / t_item:8.1f}x")


if __name__ == "__main__":
    main()
