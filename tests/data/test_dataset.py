import numpy as np
import pytest
import torch

from megabase.data import (
    PAD, SEP, ResumableSampler, WindowDataset, make_windows, reverse_complement, to_hf_dataset,
)


@pytest.fixture(scope="module")
def hsap_windows(hsap_store):
    windows, _ = make_windows(hsap_store, {"eval": ["chr22:30,000,001-31,000,000"]}, 65_536)
    return windows


def test_item_is_shifted_targets_with_masks(hsap_store, hsap_windows):
    ds = WindowDataset(hsap_store, hsap_windows)
    item = ds[3]
    w = hsap_windows[3]
    tokens = torch.from_numpy(np.array(hsap_store.tokens("chr22")[w.start : w.end]))
    assert item["input_ids"].dtype == torch.uint8 and item["input_ids"].shape == (65_536,)
    assert item["input_ids"][0] == SEP
    assert torch.equal(item["input_ids"][1:], tokens[:-1])
    assert torch.equal(item["targets"], tokens)
    assert torch.equal(item["loss_mask"], tokens < 4)
    assert 0 < int((~item["loss_mask"]).sum()) < 65_536  # this stretch has real N runs
    mask = torch.from_numpy(np.array(hsap_store.mask("chr22")[w.start : w.end]))
    assert torch.equal(item["repeat_mask"], mask) and mask.any()


def test_short_windows_are_padded_and_never_scored(hsap_store, hsap_windows):
    ds = WindowDataset(hsap_store, hsap_windows)
    last = ds[len(ds) - 1]
    n = hsap_windows[-1].length
    assert n < 65_536
    assert (last["targets"][n:] == PAD).all() and not last["loss_mask"][n:].any()
    assert (last["input_ids"][n + 1 :] == PAD).all()
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["input_ids"].shape == (4, 65_536)


def test_reverse_complement_augmentation_is_exact(hsap_store, hsap_windows):
    plain = WindowDataset(hsap_store, hsap_windows)
    rc = WindowDataset(hsap_store, hsap_windows, rc_prob=1.0)
    for i in range(len(plain)):
        a, b = plain[i], rc[i]
        n = hsap_windows[i].length
        assert b["rc"]
        assert torch.equal(reverse_complement(b["targets"][:n]), a["targets"][:n])
        assert torch.equal(b["repeat_mask"][:n].flip(0), a["repeat_mask"][:n])
        assert b["input_ids"][0] == SEP and torch.equal(b["input_ids"][1:n], b["targets"][: n - 1])
    half = WindowDataset(hsap_store, hsap_windows, rc_prob=0.5, seed=1)
    flags = [half[i]["rc"] for i in range(len(half))]
    assert flags == [half[i]["rc"] for i in range(len(half))]
    epoch2 = [half[i + len(half)]["rc"] for i in range(len(half))]
    assert flags != epoch2 and 0 < sum(flags) < len(flags)


def test_sampler_resumes_mid_epoch():
    full = ResumableSampler(10, seed=3)
    seq = [i for _, i in zip(range(27), iter(_forever(full)))]
    part = ResumableSampler(10, seed=3)
    first = [i for _, i in zip(range(13), iter(_forever(part)))]
    state = part.state_dict()
    resumed = ResumableSampler(10, seed=3)
    resumed.load_state_dict(state)
    rest = [i for _, i in zip(range(14), iter(_forever(resumed)))]
    assert first + rest == seq
    assert sorted(i % 10 for i in seq[:10]) == list(range(10))
    assert seq[:10] != list(range(10))


def _forever(sampler):
    while True:
        yield from sampler


def test_dataloader_with_workers_is_reproducible(bundled_store):
    windows, _ = make_windows(bundled_store, {"train": ["chr01"]}, 200_000)
    ds = WindowDataset(bundled_store, windows, rc_prob=0.5, seed=7)

    def run(workers):
        loader = torch.utils.data.DataLoader(
            ds, batch_size=2, sampler=ResumableSampler(len(ds), seed=7), num_workers=workers)
        return [(b["index"].tolist(), b["rc"].tolist(), int(b["targets"].sum())) for b in loader]

    assert run(0) == run(2)


def test_hf_export(bundled_store, tmp_path):
    windows, _ = make_windows(bundled_store, {"eval": ["chr22"]}, 100_000)
    ds = to_hf_dataset(bundled_store, windows, cache_dir=tmp_path / "cache")
    assert len(ds) == 5 and ds.column_names[:4] == ["chrom", "start", "end", "split"]
    row = ds[2]
    tokens, mask = bundled_store.fetch("chr22", row["start"], row["end"])
    assert row["tokens"] == tokens.tolist() and row["repeat_mask"] == mask.tolist()
    ds.save_to_disk(tmp_path / "hf")
