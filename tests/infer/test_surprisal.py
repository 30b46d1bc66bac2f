import re

import numpy as np
import pytest
import torch

from megabase.data import InputError
from megabase.core.vocab import SEP
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


def _score(checkpoint, store, out, *extra):
    return main(["score", "--checkpoint", str(checkpoint), "--data", str(store.path), "--out",
                 str(out), "--quiet", *extra])


def test_a_score_run_replaces_every_track_of_an_earlier_one(checkpoint, bundled_store, tmp_path,
                                                            capsys):
    import json

    out = tmp_path / "tracks"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    assert _score(checkpoint, bundled_store, out, "--regions", "chr22:1-2,000", "--entropy") == 0
    assert (out / "entropy.bedgraph").is_file() and (out / "entropy.bw").is_file()
    # a second run without --entropy, of another region, as bedGraph only: the first run's
    # entropy and bigWig tracks would otherwise sit beside it as if from the same run
    assert _score(checkpoint, bundled_store, out, "--regions", "chr22:5,001-6,000",
                  "--format", "bedgraph") == 0
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt", "score.json", "surprisal.bedgraph"]
    manifest = json.loads((out / "score.json").read_text())
    assert manifest["regions"] == ["chr22:5,001-6,000"] and manifest["entropy"] is False
    assert manifest["files"] == {"surprisal.bedgraph": (out / "surprisal.bedgraph").stat().st_size}
    assert manifest["checkpoint"] == str(checkpoint.resolve())
    lines = (out / "surprisal.bedgraph").read_text().splitlines()
    assert len(lines) == 1 + 1_000 and lines[1].startswith("chr22\t5000\t5001\t")
    assert (out / "mine.txt").read_text() == "kept"


def test_a_second_score_into_a_busy_out_is_refused(checkpoint, bundled_store, tmp_path, capsys):
    """Two score commands into one --out: the second is refused in one line naming the first,
    which is then stopped (SIGTERM) and leaves nothing either."""
    import subprocess
    import sys
    import time

    out = tmp_path / "tracks"
    first = subprocess.Popen([sys.executable, "-m", "megabase.pipeline.cli", "score",
                              "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                              "--regions", "chr22", "--out", str(out), "--quiet"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (out / ".score.lock").exists() and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
        assert _score(checkpoint, bundled_store, out, "--regions", "chr22:1-1,000",
                      "--entropy") == 2
    finally:
        first.terminate()
        first.wait()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"megabase score: error: {out}: this output folder is in use by "
                          f"process {first.pid} (megabase score)"), err
    assert first.returncode == 130, first.stderr.read()
    assert not out.exists()  # made by the first, which wrote nothing in it


def _score_under_limit(checkpoint, store, out, limit: int, *flags):
    """``megabase score`` in a process whose files may grow to ``limit`` bytes (a full disk)."""
    import resource
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "megabase.pipeline.cli", "score", "--checkpoint", str(checkpoint),
         "--data", str(store.path), *flags, "--out", str(out), "--quiet"], capture_output=True,
        text=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))


def test_a_full_disk_while_writing_tracks_keeps_the_earlier_run_whole(checkpoint, bundled_store,
                                                                      tmp_path, capsys):
    out = tmp_path / "tracks"
    assert _score(checkpoint, bundled_store, out, "--regions", "chr22:1-1,000", "--entropy",
                  "--format", "bedgraph") == 0
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = _score_under_limit(checkpoint, bundled_store, out, 50_000, "--regions", "chr22:1-3,000",
                              "--format", "bedgraph")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert err == f"megabase score: error: {out / 'surprisal.bedgraph'}: File too large"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier  # no temporary, no mix


def test_scoring_progress_reaches_a_log_file_as_lines(checkpoint, bundled_store, tmp_path, capsys,
                                                      monkeypatch):
    monkeypatch.setenv("MEGABASE_PROGRESS_EVERY_S", "0")  # a line at every piece
    assert main(["score", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-6,000", "--out", str(tmp_path / "o"), "--segment", "2048",
                 "--format", "bedgraph"]) == 0
    err = capsys.readouterr().err  # not a terminal: lines, no bar
    lines = [line for line in err.splitlines() if line.startswith("megabase: score: ")]
    assert re.match(r"megabase: score: [\d,]+/6,000 bases \(\d+%\), ", lines[0]), err
    assert lines[-1].startswith("megabase: score: 6,000 bases done in ") and "\r" not in err


def test_a_full_disk_while_writing_a_bigwig_is_one_line(checkpoint, bundled_store, tmp_path):
    """libBigWig does not check its writes: under a file-size limit the command died (SIGSEGV,
    nothing said, a temporary left)."""
    out = tmp_path / "tracks"
    proc = _score_under_limit(checkpoint, bundled_store, out, 20_000, "--regions",
                              "chr22:1-20,000", "--format", "bigwig")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, (proc.returncode, err[-3000:])
    assert err.startswith(f"megabase score: error: {out / 'surprisal.bw'}: "), err
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert set(left) <= {".score.lock"}, left  # no temporary, no track
