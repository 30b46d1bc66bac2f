"""The alignment reading of scripts/primate_variants.py on a hand-made MAF."""

import gzip
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from primate_variants import find_sites, markov_llr  # noqa: E402

MAF = """##maf version=1
a
s Hsap.22 100 12 + 1000 ACGTAC-GTACGT
s Ptro.22 90 13 + 900 ACTTACAGTACGA
s Ggor.22 80 13 + 800 ACGTACAGTACGT

a
s Hsap.22 200 6 + 1000 aaCCGG
s Ptro.22 190 6 + 900 AGCCGT
"""


@pytest.fixture
def maf(tmp_path: Path) -> Path:
    path = tmp_path / "aln.maf.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(MAF)
    return path


def test_sites_are_human_positions_of_single_base_differences(maf):
    # block 1: G/T at column 2 (human 102), human gap at column 6, T/A at the last column (111)
    # block 2 is lower case in human: a/G at 201, G/T at 205
    assert find_sites(maf, (0, 1000), flank=0) == [(102, "G", "T"), (111, "T", "A"), (201, "A", "G"),
                                                    (205, "G", "T")]


def test_sites_near_a_gap_or_outside_the_region_are_left_out(maf):
    assert find_sites(maf, (0, 1000), flank=4) == [(111, "T", "A"), (201, "A", "G"), (205, "G", "T")]
    assert find_sites(maf, (110, 202), flank=0) == [(111, "T", "A"), (201, "A", "G")]


def test_markov_llr_counts_only_the_bases_the_substitution_touches():
    from megabase.eval.markov import MarkovModel

    rng = np.random.default_rng(0)
    train = rng.integers(0, 4, 5000).astype(np.uint8)
    model = MarkovModel(2).fit(train)
    tokens = rng.integers(0, 4, 50).astype(np.uint8)
    alt = "ACGT"[(tokens[20] + 1) % 4]
    edited = tokens.copy()
    edited[20] = (tokens[20] + 1) % 4
    whole = np.nansum(model.log_probs(edited)) - np.nansum(model.log_probs(tokens))
    assert markov_llr(model, tokens, 20, alt) == pytest.approx(whole, abs=1e-9)


def test_the_script_scores_planted_differences_at_two_contexts(checkpoint, bundled_store,
                                                               tmp_path):
    """A MAF whose human row is the store's own chr22 and whose chimpanzee row differs at every
    50th base: the script draws sites from 2 blocks, scores them at contexts 64 and 256 and
    reports the two, the Markov baseline and the paired change."""
    import subprocess

    tokens = np.asarray(bundled_store.tokens("chr22")[:6_000])
    human = "".join("ACGTN"[min(int(t), 4)] for t in tokens)
    chimp = list(human)
    for i in range(25, len(chimp), 50):
        chimp[i] = "ACGT"[("ACGT".index(human[i]) + 1) % 4] if human[i] in "ACGT" else human[i]
    maf = tmp_path / "aln.maf.gz"
    with gzip.open(maf, "wt") as fh:
        fh.write(f"##maf version=1\na\ns Hsap.22 0 6000 + 6000 {human}\n"
                 f"s Ptro.22 0 6000 + 6000 {''.join(chimp)}\n")
    out = tmp_path / "check"
    script = Path(__file__).resolve().parents[2] / "scripts" / "primate_variants.py"
    done = subprocess.run([sys.executable, str(script), "--checkpoint", str(checkpoint),
                           "--data", str(bundled_store.path), "--maf", str(maf), "--out", str(out),
                           "--region", "chr22:1,001-6,000", "--sites", "8", "--context", "64,256",
                           "--horizon", "16", "--blocks", "2", "--markov", "2"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    said = (out / "summary.txt").read_text()
    assert "model at 64..128" in said and "model at 256..512" in said
    assert "order-2 Markov, any random base: n=8" in said
    assert "context 256 vs 64" in said and "paired over 8 sites" in said
    sites = [int(line.split("\t")[1]) - 1 for line in (out / "sites.vcf").read_text().splitlines()
             if not line.startswith("#")]
    assert len({s // 256 for s in sites}) <= 2 and all(s % 50 == 25 for s in sites)
    assert "model at 64..128 vs order-2 Markov, any random base: chimpanzee allele higher at" in said
    for c in (64, 256):
        assert (out / f"context-{c}" / "variants.tsv").is_file()
    # again: the earlier scores are read, and the summary is the same
    again = subprocess.run(done.args, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("read from") == 2
    same = (out / "summary.txt").read_text()
    strip = lambda t: [l for l in t.splitlines() if "scored in" not in l and "read from" not in l]  # noqa: E731
    assert strip(same) == strip(said)
