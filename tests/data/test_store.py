import json
import os
import shutil
import stat

import numpy as np
import pytest

from megabase.data import InputError, TokenStore, prepare, tokenize
from megabase.data import store as store_mod
from tests.conftest import pysam_fasta


def check_against_pysam(store, fasta, workdir, n_intervals=200, seed=0):
    ref = pysam_fasta(fasta, workdir)
    assert sorted(store.names) == sorted(ref.references)
    rng = np.random.default_rng(seed)
    for name in store.names:
        assert store.length(name) == ref.get_reference_length(name)
    for _ in range(n_intervals):
        name = store.names[rng.integers(len(store.names))]
        length = store.length(name)
        start = int(rng.integers(0, length))
        end = int(min(length, start + rng.integers(1, 20_000)))
        expected = ref.fetch(name, start, end)
        tokens, mask = store.fetch(name, start, end)
        assert np.array_equal(tokens, tokenize(expected)), (name, start, end)
        assert np.array_equal(mask, np.frombuffer(expected.encode(), np.uint8) >= ord("a"))


def test_umaydis_store_equals_pysam(umaydis_store, umaydis, tmp_path):
    assert len(umaydis_store.names) == 36
    assert umaydis_store.length("chr22") == 403_592
    check_against_pysam(umaydis_store, umaydis, tmp_path)


def test_hsap_store_equals_pysam_and_readme_facts(hsap_store, hsap, tmp_path):
    rec = hsap_store.records["chr22"]
    assert rec["length"] == 51_304_566
    assert 0.57 < rec["n_count"] / rec["length"] < 0.59
    real = rec["length"] - rec["n_count"]
    assert 0.45 < rec["softmasked"] / real < 0.47
    assert 0.47 < rec["gc_count"] / real < 0.49
    check_against_pysam(hsap_store, hsap, tmp_path)
    hsap_store.verify()


def test_manifest_contract(umaydis_store, umaydis):
    manifest = json.loads((umaydis_store.path / "manifest.json").read_text())
    assert manifest["vocab"]["symbols"][:5] == ["A", "C", "G", "T", "N"]
    assert manifest["source"]["size"] == umaydis.stat().st_size
    assert len(manifest["source"]["sha256"]) == 64
    for rec in manifest["records"]:
        tokens = np.load(umaydis_store.path / rec["tokens"], mmap_mode="r")
        mask = np.load(umaydis_store.path / rec["mask"], mmap_mode="r")
        assert tokens.dtype == np.uint8 and mask.dtype == bool
        assert tokens.shape == mask.shape == (rec["length"],)
        assert rec["n_count"] == int(np.count_nonzero(tokens == 4))
        assert {"name", "length", "n_count", "softmasked", "tokens_sha256"} <= set(rec)


@pytest.mark.parametrize("kind", ["plain", "gzip", "gzip-members-and-padding"])
def test_source_sha256_is_of_the_file_bytes_from_the_one_read(tmp_path, monkeypatch, kind):
    import gzip
    import hashlib

    text = b">chr1 first\nACGTNacgtn\nAC\n>chr2\nGGGG\n"
    data = {"plain": text, "gzip": gzip.compress(text),
            "gzip-members-and-padding": gzip.compress(text[:15]) + gzip.compress(text[15:])
            + b"\0" * 600}[kind]
    fasta = tmp_path / ("g.fa" if kind == "plain" else "g.fa.gz")
    fasta.write_bytes(data)

    def second_read(path):
        raise AssertionError(f"{path} read a second time for its checksum")

    monkeypatch.setattr(store_mod, "file_sha256", second_read)
    result = prepare(fasta, tmp_path / "s", progress=False)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["source"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert [(r["name"], r["length"], r["n_count"], r["gc_count"], r["softmasked"])
            for r in result.records] == [("chr1", 12, 2, 5, 4), ("chr2", 4, 0, 4, 0)]


def test_a_fasta_that_changes_while_read_leaves_no_store(tmp_path, monkeypatch):
    fasta = tmp_path / "g.fa"
    fasta.write_text(">chr1\nACGT\n>chr2\nGGGG\n")
    read_fasta = store_mod.read_fasta

    def growing(*args, **kwargs):
        for i, rec in enumerate(read_fasta(*args, **kwargs)):
            if i == 0:
                with open(fasta, "a") as fh:  # another program still writing it
                    fh.write(">chr3\nTTTT\n")
            yield rec

    monkeypatch.setattr(store_mod, "read_fasta", growing)
    with pytest.raises(InputError, match="changed while it was being read"):
        prepare(fasta, tmp_path / "s", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa"]


def test_rerun_is_a_no_op_and_source_change_rebuilds(tmp_path):
    fasta = tmp_path / "g.fa"
    fasta.write_text(">chr1\nACGTACGTNN\n>chr2\nacgtAC\n")
    out = tmp_path / "store"
    first = prepare(fasta, out, progress=False)
    assert not first.skipped
    before = (out / "manifest.json").stat().st_mtime_ns
    assert prepare(fasta, out, progress=False).skipped
    assert (out / "manifest.json").stat().st_mtime_ns == before
    os.utime(fasta, ns=(1, 1))  # touched but identical: the checksum says it is the same input
    assert prepare(fasta, out, progress=False).skipped
    fasta.write_text(">chr1\nGGGG\n")
    again = prepare(fasta, out, progress=False)
    assert not again.skipped and TokenStore(out).names == ["chr1"]
    assert not prepare(fasta, out, chroms=["1"], progress=False).skipped  # new selection
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_reads_fasta_on_read_only_storage(tmp_path, umaydis):
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copy(umaydis, ro / "g.fa.gz")
    (ro / "g.fa.gz").chmod(stat.S_IRUSR)
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        result = prepare(ro / "g.fa.gz", tmp_path / "store", chroms=["chr22"], progress=False)
        assert [r["name"] for r in result.records] == ["chr22"]
        assert sorted(p.name for p in ro.iterdir()) == ["g.fa.gz"]
    finally:
        ro.chmod(stat.S_IRWXU)


def test_chroms_accept_aliases(tmp_path):
    fasta = tmp_path / "g.fa"
    fasta.write_text(">1\nAC\n>2\nGG\n>MT\nTT\n>chrX\nAA\n")
    result = prepare(fasta, tmp_path / "s", chroms=["chr1", "chrM", "X"], progress=False)
    assert [r["name"] for r in result.records] == ["1", "MT", "chrX"]
    store = TokenStore(tmp_path / "s")
    assert store.resolve("chr1") == "1" and store.resolve("M") == "MT"


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_failure_mid_write_leaves_nothing_and_keeps_old_store(tmp_path, monkeypatch, exc):
    fasta = tmp_path / "g.fa"
    fasta.write_text(">a\nACGT\n>b\nGGGG\n")
    out = tmp_path / "store"
    prepare(fasta, out, chroms=["a"], progress=False)
    old_manifest = (out / "manifest.json").read_text()
    real = store_mod._RecordFiles.write

    def failing(self, tokens, mask):
        if "/b." in self.tokens:  # the second record
            raise exc("disk full")
        return real(self, tokens, mask)

    monkeypatch.setattr(store_mod._RecordFiles, "write", failing)
    with pytest.raises(exc):
        prepare(fasta, out, progress=False)
    assert (out / "manifest.json").read_text() == old_manifest
    assert TokenStore(out).names == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa", "store"]
    with pytest.raises(exc):
        prepare(fasta, tmp_path / "fresh", progress=False)
    assert not (tmp_path / "fresh").exists()


def test_record_names_become_safe_unique_file_names(tmp_path):
    fasta = tmp_path / "g.fa"
    fasta.write_text(">HLA-A*01:01\nAC\n>HLA-A_01_01\nGG\n>../evil\nTT\n")
    prepare(fasta, tmp_path / "s", progress=False)
    store = TokenStore(tmp_path / "s")
    files = [r["tokens"] for r in store.records.values()]
    assert len(set(files)) == 3 and all(f.startswith("records/") and ".." not in f for f in files)
    assert store.fetch("../evil")[0].tolist() == [3, 3]


def test_store_errors(tmp_path, umaydis_store):
    with pytest.raises(InputError, match="no token store here"):
        TokenStore(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="manifest.json is missing"):
        TokenStore(tmp_path / "empty")
    with pytest.raises(InputError, match=r"no record named 'chr99'.*did you mean"):
        umaydis_store.fetch("chr99", 0, 10)
    with pytest.raises(InputError, match="outside"):
        umaydis_store.fetch("chr22", 0, 10**9)
