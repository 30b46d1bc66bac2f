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
