"""``megabase rl``: asynchronous RL from a checkpoint of ``megabase run``.

Two processes on torch.multiprocessing (spawn): the generator decodes batches of groups and queues
them with their rewards; the trainer takes a batch, drops groups past ``max_off_policy_steps``,
updates, and publishes its weights through shared memory. The generator may run ``async_level``
batches ahead of the batches the trainer consumed (prime-rl's one step ahead by default), and
takes new weights between decoding steps. ``asynchronous: false`` runs both in one process, each
waiting for the other: the baseline the asynchronous run is timed against.
"""

from __future__ import annotations

import json
import math
import os
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megabase.data import InputError
from megabase.data.vocab import SYMBOLS

from .config import RLConfig
from .generator import WeightChannel, generator_model, sample_batch
from .reward import build_reward, diversity, heldout_check
from .rollout import Prompts, Rollout, Staleness
from .trainer import Trainer

LN2 = math.log(2.0)
FILES = ("metrics.jsonl", "summary.json", "samples.fa")


@dataclass
class RLResult:
    out: Path
    steps: int
    seconds: float
    history: list[dict]
    staleness: dict
    checkpoint: Path
    files: dict[str, str] = field(default_factory=dict)
    seconds_to_target: float | None = None
    run_id: str | None = None

    def mean(self, key: str, last: int | None = None, first: int | None = None) -> float:
        rows = self.history[:first] if first else self.history[-last:] if last else self.history
        vals = [r[key] for r in rows if key in r and not math.isnan(r[key])]
        return float(np.mean(vals)) if vals else math.nan


class Scorer:
    """Fills a group's rewards, reward parts and held-out figures (generator side)."""

    def __init__(self, cfg: RLConfig):
        self.reward = build_reward(cfg.reward, cfg.base)
        self.check = heldout_check(cfg.reward)

    def __call__(self, groups: list[Rollout]) -> None:
        for g in groups:
            sample = g.tokens[:, g.prompt_len :].numpy().astype(np.int64)
            g.rewards = torch.as_tensor(self.reward(sample), dtype=torch.float32)
            if hasattr(self.reward, "parts"):
                g.reward_parts = self.reward.parts(sample)
            if self.check is not None:
                g.heldout = {"motif_hits": self.check.parts(sample)["motif_hits"]}


def _threads(cfg: RLConfig) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cfg.threads is not None:
        return cfg.threads
    return max(1, (cores or 1) // (2 if cfg.asynchronous else 1))


def generator_worker(cfg: RLConfig, checkpoint: str, channel: WeightChannel, queue, consumed,
                     inflight, stop) -> None:
    """The generator process: batch after batch until ``stop``, each queued with its rewards."""
    try:
        from megabase.infer.common import load_model

        torch.set_num_threads(_threads(cfg))
        source = SyncGenerator(cfg, load_model(checkpoint), channel, copy=False)
        while not stop.is_set():
            while consumed.value < source.batch - cfg.async_level:
                if stop.is_set():
                    return
                time.sleep(0.002)
            inflight.value = 1
            groups = source.next()
            inflight.value = 0
            queue.put(groups)
    except BaseException as exc:  # the trainer reports it
        line = str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
        queue.put(("error", line, isinstance(exc, InputError), traceback.format_exc()))


class AsyncGenerator:
    """The generator in its own process; :meth:`next` returns the next queued batch."""

    def __init__(self, cfg: RLConfig, checkpoint: str, channel: WeightChannel):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.consumed, self.inflight = ctx.Value("q", 0), ctx.Value("q", 0)
        self.stop = ctx.Event()
        self.proc = ctx.Process(target=generator_worker, daemon=True,
                                args=(cfg, checkpoint, channel, self.queue, self.consumed,
                                      self.inflight, self.stop))
        self.proc.start()

    def next(self) -> list[Rollout]:
        while True:
            try:
                item = self.queue.get(timeout=1.0)
                break
            except queue_mod.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError("the generator process died without a word") from None
        if isinstance(item, tuple) and item and item[0] == "error":
            _, line, is_input, trace = item
            if is_input:
                raise InputError(line)
            raise RuntimeError(f"the generator failed: {line}\n{trace}")
        self.consumed.value += 1
        return item

    def counts(self) -> dict[str, float]:
        return {"in_flight": float(self.inflight.value),
                "in_queue": float(max(self.queue.qsize(), 0)) if hasattr(self.queue, "qsize") else math.nan}

    def close(self) -> None:
        self.stop.set()
        self.consumed.value += 10**9  # release a generator waiting for the trainer
        deadline = time.monotonic() + 60
        while self.proc.is_alive() and time.monotonic() < deadline:
            try:  # a batch it is still putting must be read for it to exit
                while True:
                    self.queue.get_nowait()
            except (queue_mod.Empty, OSError, ValueError):
                pass
            self.proc.join(timeout=0.5)
        if self.proc.is_alive():
            self.proc.kill()


class SyncGenerator:
    """Batches decoded in this process: the synchronous baseline (trainer and generator taking
    turns), and the body of the asynchronous generator's process. ``copy``: decode with a copy
    of ``model`` (the trainer's, in one process); ``scorer`` / ``prompts``: ones already built."""

    def __init__(self, cfg: RLConfig, model, channel: WeightChannel, copy: bool = True,
                 scorer: Scorer | None = None, prompts: Prompts | None = None):
        import copy as copying

        self.cfg, self.channel = cfg, channel
        self.model = generator_model(copying.deepcopy(model) if copy else model, cfg)
        self.version = channel.take(self.model, -1)
        self.scorer, self.prompts = scorer or Scorer(cfg), prompts or Prompts(cfg)
        self.rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.batch = 0

    def next(self) -> list[Rollout]:
        cfg = self.cfg
        picks = [self.prompts.draw(self.rng, self.batch * cfg.prompts_per_step + i)
                 for i in range(cfg.prompts_per_step)]
        groups, self.version = sample_batch(self.model, picks, cfg, self.batch, self.channel,
                                            self.version, self.gen)
        self.scorer(groups)
        self.batch += 1
        return groups

    def counts(self) -> dict[str, float]:
        return {"in_flight": 0.0, "in_queue": 0.0}

    def close(self) -> None:
        pass


def batch_metrics(groups: list[Rollout]) -> dict[str, float]:
    """What the samples look like: held-out check, reward parts, diversity, GC."""
    sample = torch.cat([g.tokens[:, g.prompt_len :] for g in groups]).numpy()
    out = {f"sample/{k}": v for k, v in diversity(sample).items()}
    out["sample/gc"] = float(np.isin(sample, (1, 2)).mean())
    for key in groups[0].reward_parts:
        out[f"reward/{key}"] = float(np.mean(np.concatenate([g.reward_parts[key] for g in groups])))
    if groups[0].heldout:
        out["heldout/motif_hits"] = float(np.mean(np.concatenate(
            [g.heldout["motif_hits"] for g in groups])))
    out["generator/updates_in_flight"] = float(np.mean([g.updates for g in groups]))
    out["generator/seconds"] = float(groups[0].seconds)
    return out


def rl(cfg: RLConfig, progress: bool = True) -> RLResult:
    """Run the RL job ``cfg``; writes its folder ``cfg.out`` and an MLflow run."""
    from tqdm.auto import tqdm

    from megabase.eval.tracking import open_run
    from megabase.infer.common import check_output_dir, load_model
    from megabase.model.checkpoint import save_checkpoint
    from megabase.pipeline.checkpointing import resolve_checkpoint

    started = time.perf_counter()
    out = check_output_dir(cfg.path(cfg.out))
    checkpoint = str(resolve_checkpoint(cfg.path(cfg.checkpoint)))
    model = load_model(checkpoint)
    prompts = Prompts(cfg)  # bad prompts: refused here, before a process starts
    probe = Scorer(cfg)
    probe([Rollout(0, 0, torch.zeros(2, 1 + cfg.sample_length, dtype=torch.int64), 1,
                   torch.zeros(2, cfg.sample_length), torch.zeros(2, cfg.sample_length,
                                                             dtype=torch.int32), None,
                   torch.zeros(2))])  # bad reward code: refused here too
    torch.set_num_threads(_threads(cfg))
    torch.manual_seed(cfg.seed)
    trainer = Trainer(model, cfg)
    channel = WeightChannel(trainer.policy, shared=cfg.asynchronous)
    uri = cfg.tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    target = open_run(uri, experiment=cfg.experiment, run_name=cfg.name, kind="rl")
    client = _mlflow(target)
    client.log_batch(target["run_id"], params=_params(cfg, checkpoint))
    source = AsyncGenerator(cfg, checkpoint, channel) if cfg.asynchronous else \
        SyncGenerator(cfg, trainer.policy, channel, scorer=probe, prompts=prompts)
    staleness = Staleness(cfg.max_off_policy_steps)
    history: list[dict] = []
    waiting: list[Rollout] = []
    reached = None
    deadline = None if cfg.max_minutes is None else started + 60 * cfg.max_minutes
    last_groups: list[Rollout] = []
    try:
        with tqdm(total=cfg.steps, unit="step", desc="rl", disable=not progress) as bar:
            for step in range(cfg.steps):
                if deadline is not None and time.perf_counter() > deadline:
                    break
                t0 = time.perf_counter()
                while len(waiting) < cfg.prompts_per_step:
                    for g in source.next():
                        if staleness.admit(g, trainer.version):
                            waiting.append(g)
                groups, waiting = waiting[: cfg.prompts_per_step], waiting[cfg.prompts_per_step :]
                waited = time.perf_counter() - t0
                metrics = trainer.step(groups, cfg.measure_both)
                channel.publish(trainer.policy, trainer.version)
                metrics.update(batch_metrics(groups))
                metrics.update({f"generator/{k}": v for k, v in source.counts().items()})
                metrics.update({"trainer/wait_seconds": waited,
                                "trainer/step_seconds": time.perf_counter() - t0,
                                "staleness/dropped": float(staleness.dropped),
                                "seconds": time.perf_counter() - started, "step": step + 1})
                history.append(metrics)
                _log(client, target["run_id"], metrics, step + 1)
                last_groups = groups
                if cfg.target_reward is not None and reached is None:
                    recent = [h["reward"] for h in history[-5:]]
                    if len(recent) == 5 and np.mean(recent) >= cfg.target_reward:
                        reached = metrics["seconds"]
                bar.set_postfix(reward=f"{metrics['reward']:.2f}", kl=f"{metrics['kl_start']:.4f}")
                bar.update(1)
    finally:
        source.close()
    seconds = time.perf_counter() - started
    ckpt = save_checkpoint(trainer.policy, out / "checkpoint",
                           extra={"rl": cfg.to_dict() | {"base": None}, "started_from": checkpoint,
                                  "steps": len(history)})
    result = RLResult(out, len(history), seconds, history, staleness.summary(), Path(ckpt),
                      seconds_to_target=reached, run_id=target["run_id"])
    result.files = _write(out, result, cfg, last_groups)
    for path in result.files.values():
        client.log_artifact(target["run_id"], path, "rl")
    client.set_terminated(target["run_id"])
    return result


def _mlflow(target: dict):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=target["tracking_uri"])


def _params(cfg: RLConfig, checkpoint: str):
    from mlflow.entities import Param

    flat: dict[str, str] = {"rl.checkpoint": checkpoint}

    def walk(prefix: str, node) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            elif k != "checkpoint":
                flat[f"rl.{prefix}{k}"] = str(v)[:500]

    walk("", cfg.to_dict())
    return [Param(k, v) for k, v in flat.items()]


def _log(client, run_id: str, metrics: dict, step: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    rows = [Metric(f"rl/{k}", float(v), now, step) for k, v in metrics.items()
            if k not in ("step",) and v is not None and math.isfinite(v)]
    rows.append(Metric("rl/reward_by_second", metrics["reward"], now, int(metrics["seconds"])))
    client.log_batch(run_id, metrics=rows)


def _write(out: Path, result: RLResult, cfg: RLConfig, groups: list[Rollout]) -> dict[str, str]:
    from megabase.data.atomic import write_atomic

    files = {}
    lines = "".join(json.dumps(h) + "\n" for h in result.history)
    files["metrics"] = str(write_atomic(out / "metrics.jsonl", lines.encode()))
    summary = {"name": cfg.name, "steps": result.steps, "seconds": result.seconds,
               "asynchronous": cfg.asynchronous, "routing_replay": cfg.routing_replay,
               "generator_dtype": cfg.generator_dtype,
               "reward_first5": result.mean("reward", first=5),
               "reward_last5": result.mean("reward", last=5),
               "heldout_first5": result.mean("heldout/motif_hits", first=5),
               "heldout_last5": result.mean("heldout/motif_hits", last=5),
               "kl_start_last5": result.mean("kl_start", last=5),
               "start_bits_first5": result.mean("start_bits_per_base", first=5),
               "start_bits_last5": result.mean("start_bits_per_base", last=5),
               "mismatch_k3": result.mean("mismatch/k3"),
               "target_reward": cfg.target_reward, "seconds_to_target": result.seconds_to_target,
               "staleness": result.staleness, "checkpoint": str(result.checkpoint),
               "config": cfg.to_dict() | {"base": None}}
    for key in ("mismatch_without_replay/k3", "mismatch_with_replay/k3", "mismatch/routing_differs",
                "mismatch_without_replay/routing_differs", "mismatch_with_replay/routing_differs",
                "mismatch_inflight/k3", "mismatch_inflight_without_replay/k3",
                "mismatch_inflight_with_replay/k3", "mismatch/rerouted_bases",
                "mismatch_rerouted/k3", "mismatch_rerouted_without_replay/k3",
                "mismatch_rerouted_with_replay/k3"):
        if any(key in h for h in result.history):
            summary[key] = result.mean(key)
    files["summary"] = str(write_atomic(out / "summary.json",
                                        (json.dumps(summary, indent=1) + "\n").encode()))
    fasta = []
    for g in groups:
        for i, row in enumerate(g.tokens[:, g.prompt_len :].tolist()):
            fasta.append(f">step{result.steps}_prompt{g.prompt_id}_sample{i + 1} "
                         f"reward={float(g.rewards[i]):.3f}\n")
            text = "".join(SYMBOLS[t] for t in row)
            fasta.extend(text[j : j + 80] + "\n" for j in range(0, len(text), 80))
    files["samples"] = str(write_atomic(out / "samples.fa", "".join(fasta).encode()))
    return files
