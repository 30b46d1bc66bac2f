"""The sequence-length warm-up (megabase.pipeline.warmup): the protocols' schedules, the bounds
that let a long window be reached within the run's steps and minutes, and its checkpointed state."""

import re
from pathlib import Path

from megabase.pipeline.cli import main
from megabase.pipeline.config import load_config
from megabase.pipeline.train import read_train_log
from megabase.pipeline.warmup import LengthWarmup, window_length_at

from tests.pipeline.test_train import tiny

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def walk(warm: LengthWarmup, steps: int, minutes_per_token: float | None = None):
    """Run ``warm`` through ``steps`` steps; with ``minutes_per_token``, a clock that each step
    moves by its length's cost. Returns the length of every step."""
    out, clock = [], 0.0
    for s in range(steps):
        out.append(warm.length)
        if minutes_per_token is not None:
            clock += warm.length * minutes_per_token
        warm.advance(s + 1, clock if minutes_per_token is not None else None)
    return out


def test_the_protocols_keep_their_steps_per_length():
    human = LengthWarmup(load_config(str(CONFIGS / "human-chr22-cpu.yaml"), []))
    walk(human, 800)
    assert human.starts == [0, 150, 300, 450]
    demo = LengthWarmup(load_config(str(CONFIGS / "demo.yaml"), []))
    walk(demo, 128)
    assert demo.starts == [0, 40, 80, 120]


def test_a_million_base_window_is_reached_within_the_first_half_of_the_steps():
    cfg = load_config(str(CONFIGS / "human-chr22-cpu.yaml"), ["data.window_length=1048576",
                                                               "train.max_minutes=null"])
    lengths = walk(LengthWarmup(cfg), 800)  # 9 lengths x 150 steps would be 1,350 steps
    assert lengths[0] == 2048 and lengths.index(1048576) <= 400
    assert lengths.count(1048576) == 800 - lengths.index(1048576)
    assert sorted(set(lengths)) == [2048 * 2 ** k for k in range(10)]  # every length, in order
    assert lengths == sorted(lengths)


def test_under_a_time_cap_each_shorter_length_ends_by_its_share_of_the_minutes():
    """The human protocol at 1,048,576 under its 60 minutes, on a clock of this machine's cost
    (about 1.2 ms a token on 2 cores): the steps reach the window length before the cap."""
    cfg = load_config(str(CONFIGS / "human-chr22-cpu.yaml"), ["data.window_length=1048576"])
    warm = LengthWarmup(cfg)
    clock, step = 0.0, 0
    while clock < 60:
        clock += warm.length * 1.2e-3 / 60
        step += 1
        warm.advance(step, clock)
    assert warm.length == 1048576
    k_full = len(warm.lengths) - 1
    assert len(warm.starts) == k_full + 1 and warm.starts[k_full] < step
    # and a cap no step reaches leaves the step bounds alone
    slow = LengthWarmup(load_config(str(CONFIGS / "human-chr22-cpu.yaml"), []))
    assert walk(slow, 800, minutes_per_token=1e-9).count(2048) == 150


def test_a_resumed_schedule_goes_on_from_its_saved_starts():
    cfg = load_config(str(CONFIGS / "human-chr22-cpu.yaml"), ["data.window_length=1048576"])
    timed = LengthWarmup(cfg)
    walk(timed, 60, minutes_per_token=2e-4)  # a clock that ended lengths early
    replayed = LengthWarmup(cfg)
    replayed.load_state_dict(None, 60)  # a checkpoint without the schedule: steps alone
    assert replayed.starts != timed.starts
    resumed = LengthWarmup(cfg)
    resumed.load_state_dict(timed.state_dict(), 60)
    assert resumed.starts == timed.starts and resumed.length == timed.length
    other = LengthWarmup(load_config(str(CONFIGS / "human-chr22-cpu.yaml"), []))
    other.load_state_dict(timed.state_dict(), 60)  # another window: its own lengths, by steps
    assert other.length == window_length_at(60, load_config(
        str(CONFIGS / "human-chr22-cpu.yaml"), [])) == 2048


def test_a_run_logs_the_length_of_each_step_and_sums_them_up(bundled_store, tmp_path, capsys):
    """Two shorter lengths of 8 steps would fill a 6-step run: they share its first half."""
    args = tiny(tmp_path, bundled_store, 6, **{"train.seq_warmup": "true",
                                                "train.seq_warmup_start": "512",
                                                "train.seq_warmup_steps": "8"})
    assert main(["train", *args]) == 0
    rows = read_train_log(tmp_path / "runs" / "tiny")
    assert [rows[s]["window_length"] for s in sorted(rows)] == [512, 512, 1024, 2048, 2048, 2048]
    out = re.sub(r"[│\s]+", " ", capsys.readouterr().out)  # the table's cells, unwrapped
    assert "2 x 512, 1 x 1,024, 3 x 2,048" in out
    assert re.search(r"peak memory \S+ GiB \(\S+ GiB in the steps of 2,048 tokens\)", out), out


def test_a_short_step_crops_where_the_window_has_bases():
    import torch

    from megabase.pipeline.warmup import crop

    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0] = True                    # all bases: its head
    mask[1, 7:] = True                # an N head: the stretch with the most bases, the first such
    mask[2, 2:4] = True               # a head half bases passes the windows' rule
    ids = torch.arange(36).view(3, 12)
    got_ids, got_targets, got_mask = crop(ids, ids + 100, mask, 4, 0.5)
    assert got_ids.tolist() == [[0, 1, 2, 3], [19, 20, 21, 22], [24, 25, 26, 27]]
    assert got_targets.tolist() == (got_ids + 100).tolist()
    assert got_mask.tolist() == [[True] * 4, [True] * 4, [False, False, True, True]]
    same = crop(ids, ids, mask, 12, 0.5)
    assert same[0] is ids


def test_no_warm_up_step_of_the_human_subset_is_without_bases(hsap_store):
    """Crops of the 1,048,576-base human windows (58% of chr22 is N): every 2,048-token head that
    the windows' rule would refuse moves to bases, so no step is left with nothing to learn."""
    import numpy as np
    import torch

    from megabase.core.vocab import N_BASES
    from megabase.data.windows import make_windows
    from megabase.pipeline.warmup import crop

    windows, _ = make_windows(hsap_store, {"train": ["chr22"]}, 1_048_576, max_n_frac=0.5)
    tokens = hsap_store.tokens("chr22")
    mask = torch.from_numpy(np.stack([tokens[w.start:w.end] < N_BASES for w in windows
                                      if w.length == 1_048_576]))
    ids = torch.zeros(mask.shape, dtype=torch.long)
    heads = mask[:, :2048].float().mean(1)
    assert float(heads.min()) < 0.5  # the defect: some heads are mostly N
    _, _, cropped = crop(ids, ids, mask, 2048, 0.5)
    assert float(cropped.float().mean(1).min()) >= 0.5
    kept = heads >= 0.5  # and a head the rule accepts is left where it is
    assert torch.equal(cropped[kept], mask[kept, :2048])


def test_the_tokens_left_follow_the_schedule():
    """What the training ETA counts: the demo at step 61 has 19 steps at 4,096, 40 at 8,192 and 8
    at 16,384 left, not 67 at 16,384."""
    demo = LengthWarmup(load_config(str(CONFIGS / "demo.yaml"), []))
    walk(demo, 61)
    assert demo.tokens_left(61, 128) == 19 * 4096 + 40 * 8192 + 8 * 16384
    assert demo.starts == [0, 40]  # the estimate leaves the schedule as it was
    assert demo.tokens_left(128, 128) == 0
