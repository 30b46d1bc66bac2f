"""prepare throughput vs the decompression floor and vs a plain Biopython + numpy tokenizer.

    python benchmarks/bench_prepare.py [FASTA] [--repeat 5]

Prints, measured in this run: ``prepare / (gzip -dc > /dev/null)`` (target <= 1.5) and
``Biopython baseline / prepare`` (target >= 3).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GENOMES, machine, timeit  # noqa: E402

from megabase.data import prepare  # noqa: E402
from megabase.data.vocab import TOKEN_TABLE  # noqa: E402


def biopython_baseline(fasta: Path, out: Path) -> None:
    """What a careful user writes by hand: SeqIO records, a numpy lookup table, np.save."""
    from Bio import SeqIO

    lut = np.frombuffer(TOKEN_TABLE, dtype=np.uint8)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(fasta, "rt") as fh:
        for rec in SeqIO.parse(fh, "fasta"):
            raw = np.frombuffer(str(rec.seq).encode("ascii"), dtype=np.uint8)
            np.save(out / f"{rec.id}.tokens.npy", lut[raw])
            np.save(out / f"{rec.id}.mask.npy", raw >= ord("a"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fasta", nargs="?", default=str(GENOMES / "hsap_chr22_subset.fa.gz"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    fasta = Path(args.fasta)
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        def floor():
            subprocess.run(["gzip", "-dc", str(fasta)], stdout=subprocess.DEVNULL, check=True)

        def fresh():
            shutil.rmtree(work / "store", ignore_errors=True)
            shutil.rmtree(work / "bio", ignore_errors=True)

        exe = shutil.which("megabase", path=str(Path(sys.executable).parent))
        runs = {
            "floor": floor,
            "prepare": lambda: prepare(fasta, work / "store", progress=False),
            "cli": lambda: subprocess.run([exe, "prepare", str(fasta), "--out", str(work / "store"),
                                           "--quiet"], stdout=subprocess.DEVNULL, check=True),
            "biopython": lambda: biopython_baseline(fasta, work / "bio"),
        }
        # Interleaved rounds, so every contender sees the same state of the machine.
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, fn in runs.items():
                times[name].append(timeit(fn, 1, fresh))
        t_floor, t_prep, t_cli, t_bio = (statistics.median(times[k]) for k in runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    size = fasta.stat().st_size
    print(f"input: {fasta.name} ({size / 1e6:.1f} MB), machine: {machine()}, median of {args.repeat}")
    print(f"  gzip -dc > /dev/null (floor)     {t_floor:8.3f} s")
    print(f"  megabase prepare (in process)    {t_prep:8.3f} s")
    print(f"  megabase prepare (CLI, process)  {t_cli:8.3f} s")
    print(f"  Biopython SeqIO + numpy LUT      {t_bio:8.3f} s")
    print(f"ratio prepare / floor              {t_prep / t_floor:8.2f}x  (target <= 1.5)")
    print(f"ratio CLI prepare / floor          {t_cli / t_floor:8.2f}x  (whole process, for reference)")
    print(f"ratio Biopython / prepare          {t_bio / t_prep:8.2f}x  (target >= 3)")


if __name__ == "__main__":
    main()
