"""prepare throughput vs the decompression floor and vs a plain Biopython + numpy tokenizer.

    python benchmarks/bench_prepare.py [FASTA] [--repeat 3] [--no-biopython]

Without FASTA the input is an ~80 Mbp multi-record gzip FASTA made in a temporary folder from the
two shared genomes (human chr22 subset + *U. maydis* + its chr01-chr06 renamed: 80.3 Mbp, 43
records, ``gzip -6``). Contenders run in interleaved rounds (each sees the same state of a shared
machine) after one untimed warm-up round; min and median of ``--repeat`` rounds. Prints, measured in
this run: ``megabase prepare`` as a user runs it, the whole command in a fresh process, over
``gzip -dc FILE > /dev/null`` (target <= 1.3, min of rounds); the in-process figure beside it; and
``Biopython baseline / prepare`` (target >= 3).

The command runs with cached bytecode, as an installed megabase does: where this environment sets
PYTHONDONTWRITEBYTECODE, the command gets a PYTHONPYCACHEPREFIX in the temporary folder instead, so
nothing is written into the checkout.
"""

from __future__ import annotations

import argparse
import gzip
import os
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
from megabase.core.vocab import TOKEN_TABLE  # noqa: E402


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


def multi_record_genome(out: Path) -> Path:
    """~80 Mbp, 43 records: the human chr22 subset (as ``hs_chr22``), *U. maydis*, and *U. maydis*
    chr01-chr06 again (``copy_chr01``...), gzip level 6 (what ``gzip`` writes by default)."""
    human = gzip.decompress((GENOMES / "hsap_chr22_subset.fa.gz").read_bytes())
    fungus = gzip.decompress((GENOMES / "umaydis.fa.gz").read_bytes())
    copy = b"\n>".join(b"copy_" + part for part in fungus[1:].split(b"\n>")[:6])
    text = human.replace(b">chr22", b">hs_chr22", 1) + fungus + b">" + copy.rstrip(b"\n") + b"\n"
    path = out / "multi80.fa.gz"
    path.write_bytes(gzip.compress(text, compresslevel=6, mtime=0))
    return path


def command_env(work: Path) -> dict:
    env = dict(os.environ)
    if env.pop("PYTHONDONTWRITEBYTECODE", None) or sys.flags.dont_write_bytecode:
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fasta", nargs="?", help="default: an ~80 Mbp multi-record gzip FASTA "
                        "made from the shared genomes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-biopython", action="store_true", help="leave the baseline out")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        fasta = Path(args.fasta) if args.fasta else multi_record_genome(work)
        size = fasta.stat().st_size

        def floor():
            subprocess.run(["gzip", "-dc", str(fasta)], stdout=subprocess.DEVNULL, check=True)

        def fresh():
            shutil.rmtree(work / "store", ignore_errors=True)
            shutil.rmtree(work / "bio", ignore_errors=True)

        exe = shutil.which("megabase", path=str(Path(sys.executable).parent))
        env = command_env(work)
        runs = {
            "floor": floor,
            "prepare": lambda: prepare(fasta, work / "store", progress=False),
            # as a user types it; its summary table goes to a pipe, its progress bar hides itself
            "command": lambda: subprocess.run([exe, "prepare", str(fasta), "--out",
                                               str(work / "store")], env=env,
                                              stdout=subprocess.PIPE, check=True),
            "biopython": lambda: biopython_baseline(fasta, work / "bio"),
        }
        if args.no_biopython:
            del runs["biopython"]
        for fn in runs.values():  # warm-up: page cache, bytecode, the first store's folders
            timeit(fn, 1, fresh)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, fn in runs.items():
                times[name].append(timeit(fn, 1, fresh))
        fresh()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"input: {fasta.name} ({size / 1e6:.1f} MB), machine: {machine()}, "
          f"{args.repeat} interleaved rounds")
    print("                                     min s    median s")
    labels = {"floor": "gzip -dc > /dev/null (floor)", "prepare": "megabase prepare (in process)",
              "command": "megabase prepare (whole command)", "biopython": "Biopython SeqIO + numpy LUT"}
    for name in runs:
        print(f"  {labels[name]:33s} {best[name]:7.3f}  {median[name]:8.3f}")
    print(f"ratio command / floor               {best['command'] / best['floor']:7.2f}x  "
          "(min of rounds; target <= 1.3)")
    print(f"ratio in-process prepare / floor    {best['prepare'] / best['floor']:7.2f}x")
    if "biopython" in runs:
        print(f"ratio Biopython / prepare           {best['biopython'] / best['prepare']:7.2f}x  "
              "(target >= 3)")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load >= cores:  # gzip is one thread; prepare's threads then overlap little
        print(f"note: load average {load:.1f} on {cores} cores: other work held the cores")


if __name__ == "__main__":
    main()
