"""Scoring one window with the copy-model reference vs with the order-12 Markov chain.

    python benchmarks/bench_copy.py [FASTA] [--lengths 16384,65536,1048576] [--repeat 5]

Both are fitted on the first 20 Mb of human chr22 (the bundled subset), then score the same real
held-out windows (chr22 from 40 Mb on); the time of a window is the median over ``--repeat``
runs. The copy model's time includes computing the mixed chains' (orders 2, 4, 8, 12) tables of
the window. Both run on one thread, so the time is CPU time (``time.process_time``): on a shared
machine it drifts less than wall time. Prints per length the ratio ``copy / order-12`` (target
<= 1) and each one's bits/base on the windows.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GENOMES, machine  # noqa: E402

from megabase.data import TokenStore, prepare  # noqa: E402
from megabase.eval.copymodel import CopyModel  # noqa: E402
from megabase.eval.markov import MarkovModel  # noqa: E402


def cpu_time(fn, repeat: int) -> float:
    """Median CPU seconds of ``fn()`` over ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fasta", nargs="?", default=str(GENOMES / "hsap_chr22_subset.fa.gz"))
    parser.add_argument("--lengths", default="16384,65536,1048576")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-copy-") as work:
        prepare(args.fasta, Path(work) / "store", progress=False)
        store = TokenStore(Path(work) / "store")
        tokens = np.array(store.tokens(store.names[0]))
        train = tokens[:20_000_000]
        copy = CopyModel().fit([train])
        chain = MarkovModel(12).fit(train)
        print(f"machine: {machine()}; fitted on 20 Mb of {store.names[0]}")
        print(f"{'length':>10} {'order-12 s':>11} {'copy s':>9} {'ratio':>6} "
              f"{'order-12 bits':>14} {'copy bits':>10}")
        for length in (int(x) for x in args.lengths.split(",")):
            held = tokens[40_000_000:]
            start = next(i for i in range(0, len(held) - length, 65536)
                         if (held[i : i + length] < 4).mean() > 0.8)
            window = held[start : start + length]
            t_chain = cpu_time(lambda: chain.log_probs(window), args.repeat)
            t_copy = cpu_time(lambda: copy.nll(window), args.repeat)
            ok = window < 4
            bits_chain = -chain.log_probs(window)[ok].mean() / math.log(2)
            bits_copy = copy.nll(window)[ok].mean() / math.log(2)
            print(f"{length:>10,} {t_chain:>11.4f} {t_copy:>9.4f} {t_copy / t_chain:>6.2f} "
                  f"{bits_chain:>14.4f} {bits_copy:>10.4f}")


if __name__ == "__main__":
    main()
