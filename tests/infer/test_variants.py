import numpy as np
import pytest
import torch

from megabase.data import InputError
from megabase.core.vocab import RC_LUT, SEP, tokenize
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
    assert message in err and "line 8" in err and len(err.splitlines()) == 1  # 6 header lines
    assert not out.exists()


def test_contig_aliases_resolve_and_multiallelic_records_split(bundled_store, tmp_path):
    vcf = _vcf(tmp_path, bundled_store, [("22", 10, None, "A,C,G")])
    alleles = read_vcf(vcf, bundled_store)
    assert [(v.chrom, v.pos, v.allele) for v in alleles] == [("chr22", 9, 1), ("chr22", 9, 2),
                                                             ("chr22", 9, 3)]
    with pytest.raises(InputError, match="window must be at least 16"):
        score_variants("unused", bundled_store.path, vcf, window=8)


def test_a_plain_gzip_vcf_is_read_from_a_copy_that_is_removed(checkpoint, bundled_store, tmp_path,
                                                              monkeypatch, capsys):
    import gzip
    import tempfile

    import pysam

    temps = tmp_path / "tmp"
    temps.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temps))
    plain = _vcf(tmp_path, bundled_store, [("chr22", 50, None, "A"), ("22", 70, None, "C,G")])
    packed = tmp_path / "v.vcf.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))  # gzip, not bgzip
    seen = lambda vs: [(v.chrom, v.pos, v.ref, v.alt, v.line) for v in vs]  # noqa: E731
    assert seen(read_vcf(packed, bundled_store)) == seen(read_vcf(plain, bundled_store))
    out = tmp_path / "o"
    assert main(["variants", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--vcf", str(packed), "--window", "16", "--out", str(out), "--quiet"]) == 0
    with pysam.VariantFile(str(out / "variants.vcf.gz")) as f:
        assert [len(r.info["MB_LLR"]) for r in f] == [1, 2]
    assert list(temps.iterdir()) == []
    capsys.readouterr()
    packed.write_bytes(gzip.compress(plain.read_bytes())[:-20])  # cut short
    assert main(["variants", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--vcf", str(packed), "--out", str(out / "again"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a readable gzip file" in err and len(err.splitlines()) == 1
    assert list(temps.iterdir()) == []


@pytest.mark.parametrize("contigs", ["", "##contig=<ID=chr01,length=2476500>\n"],
                         ids=["no contig lines", "one of two"])
def test_contigs_the_header_lacks_get_lines_in_the_output(checkpoint, bundled_store, tmp_path,
                                                          contigs):
    """Run in a process of its own: writing such records through htslib used to end the process
    (htslib calls exit), leaving a temporary file in the output folder."""
    import os
    import subprocess
    import sys

    import pysam

    header = ("##fileformat=VCFv4.2\n" + contigs +
              "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n")
    base = lambda name, pos: "ACGTN"[int(bundled_store.tokens(name)[pos - 1])]  # noqa: E731
    vcf = tmp_path / "v.vcf"
    vcf.write_text(header + f"22\t50\t.\t{base('chr22', 50)}\tA\t.\tq10\tDP=5\n"
                   f"chr01\t30\t.\t{base('chr01', 30)}\tC\t.\t.\t.\n")
    out = tmp_path / "o"
    run = subprocess.run(
        [sys.executable, "-m", "megabase.pipeline.cli", "variants", "--checkpoint", str(checkpoint),
         "--data", str(bundled_store.path), "--vcf", str(vcf), "--window", "16", "--out", str(out),
         "--quiet"], capture_output=True, text=True, env=os.environ, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Contig" not in run.stderr and "tabix" not in run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["variants.tsv", "variants.vcf.gz"]
    with pysam.VariantFile(str(out / "variants.vcf.gz")) as f:
        lengths = {name: c.length for name, c in f.header.contigs.items()}
        recs = list(f)
    assert lengths == {"22": bundled_store.length("chr22"), "chr01": bundled_store.length("chr01")}
    assert [(r.chrom, r.pos, len(r.info["MB_LLR"])) for r in recs] == [("22", 50, 1),
                                                                       ("chr01", 30, 1)]
    assert recs[0].info["DP"] == "5" and list(recs[0].filter) == ["q10"]


def test_a_failed_write_leaves_nothing_in_the_output_folder(checkpoint, bundled_store, tmp_path,
                                                            monkeypatch, capsys):
    import errno
    import importlib
    from contextlib import contextmanager
    from pathlib import Path

    from megabase.core import atomic

    variants = importlib.import_module("megabase.infer.variants")  # the function shadows the name

    real = atomic.writing

    @contextmanager
    def disk_full_at_the_vcf(path):
        with real(path) as tmp:
            yield tmp
            if Path(path).name == "variants.vcf.gz":
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    monkeypatch.setattr(variants, "writing", disk_full_at_the_vcf)
    vcf = _vcf(tmp_path, bundled_store, [("chr22", 50, None, "A")])
    out = tmp_path / "o"
    assert main(["variants", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--vcf", str(vcf), "--window", "16", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "No space left on device" in err and len(err.splitlines()) == 1
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("pos,ref,message", [
    (0, "A", "position 0 is outside chr22 (1..{n:,})"),
    ("n+1", "A", "position {n1:,} is outside chr22 (1..{n:,})"),
    ("n", "genome+A", "REF of 2 bases runs past the end of chr22 (1..{n:,})"),
], ids=["position 0", "past the end", "REF past the end"])
def test_positions_outside_the_contig_say_so(checkpoint, bundled_store, tmp_path, capsys, pos, ref,
                                             message):
    n = bundled_store.length("chr22")
    pos = {"n": n, "n+1": n + 1}.get(pos, pos)
    if ref == "genome+A":
        ref = "ACGTN"[int(bundled_store.tokens("chr22")[n - 1])] + "A"
    vcf = _vcf(tmp_path, bundled_store, [("chr22", pos, ref, "G")])
    out = tmp_path / "o"
    assert main(["variants", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--vcf", str(vcf), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(n=n, n1=n + 1) in err and len(err.splitlines()) == 1
    assert "does not match" not in err and not out.exists()


def _span_delta(model, tokens, lo, hi, pos, ref_len, alt, horizon):
    """log p(alt) - log p(ref) over the variant's bases and ``horizon`` after, the pass read from
    ``lo`` (the context) to ``hi``: two independent full passes."""
    tile = np.asarray(tokens[lo:hi])
    p = pos - lo
    alt_tile = np.concatenate([tile[:p], alt, tile[p + ref_len:]])

    def lp(t):
        seq = torch.from_numpy(np.concatenate([[SEP], t]).astype(np.int64))[None]
        got = log_probs(model, seq)[0].double().numpy()
        return np.where(t < 4, got, 0.0)

    end = p + ref_len + horizon
    return float(lp(alt_tile)[p:end - ref_len + len(alt)].sum() - lp(tile)[p:end].sum())


def test_context_mode_gives_each_variant_c_to_2c_of_context_and_a_fixed_horizon(
        checkpoint, bundled_store, tmp_path, capsys):
    """--context 512 --horizon 40: a variant at 1,300 is read from 512 (1,300 - 512 = 788 bases of
    context, in 512..1,024), its score summed over itself and 40 bases; its reverse-strand score
    from a pass whose 3' context runs to 1,536; a deletion's horizon follows its REF."""
    import pysam

    tokens = bundled_store.tokens("chr22")
    g = lambda pos: "ACGTN"[int(tokens[pos - 1])]  # noqa: E731
    vcf = _vcf(tmp_path, bundled_store, [("chr22", 1_301, None, "C" if g(1_301) != "C" else "A"),
                                         ("chr22", 1_401, g(1_401) + g(1_402) + g(1_403),
                                          g(1_401)),
                                         ("chr22", 2_000, None, "G" if g(2_000) != "G" else "T")])
    out = tmp_path / "o"
    assert main(["variants", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--vcf", str(vcf), "--context", "512", "--horizon", "40", "--both-strands",
                 "--out", str(out), "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "512 to 1,024 bases of prior context" in said and "2 passes" in said
    rows = [r.split("\t") for r in (out / "variants.tsv").read_text().splitlines()[1:]]
    model = load_checkpoint(checkpoint).eval()
    snv = tokenize(rows[0][4])
    assert abs(float(rows[0][6]) - _span_delta(model, tokens, 512, 1_300 + 41, 1_300, 1, snv,
                                               40)) <= 1e-4
    deletion = _span_delta(model, tokens, 512, 1_400 + 43, 1_400, 3, tokenize(rows[1][4]), 40)
    assert abs(float(rows[1][6]) - deletion) <= 1e-4
    # 1,999 lies in 1,536..2,048: read from 1,024
    snv = tokenize(rows[2][4])
    assert abs(float(rows[2][6]) - _span_delta(model, tokens, 1_024, 2_040, 1_999, 1, snv,
                                               40)) <= 1e-4
    # the reverse strand of the first: the reverse complement of 1,024 - 40 .. 2,048 (the forward
    # coordinates), its context the 1,536 - 1,301 bases 3' of it
    rc = lambda t: RC_LUT[np.asarray(t)][::-1].copy()  # noqa: E731
    lo, hi = 1_024 - 40, 2_048
    rev = rc(tokens[lo:hi])
    p = hi - 1_300 - 1
    expected = _span_delta(model, rev, 0, len(rev), p, 1, rc(tokenize(rows[0][4])), 40)
    assert abs(float(rows[0][7]) - expected) <= 1e-4
    with pysam.VariantFile(str(out / "variants.vcf.gz")) as f:
        assert "512 to 1,024 bases of prior context" in str(f.header)


def test_a_horizon_sums_only_the_bases_it_covers(checkpoint, bundled_store):
    model = load_checkpoint(checkpoint).eval()
    tile = np.asarray(bundled_store.tokens("chr22")[40_000:41_001])
    edits = [(300, tile[300:301], np.array([(tile[300] + 1) % 4], dtype=np.uint8)),
             (990, tile[990:991], np.array([(tile[990] + 1) % 4], dtype=np.uint8))]
    short = score_tile(model, tile, edits, horizon=25)
    whole = score_tile(model, tile, edits)
    assert abs(short[0] - _span_delta(model, tile, 0, len(tile), 300, 1, edits[0][2], 25)) <= 1e-4
    assert abs(short[1] - whole[1]) <= 1e-6  # the horizon runs past the tile: it ends there
    assert abs(short[0] - whole[0]) > 1e-6
