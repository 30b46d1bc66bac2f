"""Shared fixtures: the real genomes of ../shared/genomes and token stores built from them once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENOMES = Path(os.environ.get("MEGABASE_GENOMES", ROOT.parent / "shared" / "genomes"))
UMAYDIS = GENOMES / "umaydis.fa.gz"
HSAP = GENOMES / "hsap_chr22_subset.fa.gz"


def _genome(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"real genome {path} is not here (set MEGABASE_GENOMES)")
    return path


@pytest.fixture(scope="session")
def umaydis() -> Path:
    return _genome(UMAYDIS)


@pytest.fixture(scope="session")
def hsap() -> Path:
    return _genome(HSAP)


@pytest.fixture(scope="session")
def umaydis_store(umaydis, tmp_path_factory):
    from megabase.data import TokenStore, prepare

    out = tmp_path_factory.mktemp("stores") / "umaydis"
    prepare(umaydis, out, progress=False)
    return TokenStore(out)


@pytest.fixture(scope="session")
def hsap_store(hsap, tmp_path_factory):
    from megabase.data import TokenStore, prepare

    out = tmp_path_factory.mktemp("stores") / "hsap"
    prepare(hsap, out, progress=False)
    return TokenStore(out)


@pytest.fixture(scope="session")
def bundled_store(tmp_path_factory):
    from megabase.data import TokenStore, default_genome, prepare

    out = tmp_path_factory.mktemp("stores") / "bundled"
    prepare(Path(str(default_genome())), out, progress=False)
    return TokenStore(out)


def pysam_fasta(fasta: Path, workdir: Path):
    """A pysam.FastaFile over ``fasta`` whose index lives in ``workdir`` (shared/ is read-only)."""
    import pysam

    link = workdir / fasta.name
    if not link.exists():
        link.symlink_to(fasta)
    return pysam.FastaFile(str(link))
