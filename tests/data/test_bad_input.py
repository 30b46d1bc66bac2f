"""Every bad input gets one line naming file, record and problem, exit status 2, and no partial store."""

import gzip
import lzma

import pytest

from megabase.pipeline.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_clean_failure(code, err, tmp_path, *needles, out=None):
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("megabase ")
    for needle in needles:
        assert needle in err, (needle, err)
    leftovers = [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []
    if out is not None:
        assert not out.exists()


def test_missing_file(tmp_path, capsys):
    code, err = run(capsys, "prepare", tmp_path / "nope.fa", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "nope.fa", "no such file", out=tmp_path / "s")


def test_empty_file(tmp_path, capsys):
    (tmp_path / "e.fa").write_bytes(b"")
    code, err = run(capsys, "prepare", tmp_path / "e.fa", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "e.fa", "file is empty", out=tmp_path / "s")


def test_empty_gzip(tmp_path, capsys):
    (tmp_path / "e.fa.gz").write_bytes(gzip.compress(b""))
    code, err = run(capsys, "prepare", tmp_path / "e.fa.gz", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "e.fa.gz", "no '>' header", out=tmp_path / "s")


def test_not_fasta(tmp_path, capsys):
    (tmp_path / "r.fq").write_text("@read1\nACGT\n+\nIIII\n")
    code, err = run(capsys, "prepare", tmp_path / "r.fq", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "r.fq", "not FASTA", "@read1", out=tmp_path / "s")


def test_binary_file(tmp_path, capsys):
    (tmp_path / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    code, err = run(capsys, "prepare", tmp_path / "x.png", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "x.png", "not FASTA", out=tmp_path / "s")


def test_other_compression(tmp_path, capsys):
    (tmp_path / "g.fa.xz").write_bytes(lzma.compress(b">a\nACGT\n"))
    code, err = run(capsys, "prepare", tmp_path / "g.fa.xz", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "g.fa.xz", "xz-compressed", out=tmp_path / "s")


def test_truncated_gzip(tmp_path, capsys, umaydis):
    data = umaydis.read_bytes()
    (tmp_path / "t.fa.gz").write_bytes(data[: len(data) // 2])
    code, err = run(capsys, "prepare", tmp_path / "t.fa.gz", "--out", tmp_path / "s", "--quiet")
    assert_clean_failure(code, err, tmp_path, "t.fa.gz", "truncated", "in record 'chr", out=tmp_path / "s")


def test_corrupt_gzip(tmp_path, capsys, umaydis):
    data = bytearray(umaydis.read_bytes()[:3_000_000])
    data[200_000:200_100] = b"x" * 100
    (tmp_path / "c.fa.gz").write_bytes(bytes(data))
    code, err = run(capsys, "prepare", tmp_path / "c.fa.gz", "--out", tmp_path / "s", "--quiet")
    assert_clean_failure(code, err, tmp_path, "c.fa.gz", "corrupt", out=tmp_path / "s")


def test_duplicate_record_names(tmp_path, capsys):
    (tmp_path / "d.fa").write_text(">chr1\nACGT\n>chr2\nAC\n>chr1 again\nGG\n")
    code, err = run(capsys, "prepare", tmp_path / "d.fa", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "d.fa", "record 'chr1'", "duplicate", "1 and 3",
                         out=tmp_path / "s")


def test_invalid_character(tmp_path, capsys):
    (tmp_path / "i.fa").write_text(">chr1\nACGT\n>chr2\nAC\nGE\n")
    code, err = run(capsys, "prepare", tmp_path / "i.fa", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "i.fa", "record 'chr2'", "'E' at base 4",
                         out=tmp_path / "s")


def test_missing_chromosome_suggests_alias(tmp_path, capsys):
    (tmp_path / "g.fa").write_text(">1\nACGT\n>2\nAC\n>22\nGG\n")
    code, err = run(capsys, "prepare", tmp_path / "g.fa", "--out", tmp_path / "s", "--chroms", "chr3")
    assert_clean_failure(code, err, tmp_path, "g.fa", "no record named 'chr3'", "have: 1, 2, 22",
                         out=tmp_path / "s")


def test_out_is_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "g.fa").write_text(">a\nACGT\n")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    code, err = run(capsys, "prepare", tmp_path / "g.fa", "--out", tmp_path / "home")
    assert_clean_failure(code, err, tmp_path, "home", "holds no megabase store")
    assert (tmp_path / "home" / "thesis.tex").read_text() == "precious"


@pytest.fixture
def small_store(tmp_path):
    from megabase.data import prepare

    (tmp_path / "g.fa").write_text(">chr1\n" + "ACGT" * 250 + "\n>chr2\n" + "N" * 900 + "AC" * 50 + "\n")
    prepare(tmp_path / "g.fa", tmp_path / "store", progress=False)
    return tmp_path / "store"


def test_sequence_shorter_than_one_window(small_store, tmp_path, capsys):
    code, err = run(capsys, "windows", small_store, "--length", "5000", "--split", "eval=chr1",
                    "--short", "refuse", "--out", tmp_path / "w.bed")
    assert_clean_failure(code, err, tmp_path, "store", "record 'chr1'", "shorter than one window",
                         out=tmp_path / "w.bed")


def test_windows_unknown_record(small_store, tmp_path, capsys):
    code, err = run(capsys, "windows", small_store, "--length", "100", "--split", "train=1,chr7",
                    "--out", tmp_path / "w.bed")
    assert_clean_failure(code, err, tmp_path, "no record named 'chr7'", out=tmp_path / "w.bed")


def test_windows_region_past_end(small_store, tmp_path, capsys):
    code, err = run(capsys, "windows", small_store, "--length", "100", "--split",
                    "eval=chr1:1-2,000", "--out", tmp_path / "w.bed")
    assert_clean_failure(code, err, tmp_path, "record 'chr1'", "past the record's end",
                         out=tmp_path / "w.bed")


def test_windows_bad_region_syntax(small_store, tmp_path, capsys):
    code, err = run(capsys, "windows", small_store, "--length", "100", "--split",
                    "eval=chr1:abc", "--out", tmp_path / "w.bed")
    assert_clean_failure(code, err, tmp_path, "bad region 'chr1:abc'", out=tmp_path / "w.bed")


def test_windows_overlapping_splits(small_store, tmp_path, capsys):
    code, err = run(capsys, "windows", small_store, "--length", "100", "--split",
                    "train=chr1:1-600", "--split", "eval=chr1:501-1000", "--out", tmp_path / "w.bed")
    assert_clean_failure(code, err, tmp_path, "splits overlap", out=tmp_path / "w.bed")


def test_windows_all_dropped_for_n(small_store, tmp_path, capsys):
    code, err = run(capsys, "windows", small_store, "--length", "100", "--split",
                    "eval=chr2:1-900", "--out", tmp_path / "w.bed")
    assert_clean_failure(code, err, tmp_path, "every window was dropped", out=tmp_path / "w.bed")


def test_windows_missing_store(tmp_path, capsys):
    code, err = run(capsys, "windows", tmp_path / "nostore", "--length", "100", "--split", "a=chr1")
    assert_clean_failure(code, err, tmp_path, "nostore", "no token store here")


def test_bad_option_value_is_one_clear_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["windows", str(tmp_path), "--length", "-5", "--split", "a=chr1"])
    assert exc.value.code == 2
    assert "--length: must be positive, got -5" in capsys.readouterr().err


def test_bad_bed(tmp_path):
    from megabase.data import InputError, read_bed

    (tmp_path / "w.bed").write_text("chr1\t10\t5\ttrain\n")
    with pytest.raises(InputError, match=r"w\.bed: line 1: need 0 <= start < end"):
        read_bed(tmp_path / "w.bed")
    (tmp_path / "w.bed").write_text("#c\tS\tE\nchr1 10 20\n")
    with pytest.raises(InputError, match=r"line 2: expected CHROM"):
        read_bed(tmp_path / "w.bed")


def test_ctrl_c_leaves_nothing(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import numpy as np

    rng = np.random.default_rng(0)
    fasta = tmp_path / "big.fa"
    with open(fasta, "wb") as fh:
        seq = np.frombuffer(b"ACGTacgtN", np.uint8)[rng.integers(0, 9, 40_000_000)].tobytes()
        for i in range(4):
            fh.write(f">chr{i}\n".encode() + seq + b"\n")
    exe = Path(sys.executable).parent / "megabase"
    # a runner started in the background (`cmd &`) ignores SIGINT and its children inherit that
    proc = subprocess.Popen([str(exe), "prepare", str(fasta), "--out", str(tmp_path / "store")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".store.tmp-*/records/*")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["megabase prepare: interrupted; nothing half-written was kept"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.fa"]


def test_a_record_name_too_long_for_a_file_name_is_kept_whole(tmp_path, capsys):
    from megabase.data import TokenStore

    name = "contig_" + "x" * 300
    (tmp_path / "long.fa").write_text(f">{name}\n{'ACGT' * 50}\n>b\nACGT\n")
    code, err = run(capsys, "prepare", tmp_path / "long.fa", "--out", tmp_path / "s")
    assert code == 0, err
    store = TokenStore(tmp_path / "s")
    assert name in store.names and len(store.tokens(name)) == 200


def test_a_file_size_limit_during_prepare_is_one_line_and_leaves_nothing(tmp_path):
    import resource
    import subprocess
    import sys

    (tmp_path / "big.fa").write_text(">a\n" + "ACGT" * 200_000 + "\n")
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # noqa: E731
    proc = subprocess.run([sys.executable, "-m", "megabase.pipeline.cli", "prepare",
                           str(tmp_path / "big.fa"), "--out", str(tmp_path / "s")],
                          capture_output=True, text=True, preexec_fn=limit)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "File too large" in err and "a.tokens.npy: File too large" in err  # names the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.fa"]


def test_a_write_error_without_a_file_name_gets_the_one_being_written(tmp_path):
    import errno

    from megabase.core.atomic import writing

    target = tmp_path / "report.json"
    with pytest.raises(OSError) as exc:
        with writing(target):
            raise OSError(errno.ENOSPC, "No space left on device")  # what a full disk raises
    assert exc.value.filename == str(target) and list(tmp_path.iterdir()) == []


def test_prepare_replaces_only_what_megabase_wrote(tmp_path, capsys, umaydis):
    foreign = tmp_path / "web"
    (foreign / "src").mkdir(parents=True)
    (foreign / "manifest.json").write_text('{"name": "x"}')
    (foreign / "thesis.txt").write_text("keep")
    code, err = run(capsys, "prepare", umaydis, "--out", foreign, "--chroms", "chr22")
    assert code == 2 and "did not write" in err and len(err.splitlines()) == 1
    assert (foreign / "thesis.txt").read_text() == "keep" and (foreign / "src").is_dir()

    store = tmp_path / "store"
    assert run(capsys, "prepare", umaydis, "--out", store, "--chroms", "chr22")[0] == 0
    (store / "notes.txt").write_text("mine")
    (store / "windows.bed").write_text("chr22\t0\t10\n")
    old_files = sorted(p.name for p in (store / "records").iterdir())
    code, err = run(capsys, "prepare", umaydis, "--out", store, "--chroms", "chr01")
    assert code == 0, err
    assert (store / "notes.txt").read_text() == "mine" and (store / "windows.bed").is_file()
    new_files = sorted(p.name for p in (store / "records").iterdir())
    assert new_files != old_files and all("chr01" in n for n in new_files)


def test_sigterm_during_prepare_cleans_up_and_stale_temps_are_removed(tmp_path, umaydis):
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "megabase.pipeline.cli", "prepare", str(umaydis), "--out",
           str(tmp_path / "s")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not list(tmp_path.glob(".s.tmp-*")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 130, proc.stderr.read()[-2000:]
    assert list(tmp_path.iterdir()) == []

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    dead, alive, other = (tmp_path / f".s.tmp-{gone}-x", tmp_path / f".s.tmp-{os.getpid()}-y",
                          tmp_path / f".t.tmp-{gone}-z")
    for d in (dead, alive, other):
        d.mkdir()
    (tmp_path / "x.fa").write_text(">a\nACGT\n")
    assert subprocess.run([*cmd[:4], str(tmp_path / "x.fa"), "--out", str(tmp_path / "s")],
                          capture_output=True).returncode == 0
    assert not dead.exists() and alive.is_dir() and other.is_dir()


def test_cr_only_line_ends_read_as_lines(tmp_path, capsys):
    from megabase.data import TokenStore

    (tmp_path / "mac.fa").write_bytes(b">a first\rACGT\rAC\r>b\rGGGG\r")
    code, err = run(capsys, "prepare", tmp_path / "mac.fa", "--out", tmp_path / "s")
    assert code == 0, err
    store = TokenStore(tmp_path / "s")
    assert store.names == ["a", "b"] and len(store.tokens("a")) == 6 and len(store.tokens("b")) == 4


def test_a_pipe_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    fasta = b">a\n" + b"ACGT" * 2000 + b"\n"
    proc = subprocess.run(f"cat | {sys.executable} -m megabase.pipeline.cli prepare /dev/stdin "
                          f"--out {tmp_path / 's'}", shell=True, input=fasta, capture_output=True)
    err = proc.stderr.decode().strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "not a regular file" in err
    assert not (tmp_path / "s").exists()


def test_records_without_bases(tmp_path, capsys):
    (tmp_path / "none.fa").write_text(">a\n>b\n")
    code, err = run(capsys, "prepare", tmp_path / "none.fa", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, "none.fa", "hold no bases", out=tmp_path / "s")
    (tmp_path / "some.fa").write_text(">a\n>b\n" + "ACGT" * 1000 + "\n")
    code, err = run(capsys, "prepare", tmp_path / "some.fa", "--out", tmp_path / "s")
    assert code == 0 and "record 'a' holds no bases; windows leave it out" in err
    code, err = run(capsys, "windows", tmp_path / "s", "--length", "1000", "--out",
                    tmp_path / "w.bed", "--split", "train=a,b")
    assert code == 0, err
    assert all(line.startswith("b\t") for line in (tmp_path / "w.bed").read_text().splitlines()
               if not line.startswith("#"))
    code, err = run(capsys, "windows", tmp_path / "s", "--length", "1000", "--out",
                    tmp_path / "w2.bed", "--split", "train=a")
    assert code == 2 and "hold no bases" in err and "max-n-frac" not in err


def test_files_megabase_writes_follow_the_umask(tmp_path):
    import os

    from megabase.core.atomic import write_atomic

    old = os.umask(0o022)
    try:
        assert write_atomic(tmp_path / "a.txt", b"x").stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        assert write_atomic(tmp_path / "b.txt", b"x").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


@pytest.mark.parametrize("header, needle", [
    ("> desc only", "record 1 has an empty name (header '> desc only')"),
    (">chr\x1b[31mred", "name holds a control character ('chr\\x1b[31mred')"),
])
def test_headers_without_a_clean_name(tmp_path, capsys, header, needle):
    (tmp_path / "h.fa").write_text(f"{header}\nACGT\n")
    code, err = run(capsys, "prepare", tmp_path / "h.fa", "--out", tmp_path / "s")
    assert_clean_failure(code, err, tmp_path, needle, out=tmp_path / "s")
    assert "\x1b" not in err
