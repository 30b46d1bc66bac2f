"""``megabase rl``: asynchronous RL from a checkpoint of ``megabase run``.

Two ranks of a torch.distributed group (:mod:`megabase.rl.remote`): the generator decodes batches
of groups and sends them with their rewards; the trainer takes a batch, drops groups past
``max_off_policy_steps``, updates, and sends its weights. The generator starts a batch with
weights at most ``async_level`` versions older than the trainer's when it takes it (prime-rl's one
step ahead by default), and takes new weights between decoding steps. ``asynchronous: false``
runs both in one process, each waiting for the other: the baseline the asynchronous run is timed
against.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megabase.core.atomic import write_atomic
from megabase.core.locks import READERS, holding
from megabase.core.vocab import detokenize, gc_fraction
from megabase.data import InputError
from megabase.data.fasta import write_fasta
from megabase.data.progress import progress as progress_bar
from megabase.infer.common import check_output_dir, load_model
from megabase.model.checkpoint import (CONFIG, WEIGHTS, read_checkpoint_config, resolve_checkpoint,
                                       save_checkpoint)
from megabase.pipeline.tracking import open_run

from .config import RLConfig
from .fit import PROBES, check_rl_fits
from .generator import Scorer, SyncGenerator
from .remote import AsyncGenerator, generator_main, threads_for
from .reward import diversity
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


def batch_metrics(groups: list[Rollout]) -> dict[str, float]:
    """What the samples look like: held-out check, reward parts, diversity, GC."""
    sample = torch.cat([g.tokens[:, g.prompt_len :] for g in groups]).numpy()
    out = {f"sample/{k}": v for k, v in diversity(sample).items()}
    out["sample/gc"] = gc_fraction(sample)
    for key in groups[0].reward_parts:
        out[f"reward/{key}"] = float(np.mean(np.concatenate([g.reward_parts[key] for g in groups])))
    if groups[0].heldout:
        out["heldout/motif_hits"] = float(np.mean(np.concatenate(
            [g.heldout["motif_hits"] for g in groups])))
    out["generator/updates_in_flight"] = float(np.mean([g.updates for g in groups]))
    out["generator/seconds"] = float(groups[0].seconds)
    out["generator/state_mib"] = groups[0].state_bytes / 2**20
    return out


def rl(cfg: RLConfig, progress: bool = True) -> RLResult | None:
    """Run the RL job ``cfg``; writes its folder ``cfg.out`` and an MLflow run. Started by a
    launcher on two ranks (``torchrun --nnodes 2 --nproc-per-node 1``), rank 0 trains and
    returns the result, rank 1 generates and returns None. ``cfg.out`` has one job at a time
    (a second is refused, naming the first's pid), and its ``checkpoint/`` is replaced only
    when ``megabase rl`` wrote it."""

    started = time.perf_counter()
    launched = "WORLD_SIZE" in os.environ  # torchrun and the like: this process is one rank
    if launched and not cfg.asynchronous:
        raise InputError("asynchronous: false runs trainer and generator in one process; start "
                         "it without torchrun")
    checkpoint = str(resolve_checkpoint(cfg.path(cfg.checkpoint)))
    if launched and int(os.environ.get("RANK", "0")) == 1:
        generator_main(cfg, checkpoint)
        return None
    out = check_output_dir(cfg.path(cfg.out))
    # one writer per out folder, as a run folder has: two jobs on one out both ended with exit 0,
    # the first's printed checkpoint holding the second's policy
    with holding(out, f"the rl out folder {out.name!r}", instead="set another out"):
        check_checkpoint_folder(out / "checkpoint")
        return _rl(cfg, checkpoint, out, progress, started)


def check_checkpoint_folder(path: Path) -> None:
    """``out/checkpoint`` is replaced whole when the job ends: refuse before any work when it
    is there and is not a checkpoint ``megabase rl`` wrote (a folder of the user's, a run's
    checkpoint, one with files added)."""

    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_dir():
        why = "is not a folder megabase rl wrote"
    elif others := sorted(p.name for p in path.iterdir()
                          if p.name not in (CONFIG, WEIGHTS, READERS)):  # READERS: evaluate's
        why = f"holds {others[0]!r}, which megabase rl did not write"
    else:
        try:
            why = None if "rl" in read_checkpoint_config(path) else \
                "is a checkpoint megabase rl did not write"
        except InputError:
            why = "is not a checkpoint megabase rl wrote"
    if why is not None:
        raise InputError(f"{why}; the job would replace it whole: move it or choose another "
                         "{out}", path, options=("out",))


def _rl(cfg: RLConfig, checkpoint: str, out: Path, progress: bool,
        started: float) -> RLResult:
    """The trainer's side of :func:`rl`, with ``out`` locked."""

    model = load_model(checkpoint)
    prompts = Prompts(cfg)  # bad prompts: refused here, before a process starts
    probe = Scorer(cfg)
    probe([Rollout(0, 0, torch.zeros(2, 1 + cfg.sample_length, dtype=torch.int64), 1,
                   torch.zeros(2, cfg.sample_length), torch.zeros(2, cfg.sample_length,
                                                             dtype=torch.int32), None,
                   torch.zeros(2))])  # bad reward code: refused here too
    torch.set_num_threads(threads_for(cfg))
    if cfg.prompt.length > PROBES[-1]:  # a job that cannot fit: refused before a process starts
        check_rl_fits(model, cfg)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(model, cfg)
    uri = cfg.tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    target = open_run(uri, experiment=cfg.experiment, run_name=cfg.name, kind="rl")
    client = _mlflow(target)
    client.log_batch(target["run_id"], params=_params(cfg, checkpoint))
    source = None
    staleness = Staleness(cfg.max_off_policy_steps)
    history: list[dict] = []
    waiting: list[Rollout] = []
    reached = None
    deadline = None if cfg.max_minutes is None else started + 60 * cfg.max_minutes
    last_groups: list[Rollout] = []
    try:
        source = AsyncGenerator(cfg, checkpoint) if cfg.asynchronous else \
            SyncGenerator(cfg, trainer.policy, scorer=probe, prompts=prompts)
        # a bar on a terminal, a line every 30 s in a log (a cluster job's stderr)
        with progress_bar(cfg.steps, "rl", unit="step", enabled=progress) as bar:
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
                source.publish(trainer.policy, trainer.version)
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
                bar.update(1, note=f"reward {metrics['reward']:.2f}, kl {metrics['kl_start']:.4f}")
    except BaseException as exc:
        client.set_terminated(target["run_id"], "KILLED" if isinstance(exc, KeyboardInterrupt)
                              else "FAILED")
        raise
    finally:
        if source is not None:
            source.close()
    seconds = time.perf_counter() - started
    ckpt = save_checkpoint(trainer.policy, out / "checkpoint",  # config.json: strict JSON too
                           extra=finite({"rl": cfg.to_dict() | {"base": None},
                                         "started_from": checkpoint, "steps": len(history)}))
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


def finite(obj):
    """``obj`` (dicts, lists, numbers) with every NaN or infinite float as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def strict_json(obj, indent: int | None = None) -> str:
    """JSON that strict parsers read: no bare ``NaN``/``Infinity`` (a figure with no value,
    e.g. the mismatch of a step with no base under the trainer's weights, is ``null``)."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def _write(out: Path, result: RLResult, cfg: RLConfig, groups: list[Rollout]) -> dict[str, str]:

    files = {}
    lines = "".join(strict_json(h) + "\n" for h in result.history)
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
                                        (strict_json(summary, indent=1) + "\n").encode()))
    records = [(f"step{result.steps}_prompt{g.prompt_id}_sample{i + 1} "
                f"reward={float(g.rewards[i]):.3f}", detokenize(row))
               for g in groups for i, row in enumerate(g.tokens[:, g.prompt_len :])]
    files["samples"] = str(write_fasta(out / "samples.fa", records))
    return files
