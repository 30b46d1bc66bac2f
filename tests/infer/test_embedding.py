import numpy as np
import pytest
import torch

from megabase.core.vocab import SEP
from megabase.infer import embed, embed_tokens
from megabase.model import load_checkpoint
from megabase.pipeline.cli import main


def _full_pass_hidden(model, tokens, layer):
    captured = []
    handle = model.blocks[layer - 1].register_forward_hook(lambda m, a, out: captured.append(out[0]))
    seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
    with torch.no_grad():
        model(seq)
    handle.remove()
    return captured[0][0, 1:].numpy()


@pytest.mark.parametrize("layer", [2, None])
def test_streamed_embeddings_equal_the_full_pass(checkpoint, bundled_store, layer):
    model = load_checkpoint(checkpoint).eval()
    tokens = np.asarray(bundled_store.tokens("chr22")[70_000:73_333])
    full = _full_pass_hidden(model, tokens, layer or len(model.blocks))
    per_base = embed_tokens(model, tokens, layer, per_base=True, segment=1_000)
    assert per_base.shape == full.shape
    rel = np.linalg.norm(per_base - full) / np.linalg.norm(full)
    assert rel <= 1e-5
    pooled = embed_tokens(model, tokens, layer, segment=1_500)
    assert np.linalg.norm(pooled - full.mean(0)) / np.linalg.norm(full.mean(0)) <= 1e-5


def test_cli_writes_a_dataset_and_npy_from_a_bed(checkpoint, bundled_store, tmp_path, capsys):
    import datasets

    bed = tmp_path / "w.bed"
    bed.write_text("chr22\t0\t1500\teval\n22\t5000\t6000\teval\nchr01\t0\t800\ttrain\n")
    out = tmp_path / "emb"
    assert main(["embed", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--windows", str(bed), "--split", "eval", "--layer", "3", "--out", str(out),
                 "--quiet"]) == 0
    assert "embedded" in capsys.readouterr().out
    array = np.load(out / "embeddings.npy")
    ds = datasets.load_from_disk(str(out / "embeddings.dataset"))
    assert array.shape == (2, 32) and len(ds) == 2 and ds[1]["start"] == 5000
    assert np.allclose(np.array(ds[0]["embedding"]), array[0])
    model = load_checkpoint(checkpoint).eval()
    tokens = np.asarray(bundled_store.tokens("chr22")[5000:6000])
    assert np.allclose(array[1], embed_tokens(model, tokens, 3), rtol=1e-5, atol=1e-6)
    # per base: one row per base, the dataset row points into the array
    assert main(["embed", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-300,chr01:11-20", "--per-base", "--out", str(out),
                 "--quiet"]) == 0
    array = np.load(out / "embeddings.npy")
    ds = datasets.load_from_disk(str(out / "embeddings.dataset"))
    assert array.shape == (310, 32) and ds[1]["row"] == 300
    assert np.allclose(np.array(ds[1]["embedding"]), array[300:])


def test_a_folder_named_like_the_dataset_is_not_replaced(checkpoint, bundled_store, tmp_path):
    from megabase.data import InputError

    (tmp_path / "embeddings.dataset").mkdir()
    (tmp_path / "embeddings.dataset" / "mine.txt").write_text("x")
    with pytest.raises(InputError, match="not a saved dataset"):
        embed(checkpoint, bundled_store.path, regions=["chr22:1-100"], out=tmp_path)
    with pytest.raises(InputError, match="layer must be 1..4"):
        embed(checkpoint, bundled_store.path, regions=["chr22:1-100"], layer=9)
    assert (tmp_path / "embeddings.dataset" / "mine.txt").exists()


def test_a_full_disk_while_writing_the_dataset_is_one_line_and_keeps_the_earlier_pair(
        checkpoint, bundled_store, tmp_path):
    """The array fits under the file-size limit, the dataset's cache does not: one line naming
    the dataset (not datasets' DatasetGenerationError traceback), and the earlier run's array
    and dataset stay together (this run's array is not renamed in beside them)."""
    import resource
    import subprocess
    import sys

    out = tmp_path / "emb"
    args = [sys.executable, "-m", "megabase.pipeline.cli", "embed", "--checkpoint", str(checkpoint),
            "--data", str(bundled_store.path), "--per-base", "--out", str(out), "--quiet"]
    assert subprocess.run([*args, "--regions", "chr22:1-100"], capture_output=True).returncode == 0
    earlier = np.load(out / "embeddings.npy")
    # 3,000 bases x 32 floats: a 384 kB array, and as much again for the dataset's cache
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (390_000, 390_000))  # noqa: E731
    proc = subprocess.run([*args, "--regions", "chr22:1-3,000"], capture_output=True, text=True,
                          preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()  # --quiet silences datasets' progress bars too
    assert err == f"megabase embed: error: {out / 'embeddings.dataset'}: File too large", err
    assert sorted(p.name for p in out.iterdir()) == ["embeddings.dataset", "embeddings.npy"]
    assert np.array_equal(np.load(out / "embeddings.npy"), earlier)
