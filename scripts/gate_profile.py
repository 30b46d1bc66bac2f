"""What a model's DSA output gates (``dsa_gate``) do on one held-out window: the mean gate of each
head on unique and repeat bases per bin of prior context (1: open, as at the start).

    python scripts/gate_profile.py --checkpoint RUN_OR_CHECKPOINT --data STORE \\
        [--region chr22:40,000,001-41,048,576] [--segment 65536] [--out profile.json]

One model pass over the region, streamed in pieces of ``--segment`` (docs/science.md §14).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megabase.data import TokenStore
from megabase.data.names import parse_region
from megabase.eval.bins import default_edges
from megabase.eval.gates import gate_profile
from megabase.model import load_checkpoint
from megabase.model.checkpoint import resolve_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--region", default="chr22:40,000,001-41,048,576")
    p.add_argument("--segment", type=int, default=65_536)
    p.add_argument("--out", help="also write the profile here as JSON")
    a = p.parse_args()
    store = TokenStore(a.data)
    region = parse_region(a.region, store.names, str(store.path))
    end = region.end if region.end is not None else store.length(region.name)
    tokens, repeat = store.fetch(region.name, region.start, end)
    model = load_checkpoint(resolve_checkpoint(a.checkpoint))
    edges = default_edges(len(tokens))
    rows = gate_profile(model, tokens, repeat, edges, segment=a.segment)
    print(f"{a.checkpoint}: mean DSA gate per head (1 = open), unique / repeat bases, {a.region}")
    for row in rows:
        print(f"DSA layer {row['layer']}")
        for b in row["bins"]:
            u, r = b["unique"], b["repeat"]
            fmt = lambda g: " ".join(f"{x:.3f}" for x in g) if g else "-"  # noqa: E731
            print(f"  {b['context_lo']:>9,}-{b['context_hi']:<9,}  unique {fmt(u['mean_gate'])} "
                  f"({u['n_bases']:,})   repeat {fmt(r['mean_gate'])} ({r['n_bases']:,})")
    if a.out:
        Path(a.out).write_text(json.dumps({"checkpoint": a.checkpoint, "region": a.region,
                                           "edges": edges, "layers": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
