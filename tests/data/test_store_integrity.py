"""A token store changed after ``prepare`` is never read as if it were the genome: every stage
refuses it in one line naming the record, and ``prepare`` rebuilds it (real U. maydis store)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from megabase.data import TokenStore, prepare
from megabase.core.errors import InputError
from megabase.pipeline.cli import main


@pytest.fixture
def store_copy(umaydis_store, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(umaydis_store.path, out)
    return out


def _first_record(out):
    rec = json.loads((out / "manifest.json").read_text())["records"][0]
    return rec, out / rec["tokens"], out / rec["mask"]


def _poke(path, offset: int, value: int) -> None:
    """Overwrite one byte of an .npy's data, keeping its size (and a valid value)."""
    header = np.load(path, mmap_mode="r").offset
    with open(path, "r+b") as fh:
        fh.seek(header + offset)
        fh.write(bytes([value]))


@pytest.mark.parametrize("kind, value", [("tokens", None), ("tokens", 200), ("mask", None)])
def test_a_changed_byte_is_refused_in_one_line_and_prepare_rebuilds(store_copy, umaydis, kind,
                                                                     value, capsys):
    rec, tokens, mask = _first_record(store_copy)
    path = tokens if kind == "tokens" else mask
    before = np.load(path)
    offset = 1000
    new = value if value is not None else (int(before[offset]) + 1) % (4 if kind == "tokens" else 2)
    _poke(path, offset, new)
    assert path.stat().st_size == (tokens if kind == "tokens" else mask).stat().st_size

    store = TokenStore(store_copy)
    with pytest.raises(InputError) as exc:
        store.tokens(rec["name"]) if kind == "tokens" else store.mask(rec["name"])
    message = str(exc.value)
    assert f"record {rec['name']!r}" in message and rec[kind] in message
    assert "megabase prepare" in message and "\n" not in message

    if kind == "tokens":  # `windows` reads tokens only (their N content)
        code = main(["windows", str(store_copy), "--length", "4096", "--split",
                     f"train={rec['name']}", "--out", str(store_copy.parent / "w.bed")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and f"record {rec['name']!r}: {rec[kind]}" in err[0]
        assert not (store_copy.parent / "w.bed").exists()

    again = prepare(umaydis, store_copy, progress=False)
    assert not again.skipped and "rebuilding" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(path), before)
    TokenStore(store_copy).verify()
    assert prepare(umaydis, store_copy, progress=False).skipped


def test_the_manifest_records_both_checksums(umaydis_store):
    for rec in umaydis_store.manifest["records"]:
        assert len(rec["tokens_sha256"]) == len(rec["mask_sha256"]) == 64
    umaydis_store.verify()


def test_a_second_prepare_waits_for_the_first_and_finds_its_store(umaydis, tmp_path, capsys):
    import subprocess
    import sys
    import time

    from megabase.core.locks import lock_path

    out = tmp_path / "store"
    first = subprocess.Popen([sys.executable, "-m", "megabase.pipeline.cli", "prepare",
                              str(umaydis), "--out", str(out), "--quiet"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lock = lock_path(out)
    while first.poll() is None and not (lock.is_file() and lock.read_text().startswith(
            str(first.pid))):
        time.sleep(0.005)
    second = prepare(umaydis, out, progress=False)
    assert first.wait() == 0, first.stderr.read().decode()[-2000:]
    assert second.skipped  # it waited, then found the first one's store up to date
    TokenStore(out).verify()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # the lock file went too
