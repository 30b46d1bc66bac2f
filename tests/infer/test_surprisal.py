import numpy as np
import pytest
import torch

from megabase.data import InputError
from megabase.data.vocab import SEP
from megabase.infer import score, score_tokens
from megabase.infer.common import LN2
from megabase.infer.tracks import _runs
from megabase.model import load_checkpoint, log_probs
from megabase.pipeline.cli import main


def _full_pass(ckpt, tokens):
    model = load_checkpoint(ckpt).eval()
    seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
    with torch.no_grad():
        out = model(seq[:, :-1])
    logp = torch.log_softmax(out.logits[0].float(), -1)
    return -log_probs(model, seq)[0].numpy() / LN2, (-(logp.exp() * logp).sum(-1) / LN2).numpy()


def test_streamed_surprisal_and_entropy_equal_the_full_pass(checkpoint, bundled_store):
    tokens = np.asarray(bundled_store.tokens("chr22")[50_000:55_001])
    bits, entropy = _full_pass(checkpoint, tokens)
    model = load_checkpoint(checkpoint).eval()
    got, got_entropy = score_tokens(model, tokens, segment=1_500, entropy=True)
    assert np.abs(got - bits).max() <= 1e-4 / LN2 and np.abs(got_entropy - entropy).max() <= 1e-4
    assert 0 <= got_entropy.min() and got_entropy.max() <= 2 and got.std() > 0.1
    # with context: the region's bases score as the tail of the longer sequence
    tail, _ = score_tokens(model, tokens, skip=3_000, segment=1_024)
    assert np.abs(tail - bits[3_000:]).max() <= 1e-4 / LN2


def test_cli_writes_bedgraph_and_bigwig_that_read_back(checkpoint, bundled_store, tmp_path, capsys):
    import pyBigWig

    out = tmp_path / "tracks"
    (tmp_path / "tracks").mkdir()
    (out / "mine.txt").write_text("kept")
    assert main(["score", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--regions", "22:1-2,500,chr22:10,001-11,000", "--entropy", "--context", "500",
                 "--segment", "1000", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "mean bits/base" in printed and "peak memory" in printed
    assert (out / "mine.txt").read_text() == "kept"
    tokens = np.asarray(bundled_store.tokens("chr22")[:11_000])
    bits, _ = _full_pass(checkpoint, tokens[:2_500])
    lines = (out / "surprisal.bedgraph").read_text().splitlines()
    assert lines[0].startswith("track type=bedGraph") and len(lines) == 1 + 2_500 + 1_000
    chrom, start, end, value = lines[1 + 123].split("\t")
    assert (chrom, int(start), int(end)) == ("chr22", 123, 124)
    assert abs(float(value) - bits[123]) <= 1e-4
    bw = pyBigWig.open(str(out / "surprisal.bw"))
    try:
        assert bw.chroms("chr22") == bundled_store.length("chr22")
        assert np.allclose(bw.values("chr22", 0, 2_500), bits, atol=1e-4)
        assert np.isnan(bw.values("chr22", 2_500, 2_501)[0])
    finally:
        bw.close()
    # the second region read 500 bases of context before it: the bases of a longer pass
    model = load_checkpoint(checkpoint).eval()
    with_context, _ = score_tokens(model, tokens[9_500:11_000], skip=500)
    bw = pyBigWig.open(str(out / "entropy.bw"))
    assert len(bw.values("chr22", 10_000, 11_000)) == 1_000
    bw.close()
    bw = pyBigWig.open(str(out / "surprisal.bw"))
    assert np.allclose(bw.values("chr22", 10_000, 11_000), with_context, atol=1e-4)
    bw.close()


def test_non_bases_are_left_out_of_tracks():
    values = np.array([np.nan, 1, 2, np.nan, np.nan, 3, np.nan, 4], dtype=np.float32)
    assert _runs(values) == [(1, 3), (5, 6), (7, 8)]
    assert _runs(np.full(3, np.nan)) == []


@pytest.mark.parametrize("regions,message", [
    ("chr99", "no record named 'chr99'"),
    ("chr22:1-999,999,999", "past the end of chr22"),
    ("chr22:1-1000,chr22:500-2000", "overlap"),
])
def test_bad_regions_are_one_line_and_write_nothing(checkpoint, bundled_store, tmp_path, capsys,
                                                    regions, message):
    out = tmp_path / "o"
    assert main(["score", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--regions", regions, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("megabase score: error:")
    assert not out.exists() or not any(out.iterdir())


def test_out_that_is_a_file_is_refused_before_scoring(checkpoint, bundled_store, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        score(checkpoint, bundled_store.path, ["chr22:1-100"], out=target)
    assert target.read_text() == "x"


def test_the_dsa_stage_is_the_checkpoints_unless_chosen(checkpoint, bundled_store, tmp_path, capsys):
    # a 3,000-base region scores the same with every stage: the stage starts at 65,536 here
    base = score(checkpoint, bundled_store.path, ["chr22:1-3,000"], formats=(), progress=False)
    exact = score(checkpoint, bundled_store.path, ["chr22:1-3,000"], formats=(), progress=False,
                  dsa_stage="exact")
    assert np.array_equal(base.tracks[0].bits, exact.tracks[0].bits, equal_nan=True)
    assert main(["score", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-3,000", "--dsa-stage", "median", "--out",
                 str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--dsa-stage must be one of exact, mean, max, got 'median'" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
