import numpy as np
import pytest
import torch

from megabase.data import InputError
from megabase.data.vocab import RC_LUT, SEP, tokenize
from megabase.infer import read_vcf, score_tile, score_variants
from megabase.model import load_checkpoint, log_probs
from megabase.pipeline.cli import main

HEADER = ("##fileformat=VCFv4.2\n##contig=<ID=chr22>\n##contig=<ID=22>\n##contig=<ID=chr01>\n"
          "##contig=<ID=chr99>\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n")


def _total(model, tokens):
    seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
    lp = log_probs(model, seq)[0].double().numpy()
    return float(lp[tokens < 4].sum())


def _vcf(tmp_path, store, rows, name="v.vcf"):
    """rows: (chrom, 1-based pos, ref or None for the genome's base, alt)."""
    lines = []
    for chrom, pos, ref, alt in rows:
        if ref is None:
            ref = "ACGTN"[int(store.tokens("chr22" if chrom in ("22", "chr22") else chrom)[pos - 1])]
        lines.append(f"{chrom}\t{pos}\t.\t{ref}\t{alt}\t.\t.\t.")
    path = tmp_path / name
    path.write_text(HEADER + "\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("staged", [False, True])
def test_a_score_equals_two_independent_full_passes(checkpoint, bundled_store, staged):
    from tests.kernels.test_dsa_candidates import STAGED_MODEL

    model = load_checkpoint(checkpoint, **(STAGED_MODEL if staged else {})).eval()
    tile = np.asarray(bundled_store.tokens("chr22")[40_000:43_000])
    edits = [(1_500, tile[1_500:1_501], np.array([(tile[1_500] + 1) % 4], dtype=np.uint8)),
             (0, tile[:1], np.array([(tile[0] + 2) % 4], dtype=np.uint8)),
             (700, tile[700:701], tokenize("ACGTT")),  # insertion
             (2_200, tile[2_200:2_210], tile[2_200:2_201]),  # deletion of 9 bases
             (1_500, tile[1_500:1_501], np.array([(tile[1_500] + 3) % 4], dtype=np.uint8))]
    ref_total = _total(model, tile)
    got = score_tile(model, tile, edits)
    for (p, ref, alt), delta in zip(edits, got):
        alt_tile = np.concatenate([tile[:p], alt, tile[p + len(ref):]])
        assert abs(delta - (_total(model, alt_tile) - ref_total)) <= 1e-4
    assert len({round(d, 3) for d in got}) == len(got)


def test_cli_writes_tsv_and_vcf_and_averages_strands(checkpoint, bundled_store, tmp_path, capsys):
    import pysam

    vcf = _vcf(tmp_path, bundled_store, [("22", 1_001, None, "A,C"), ("chr22", 1_500, None, "G"),
                                         ("chr22", 5_000, None, "T")])
    out = tmp_path / "o"
    assert main(["variants", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--vcf", str(vcf), "--window", "2048", "--both-strands", "--out", str(out),
                 "--quiet"]) == 0
    assert "variants" in capsys.readouterr().out
    rows = [r.split("\t") for r in (out / "variants.tsv").read_text().splitlines()[1:]]
    assert len(rows) == 4 and rows[0][0] == "chr22" and rows[1][5] == rows[0][5]
    with pysam.VariantFile(str(out / "variants.vcf.gz")) as f:
        recs = list(f)
    assert len(recs) == 3 and len(recs[0].info["MB_LLR"]) == 2
    assert abs(recs[2].info["MB_LLR"][0] - float(rows[3][8])) <= 1e-5
    # the reverse strand: the reverse complement of the tile, the alleles complemented
    model = load_checkpoint(checkpoint).eval()
    tile = np.asarray(bundled_store.tokens("chr22")[4_096:6_144])
    p = 5_000 - 1 - 4_096
    alt = tile.copy()
    alt[p] = 3
    rc = lambda t: RC_LUT[t][::-1].copy()  # noqa: E731
    expected_rev = _total(model, rc(alt)) - _total(model, rc(tile))
    assert abs(float(rows[3][7]) - expected_rev) <= 1e-4
    if rows[3][3] == "T":
        pytest.skip("the genome has T there: the SNV is a no-op")


@pytest.mark.parametrize("row,message", [
    (("chr99", 10, "A", "G"), "no record named 'chr99'"),
    (("chr22", 100, "ACGTACGT", "A"), "does not match the genome"),
    (("chr22", 100, None, "<DEL>"), "symbolic"),
    (("chr22", 100, None, "A,G"), "2 ALT alleles"),
])
def test_bad_records_name_the_vcf_line_and_write_nothing(checkpoint, bundled_store, tmp_path,
                                                         capsys, row, message):
    store = bundled_store
    rows = [("chr22", 50, None, "A"), row]
    if row[2] == "ACGTACGT":
        genome = "".join("ACGTN"[int(t)] for t in store.tokens("chr22")[99:107])
        if genome == "ACGTACGT":
            rows[1] = ("chr22", 100, "TTTTTTTT", "A")
    vcf = _vcf(tmp_path, store, rows)
    out = tmp_path / "o"
    assert main(["variants", "--checkpoint", str(checkpoint), "--data", str(store.path), "--vcf",
                 str(vcf), "--multiallelic", "refuse", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "line 9" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_contig_aliases_resolve_and_multiallelic_records_split(bundled_store, tmp_path):
    vcf = _vcf(tmp_path, bundled_store, [("22", 10, None, "A,C,G")])
    alleles = read_vcf(vcf, bundled_store)
    assert [(v.chrom, v.pos, v.allele) for v in alleles] == [("chr22", 9, 1), ("chr22", 9, 2),
                                                             ("chr22", 9, 3)]
    with pytest.raises(InputError, match="window must be at least 16"):
        score_variants("unused", bundled_store.path, vcf, window=8)
