"""An exported model in transformers on a batch of short windows: canonical row tiles vs not.

    python benchmarks/bench_hf.py [--checkpoint CKPT] [--preset cpu-small] [--windows 32]
        [--length 200]

Exports ``--checkpoint`` (default: a freshly initialised ``--preset``; speed does not depend on
the weights) with ``megabase export-model``, loads it with ``transformers`` in a subprocess where
megabase is not importable (as on a user's machine), and times one forward of ``--windows``
windows of ``--length`` real bases of the bundled genome's chr22 (``bench_use``'s), as a linear probe or a
fine-tuning step reads them: the default ``canonical_tiles=True`` (megabase's 1,024-row tiles,
its log-probs to the last bit) against ``canonical_tiles=False`` (products on the rows as given).
Prints both times, the ratio and the largest log-prob difference between the two.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_use import bases, model_of  # noqa: E402
from common import machine  # noqa: E402

LOAD = r'''
import json, sys, time
sys.modules["megabase"] = None
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, seqs = sys.argv[1], json.loads(open(sys.argv[2]).read())
tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
ids = tok(seqs, padding=True, return_tensors="pt").input_ids
res = {}
for canonical in (True, False, True, False):
    lm = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                              canonical_tiles=canonical).eval()
    with torch.no_grad():
        start = time.perf_counter()
        lp = lm(ids).logits.log_softmax(-1)
        took = time.perf_counter() - start
    key = "canonical" if canonical else "as_given"
    res[key] = min(res.get(key, float("inf")), took)
    res[key + "_lp"] = lp
res["max_diff"] = float((res.pop("canonical_lp") - res.pop("as_given_lp")).abs().max())
print(json.dumps(res))
'''


def windows(count: int, length: int) -> list[str]:
    """``count`` windows of ``length`` A/C/G/T (no N) from the bundled genome's chr22."""
    tokens = bases(count * length * 8)
    starts = [s for s in range(0, len(tokens) - length, length) if (tokens[s : s + length] < 4).all()]
    pick = np.random.default_rng(0).choice(starts, count, replace=False)
    return ["".join("ACGT"[b] for b in tokens[s : s + length]) for s in pick]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--length", type=int, default=200)
    args = ap.parse_args()
    from megabase.infer.hf import export_model
    from megabase.model import save_checkpoint

    print(f"machine: {machine()}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = args.checkpoint or save_checkpoint(model_of(args.preset), tmp / "ckpt")
        export_model(ckpt, tmp / "hf")
        (tmp / "seqs.json").write_text(json.dumps(windows(args.windows, args.length)))
        # run from the temporary folder: the repository's kernels/ would shadow transformers' own
        done = subprocess.run([sys.executable, "-c", LOAD, str(tmp / "hf"), str(tmp / "seqs.json")],
                              cwd=tmp, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        r = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.windows} windows of {args.length} bases, one forward: canonical tiles "
          f"{r['canonical']:.2f} s, rows as given {r['as_given']:.2f} s -> ratio "
          f"{r['canonical'] / r['as_given']:.1f}x (largest log-prob difference "
          f"{r['max_diff']:.2g})", flush=True)


if __name__ == "__main__":
    main()
