"""Real-variant sanity check: human-chimpanzee differences should score as less damaging than
random substitutions at the same sites.

    python scripts/primate_variants.py --checkpoint RUN_OR_CHECKPOINT --data HUMAN_STORE \\
        --maf /usr/share/doc/maffilter/examples/Gorilla/Compara.epo_5_catarrhini_hsap-projected.chr22.subset.nogap.cleaned_aln.maf.gz \\
        --out primate-check [--sites 600] [--context 4096,65536] [--blocks 24] \
        [--region chr22:40,000,001-51,304,566]

The alignment is the Ensembl Compara EPO 5-primate chr22 one that the bundled human subset comes
from (Debian package ``maffilter-examples``; ``apt-get download maffilter-examples`` and
``dpkg-deb -x`` it anywhere). A site is an aligned column inside ``--region`` (held out from
training) where human and chimpanzee carry different bases, with no gap in either within
``--flank`` columns. At each of ``--sites`` sites drawn at random, two alternative alleles of the
human base are scored by ``megabase variants`` (one multi-allelic VCF record):

- the chimpanzee base (a substitution evolution tolerated), and
- a random base, neither human nor chimpanzee, at the same site.

Transitions (A<->G, C<->T) are most of the chimpanzee differences and are, by sequence
composition alone, likelier than transversions; so the same comparison is also made with the
type matched: at sites where the chimpanzee base is a transversion, the random base is the other
transversion. An order-``--markov`` Markov model fitted on the store's bases outside ``--region``
scores the same alleles (the change in log-likelihood of the bases the substitution touches) as
what k-mer statistics alone give.

Each allele is scored at each ``--context`` length C with C to 2C bases of context before it and
summed over itself and the ``--horizon`` bases after (``megabase variants --context``), so that
two lengths score the same bases and differ only in what the model may read; the change of the
chimpanzee-minus-random difference between the shortest and each longer context is reported per
site, paired. A pass over 2C bases serves the sites of C bases, so scattered sites cost about 2C
bases each: ``--blocks B`` draws the sites from B random blocks of the longest context instead of
the whole region (``0``: anywhere).

Writes ``--out``/sites.vcf, the ``megabase variants`` outputs (``--out``/context-C), and prints
the comparison (also to ``--out``/summary.txt). Run again with the same arguments, it reads the
scores of every context an earlier try finished instead of scoring them again.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from megabase.data import TokenStore
from megabase.data.names import parse_region
from megabase.core.vocab import tokenize

BASES = "ACGT"
TRANSITION = {"A": "G", "G": "A", "C": "T", "T": "C"}


def aligned_pairs(maf: Path, human: str = "Hsap", chimp: str = "Ptro"):
    """``(human position 0-based, human base, chimp base)`` of each column where both species
    carry a base; ``-`` where a species has a gap (positions of human gaps are skipped)."""
    block: dict[str, tuple[int, str]] = {}

    def flush():
        if human in block and chimp in block:
            start, h = block[human]
            c = block[chimp][1]
            yield start, h, c

    with gzip.open(maf, "rt") as fh:
        for line in fh:
            if line.startswith("a"):
                yield from flush()
                block = {}
            elif line.startswith("s "):
                _, src, start, _size, strand, _total, text = line.split()
                species = src.split(".")[0]
                if strand != "+" and species == human:
                    raise SystemExit(f"{maf}: human row on the - strand, not handled")
                block[species] = (int(start), text.upper())
    yield from flush()


def find_sites(maf: Path, chrom_range: tuple[int, int], flank: int) -> list[tuple[int, str, str]]:
    lo, hi = chrom_range
    sites = []
    for start, h, c in aligned_pairs(maf):
        hs, cs = np.frombuffer(h.encode(), np.uint8), np.frombuffer(c.encode(), np.uint8)
        gap = (hs == ord("-")) | (cs == ord("-"))
        gaps = np.concatenate([[0], np.cumsum(gap)])  # gaps within flank columns either side:
        idx = np.arange(len(gap))
        near_gap = gaps[np.minimum(idx + flank + 1, len(gap))] - gaps[np.maximum(idx - flank, 0)] > 0
        pos = start + np.cumsum(hs != ord("-")) - 1  # the human position of each column
        for j in np.flatnonzero((hs != cs) & ~near_gap):
            if h[j] in BASES and c[j] in BASES and lo <= pos[j] < hi:
                sites.append((int(pos[j]), h[j], c[j]))
    return sites


def markov_llr(model, tokens: np.ndarray, pos: int, alt: str) -> float:
    """Order-k Markov ``log p(alt) - log p(ref)`` over the ``k + 1`` bases the substitution touches."""
    k = model.order
    lo, hi = max(pos - k, 0), min(pos + k + 1, len(tokens))
    ref = tokens[lo:hi].copy()
    edited = ref.copy()
    edited[pos - lo] = tokenize(alt)[0]
    a, r = model.log_probs(edited)[pos - lo :], model.log_probs(ref)[pos - lo :]
    return float(np.nansum(a) - np.nansum(r))


def boot_ci(values: np.ndarray, rng) -> tuple[float, float]:
    """95% CI of the mean of ``values`` over sites, 2,000 bootstrap draws from ``rng``."""
    boot = [values[rng.integers(0, len(values), len(values))].mean() for _ in range(2000)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return lo, hi


def summary(name: str, tolerated: np.ndarray, random: np.ndarray, rng) -> str:
    diff = tolerated - random
    lo, hi = boot_ci(diff, rng)
    return (f"{name}: n={len(diff)}, mean LLR chimpanzee {tolerated.mean():+.3f}, random "
            f"{random.mean():+.3f} nats; difference {diff.mean():+.3f} (95% CI {lo:+.3f} to "
            f"{hi:+.3f}); chimpanzee allele scored higher at {np.mean(diff > 0):.1%} of sites")


def beyond(name: str, model_gap: np.ndarray, markov_gap: np.ndarray, rng) -> str:
    """Does the model tell the alleles apart beyond k-mer statistics: the share of sites where it
    scores the chimpanzee allele above the random one, minus the Markov chain's share, paired per
    site (the two scores are sums over different spans, so their signs compare, not their sizes)."""
    diff = (model_gap > 0).astype(float) - (markov_gap > 0)
    lo, hi = boot_ci(diff, rng)
    return (f"{name}: chimpanzee allele higher at {np.mean(model_gap > 0):.1%} vs "
            f"{np.mean(markov_gap > 0):.1%} of sites, difference {diff.mean():+.1%} (95% CI "
            f"{lo:+.1%} to {hi:+.1%})")


def scores(args, vcf: Path, out: Path, context: int, reuse: bool) -> tuple[dict, str]:
    """``(pos, alt) -> delta`` at ``context`` and a line on how it was had: ``megabase variants``
    run now, or (``reuse``: the sites are an earlier try's) the TSV that try wrote."""
    from megabase.infer import score_variants

    tsv = out / "variants.tsv"
    if reuse and tsv.is_file():
        rows = [line.split("\t") for line in tsv.read_text().splitlines()[1:]]
        return ({(int(r[1]) - 1, r[4]): float(r[8]) for r in rows},
                f"scores of {len(rows)} alleles read from {tsv} (an earlier try)")
    result = score_variants(args.checkpoint, args.data, vcf, out, context=context,
                            horizon=args.horizon)
    return ({(v.pos, v.alt): v.delta for v in result.variants},
            f"scored in {result.seconds:.0f} s ({len(result.variants)} alleles, "
            f"{result.windows} passes)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="token store of the human chr22 subset")
    p.add_argument("--maf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--region", default="chr22:40,000,001-51,304,566")
    p.add_argument("--sites", type=int, default=600)
    p.add_argument("--context", default="4096,65536",
                   help="prior context lengths C, comma-separated: each site gets C..2C bases")
    p.add_argument("--horizon", type=int, default=256,
                   help="bases after the site that each score also sums (default 256)")
    p.add_argument("--blocks", type=int, default=24,
                   help="draw the sites from this many blocks of the longest context (0: anywhere)")
    p.add_argument("--flank", type=int, default=5)
    p.add_argument("--markov", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from megabase.eval.markov import MarkovModel

    store = TokenStore(args.data)
    region = parse_region(args.region, store.names, str(store.path))
    chrom = region.name
    end = region.end if region.end is not None else store.length(chrom)
    tokens = np.asarray(store.tokens(chrom))
    sites = find_sites(Path(args.maf), (region.start, end), args.flank)
    mismatch = sum(BASES[min(tokens[pos], 3)] != h or tokens[pos] > 3 for pos, h, _ in sites)
    if mismatch > len(sites) // 100:
        raise SystemExit(f"{args.maf}: {mismatch} of {len(sites)} human bases differ from {args.data}")
    contexts = sorted({int(c.replace(",", "").replace("_", "")) for c in args.context.split(",")})
    rng = np.random.default_rng(args.seed)
    print(f"{len(sites):,} human-chimpanzee single-base differences in {args.region} "
          f"(no gap within {args.flank})", flush=True)
    pool = np.arange(len(sites))
    if args.blocks:
        block_of = np.array([pos // contexts[-1] for pos, _, _ in sites])
        blocks = np.unique(block_of)
        kept = rng.choice(blocks, min(args.blocks, len(blocks)), replace=False)
        pool = np.flatnonzero(np.isin(block_of, kept))
        print(f"drawing from {len(kept)} blocks of {contexts[-1]:,} bases ({len(pool):,} sites)")
    chosen = sorted(rng.choice(pool, min(args.sites, len(pool)), replace=False))
    print(f"scoring {len(chosen)} sites at context {', '.join(f'{c:,}' for c in contexts)}",
          flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in chosen:
        pos, h, c = sites[i]
        others = [b for b in BASES if b not in (h, c)]
        transversion = TRANSITION[h] != c
        random_base = others[rng.integers(2)]
        matched = next(b for b in others if TRANSITION[h] != b) if transversion else None
        rows.append((pos, h, c, random_base, matched))
    lines = ["##fileformat=VCFv4.2", f"##contig=<ID={chrom},length={store.length(chrom)}>",
             "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO"]
    for pos, h, c, r, m in rows:
        alts = ",".join([c, r] + ([m] if m and m != r else []))
        lines.append(f"{chrom}\t{pos + 1}\tsite{pos + 1}\t{h}\t{alts}\t.\t.\t.")
    vcf = out / "sites.vcf"
    text = "\n".join(lines) + "\n"
    made = {"checkpoint": str(Path(args.checkpoint).resolve()), "data": str(Path(args.data).resolve()),
            "horizon": args.horizon}
    marker = out / "scored-with.json"
    # an earlier try's scores still hold if it scored these sites with this model
    same_sites = (vcf.is_file() and vcf.read_text() == text and marker.is_file()
                  and json.loads(marker.read_text()) == made)
    vcf.write_text(text)
    marker.write_text(json.dumps(made))

    train = np.concatenate([tokens[: region.start], tokens[end:]])
    markov = MarkovModel(args.markov).fit(train)
    mk = {(pos, b): markov_llr(markov, tokens, pos, b) for pos, h, c, r, m in rows
          for b in (c, r, m) if b}
    report = [summary(f"order-{args.markov} Markov, any random base",
                      np.array([mk[pos, c] for pos, h, c, r, m in rows]),
                      np.array([mk[pos, r] for pos, h, c, r, m in rows]), rng),
              summary(f"order-{args.markov} Markov, transversions matched",
                      np.array([mk[pos, c] for pos, h, c, r, m in rows if m]),
                      np.array([mk[pos, m] for pos, h, c, r, m in rows if m]), rng)]
    print("\n".join(report), flush=True)
    mk_gap = np.array([mk[pos, c] - mk[pos, r] for pos, h, c, r, m in rows])
    mk_tv = np.array([mk[pos, c] - mk[pos, m] for pos, h, c, r, m in rows if m])
    gaps = {}
    for context in contexts:
        delta, how = scores(args, vcf, out / f"context-{context}", context, same_sites)
        chimp = np.array([delta[pos, c] for pos, h, c, r, m in rows])
        gaps[context] = chimp - np.array([delta[pos, r] for pos, h, c, r, m in rows])
        tv = np.array([(delta[pos, c], delta[pos, m]) for pos, h, c, r, m in rows if m])
        name = f"model at {context:,}..{2 * context:,}"
        lines = [summary(f"{name}, any random base", chimp, chimp - gaps[context], rng),
                 summary(f"{name}, transversions matched", tv[:, 0], tv[:, 1], rng),
                 beyond(f"{name} vs order-{args.markov} Markov, any random base", gaps[context],
                        mk_gap, rng),
                 beyond(f"{name} vs order-{args.markov} Markov, transversions matched",
                        tv[:, 0] - tv[:, 1], mk_tv, rng),
                 how]
        print("\n".join(lines), flush=True)
        report += lines
    for context in contexts[1:]:
        change = gaps[context] - gaps[contexts[0]]
        lo, hi = boot_ci(change, rng)
        report.append(f"context {context:,} vs {contexts[0]:,}: chimpanzee-minus-random difference "
                      f"changes by {change.mean():+.4f} nats (95% CI {lo:+.4f} to {hi:+.4f}), "
                      f"paired over {len(change)} sites")
        print(report[-1])
    (out / "summary.txt").write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    sys.exit(main())
