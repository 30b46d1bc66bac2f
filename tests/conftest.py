"""Shared fixtures: the real genomes of ../shared/genomes and token stores built from them once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The Triton DSA kernels run under the interpreter where there is no GPU; Triton reads this when it
# is imported, so it is set before any test module imports it.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="session")
def tracked(bundled_store, tmp_path_factory):
    """One SQLite store with an evaluated debug checkpoint and an order-2 Markov baseline."""
    import torch

    from megabase.model import build_model, save_checkpoint
    from megabase.pipeline.cli import main

    root = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    torch.manual_seed(0)
    ckpt = save_checkpoint(build_model("debug"), root / "ckpt", extra={"window_length": 2048})
    common = ["--bootstrap", "20", "--quiet", "--tracking-uri", uri, "--experiment", "tiny"]
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-6,000", "--controls", "500", "--no-probe",
                 "--baselines", "", "--train", "chr01:1-200,000", "--copy-orders", "2,4",
                 "--out", str(root / "model"), *common]) == 0
    assert main(["baseline", "markov", "--data", str(bundled_store.path), "--order", "2",
                 "--train", "chr01", "--eval", "chr22:1-6,000", "--length", "2048",
                 "--out", str(root / "markov"), *common]) == 0
    reports = {n: json.loads((root / n / "report.json").read_text()) for n in ("model", "markov")}
    return {"root": root, "uri": uri, "ckpt": ckpt, "reports": reports}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A debug-preset checkpoint whose outputs depend on the sequence (the zero-started head and
    k-mer tables drawn at random), for the tests of megabase.infer and its notebook."""
    import torch

    from megabase.model import build_model, save_checkpoint

    torch.manual_seed(0)
    model = build_model("debug")
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
        model.kmers.table.normal_(0, 0.3)
    return save_checkpoint(model, tmp_path_factory.mktemp("infer") / "ckpt")
