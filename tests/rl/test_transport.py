"""The trainer and the generator as two gloo ranks: what crosses, in what order, and what happens
when one side stops or fails."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megabase.data import InputError
from megabase.rl.generator import WeightChannel, flat_parameters, generator_model
from megabase.rl.remote import RemoteWeights, Stopped
from megabase.rl.transport import (BATCH, GONE, STOP, WEIGHTS, Link, connect,
                                   disconnect, free_port)

ROOT = Path(__file__).resolve().parents[2]


def test_published_weights_reach_the_generator_only_through_take(policy):
    """The generator's weights change between decoding steps, when it takes them, never under it
    (the shared-memory channel this replaced aliased them: a publish rewrote the weights of a
    batch being decoded while its bases kept the old version's tag)."""
    import copy

    from megabase.rl.config import RLConfig

    trainer = copy.deepcopy(policy)
    channel = WeightChannel(trainer)
    gen = generator_model(copy.deepcopy(trainer), RLConfig(checkpoint="-"))
    assert channel.take(gen, 0) is None
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    channel.publish(trainer, 1)
    assert torch.equal(flat_parameters(gen), flat_parameters(policy))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)  # the trainer moves on: what was published stays as it was
    assert channel.take(gen, 0) == 1
    assert torch.allclose(flat_parameters(gen), flat_parameters(policy) + 0.01)
    assert channel.take(gen, 1) is None


def _trainer_side(address: str, numel: int) -> None:
    connect(0, address)
    link = Link(peer=1)
    for version in (1, 2):
        link.send(WEIGHTS, version, 0, torch.full((numel,), float(version)))
    kind, a, _, groups = link.get()
    link.send_object(BATCH, {"echo": groups, "at": a}, a)  # an object back, as a batch goes
    link.send(STOP)
    link.settle()
    link.join(30)
    disconnect()


def test_weights_and_objects_cross_in_order_and_stop_ends_the_generator():
    address = f"tcp://127.0.0.1:{free_port()}"
    numel = 1000
    peer = mp.get_context("spawn").Process(target=_trainer_side, args=(address, numel))
    peer.start()
    try:
        connect(1, address)
        link = Link(peer=0)
        weights = RemoteWeights(link)
        weights.wait(2)  # blocks until version 2 is here
        model = torch.nn.Linear(10, 100, bias=False)  # 1,000 parameters
        assert weights.take(model, 0) == 2  # the newest; version 1 was never applied
        assert torch.equal(flat_parameters(model), torch.full((numel,), 2.0))
        assert weights.take(model, 2) is None
        link.send_object(BATCH, [1, "two", torch.arange(3)], 7)
        kind, a, _, echo = link.get(timeout=60)
        assert kind == BATCH and a == 7 and echo["echo"][1] == "two"
        assert torch.equal(echo["echo"][2], torch.arange(3))
        with pytest.raises(Stopped):
            while True:
                weights.take(model, 2)
    finally:
        link.settle()
        disconnect()
        peer.join(60)
    assert peer.exitcode == 0


def _dies(address: str) -> None:
    connect(0, address)
    Link(peer=1)
    os._exit(3)


def test_a_rank_that_dies_reaches_the_other_as_gone():
    address = f"tcp://127.0.0.1:{free_port()}"
    peer = mp.get_context("spawn").Process(target=_dies, args=(address,))
    peer.start()
    connect(1, address)
    link = Link(peer=0)
    try:
        item = link.get(timeout=120)
        assert item is not None and item[0] == GONE
        with pytest.raises(Stopped):
            RemoteWeights(link)._handle(item)
    finally:
        disconnect()
        peer.join(30)


def _write_failing_reward(tmp_path: Path, after: int, how: str) -> str:
    path = tmp_path / f"fails_{how}.py"
    path.write_text(
        "import os\ncalls = 0\n\n\ndef reward(seqs):\n    global calls\n    calls += 1\n"
        f"    if calls > {after}:\n"
        + ("        os._exit(9)\n" if how == "dies" else "        raise ValueError('no more')\n")
        + "    return [s.count('G') / len(s) for s in seqs]\n")
    return f"{path}:reward"


@pytest.mark.parametrize("how, code, message", [
    ("raises", 2, "reward.function '{spec}' raised ValueError: no more"),
    ("dies", 3, "the generator's rank stopped before the trainer"),
])
def test_a_generator_that_fails_mid_run_is_one_line(config, capsys, tmp_path, how, code, message):
    """The trainer's process is fine; its generator fails on its second batch (the probe before
    the generator starts is the trainer's own call)."""
    from mlflow.tracking import MlflowClient

    from megabase.pipeline.cli import main

    spec = _write_failing_reward(tmp_path, after=1, how=how)
    path = config(f"fails-{how}.yaml", out=f"fails-{how}", steps=4,
                  **{"reward.function": spec, "asynchronous": True})
    assert main(["rl", "--config", str(path), "--quiet"]) == code
    err = capsys.readouterr().err.strip()
    assert message.format(spec=spec) in err and len(err.splitlines()) == 1, err
    out = path.parent / f"fails-{how}"
    assert not (out / "checkpoint").exists()
    client = MlflowClient(f"sqlite:///{path.parent / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("megabase-rl").experiment_id],
                              f"params.`rl.out` = '{out}'")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_two_launched_ranks_train_and_generate(config, tmp_path):
    """``torchrun --nproc-per-node 2``: rank 0 trains, rank 1 generates, as two nodes would."""
    path = config("launched.yaml", out="launched", steps=2, asynchronous=True, threads=1)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "megabase.pipeline.cli", "rl",
                           "--config", str(path), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("rl: 2 steps") == 1  # the trainer's summary, once
    assert (path.parent / "launched" / "checkpoint").is_dir()


def test_synchronous_under_a_launcher_is_refused(config, monkeypatch):
    from megabase.rl import load_rl_config, rl

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_rl_config(config("sync-launched.yaml", asynchronous=False))
    with pytest.raises(InputError, match="without torchrun"):
        rl(cfg, progress=False)


def test_the_trainer_stops_waiting_for_a_generator_that_never_joins(tmp_path):
    """A generator process that dies before it joins ends the trainer's wait (a subprocess: the
    waiting thread stays blocked in the rendezvous until its process exits)."""
    code = ("from megabase.rl.transport import PeerGone, connect, free_port\n"
            "try:\n    connect(0, f'tcp://127.0.0.1:{free_port()}', alive=lambda: False)\n"
            "except PeerGone as exc:\n    print('gone:', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert "gone: the generator's process ended before it joined" in done.stdout, done.stderr


def test_a_batch_starts_with_weights_at_most_async_level_versions_old(config):
    """async_level 1: batches 0 and 1 may start on the checkpoint's weights (version 0), batch 2
    waits for version 1, however many batches the trainer has taken (waiting only for the trainer
    to take batches let a slow trainer receive groups two versions old)."""
    import time

    from megabase.infer.common import load_model
    from megabase.rl import load_rl_config
    from megabase.rl.remote import AsyncGenerator

    cfg = load_rl_config(config("flow.yaml", asynchronous=True, threads=1))
    source = AsyncGenerator(cfg, cfg.checkpoint)
    try:
        source.next(), source.next()
        time.sleep(3.0)
        source.counts()
        assert source.started == 2  # batch 2 waits
        source.publish(load_model(cfg.checkpoint), 1)
        deadline = time.monotonic() + 120
        while source.started < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            source.counts()
        assert source.started == 3
        groups = source.next()
        time.sleep(3.0)
        source.counts()
        assert source.started == 3 and int(groups[0].versions.min()) == 1
    finally:
        source.close()
