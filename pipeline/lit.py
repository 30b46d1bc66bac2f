"""The LightningModule around :class:`megabase.model.HybridLM`, and the learning-rate schedule."""

from __future__ import annotations

import json
import math
import os
import random
import time

import lightning.pytorch as pl
import numpy as np
import torch

from megabase.core.errors import TrainingDivergedError
from megabase.core.vocab import N_BASES, SEP
from megabase.data.augment import plant_repeats
from megabase.data.progress import Progress
from megabase.model.walk import segment_bounds, unwalkable, walked_forward

from .config import RunConfig, repeat_frac_at
from .distributed import Layout, make_layout, objective, parallelize
from .memory import heap_trimmer, step_peak_gib
from .summary import moe_warning
from .warmup import LengthWarmup, crop


COLLAPSE_RATIO = 3.0  # max/mean expert load above which a layer is reported as collapsing


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


BACKWARD_PER_FORWARD = 3.0  # a segment's backward pass: its forward again, then ~2x in gradients


def walk_eta(done: int, segments: int, elapsed: float) -> float:
    """Seconds left in a walked step that has done ``done`` of its ``2 * segments`` passes in
    ``elapsed`` seconds: the forward passes first, then the backward's, each costing
    ``BACKWARD_PER_FORWARD`` forwards (measured at the end of a 1,048,576 window on 2 cores:
    4.9 s against 1.9), which the passes' mean rate would leave out."""
    forward = min(done, segments)
    work = forward + BACKWARD_PER_FORWARD * (done - forward)  # in forward passes
    per = elapsed / max(work, 1e-9)
    left = (segments - forward) + BACKWARD_PER_FORWARD * (2 * segments - done - (segments - forward))
    return per * left


class StepLog(pl.Callback):
    """Runs :meth:`LitLM.record_step` after every batch, ahead of the callbacks after it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.record_step(batch_idx)


class LogProgress(pl.Callback):
    """Training progress as periodic log lines (:mod:`megabase.data.progress`), for a stderr that
    is not a terminal (a cluster job's log), where Lightning's bar is a stream of carriage returns
    a person reads as a hang. Rank 0 only; placed after :class:`StepLog`, whose row it quotes."""

    def __init__(self, start_step: int, steps: int, every_s: float | None = None):
        self.start_step, self.steps, self.every_s = start_step, steps, every_s
        self.bar = None

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            since = f" from step {self.start_step}" if self.start_step else ""
            self.bar = Progress(self.steps - self.start_step, f"train{since}", "step",
                                every_s=self.every_s, bar=False)
            self.bar.eta = lambda: self._eta(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.bar is None or (batch_idx + 1) % pl_module.cfg.train.grad_accum:
            return
        row = pl_module.history[-1]
        t = pl_module.cfg.train
        self.bar.update(1, note=f"loss {row['bits_per_base']:.4f} bits/base at step {row['step']} "
                                f"({row['window_length']:,} tokens)",
                        tokens=row["window_length"] * t.batch_size * t.grad_accum)

    def _eta(self, trainer, pl_module) -> float:
        """Seconds left: the tokens of the steps left (their lengths by the warm-up's schedule),
        at the tokens a second so far (a step's cost grows with its length, so the warm-up's short
        steps would promise an hour's run in minutes), and no later than ``train.max_minutes``
        allows."""
        t = pl_module.cfg.train
        rate = self.bar.counts.get("tokens", 0) / max(time.monotonic() - self.bar.started, 1e-9)
        tokens = pl_module.lengths.tokens_left(pl_module.global_step, self.steps)
        left = tokens * t.batch_size * t.grad_accum / max(rate, 1e-9)
        minutes = pl_module.timer_minutes()  # rank 0 alone: no collective here
        if minutes is not None and t.max_minutes is not None:
            left = min(left, max(0.0, 60 * (t.max_minutes - minutes)))
        return left

    def on_train_end(self, trainer, pl_module):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_exception(self, trainer, pl_module, exception):
        self.on_train_end(trainer, pl_module)


class LitLM(pl.LightningModule):
    """One optimizer step = ``grad_accum`` batches of ``[B, L]`` windows.

    Logs per step: ``loss`` (LM loss, nats), ``bits_per_base``, ``aux_loss``, ``lr``,
    ``tokens_per_s``, ``peak_mem_gib`` (the step's own: :func:`.memory.step_peak_gib`),
    ``window_length``, ``segments`` (1, or how many segments the window was walked in:
    ``train.segment``), ``moe_load_max_over_mean`` (the worst layer; per layer in
    ``moe_load_max_over_mean/layer_i``, and in the log ``moe_load_per_layer`` and
    ``moe_idle_experts``), ``moe_bias_norm`` and each DSA layer's indexer KL (``indexer_kl``, per
    layer in ``indexer_kl/layer_i``). The MoE balancing bias moves after every
    optimizer step from the loads of that step's batches; a layer whose max/mean passes
    ``COLLAPSE_RATIO`` or that leaves an expert idle gets one warning line in the progress output.
    Raises :class:`TrainingDivergedError` on a non-finite loss before any update is applied.
    Across several processes each rank trains on its part of the global batch (its data replica's
    windows, its context shard of each) and every logged figure is the global one.
    """

    def __init__(self, model: torch.nn.Module, cfg: RunConfig, log_path=None):
        super().__init__()
        self.model, self.cfg, self.log_path = model, cfg, log_path
        self.layout, self._parallelized = Layout(), False
        self._load = self._margins = self._kl = None
        self._flagged: set[int] = set()  # MoE layers already warned about (one line each)
        self._tokens, self._segments = 0, 1
        self.lengths = LengthWarmup(cfg)  # the sequence-length warm-up (.warmup)
        self._tick = time.perf_counter()
        self.progress = False  # the trainer's progress output is on (a walked step then reports)
        self.history: list[dict] = []  # per optimizer step, for the final summary and tests

    def configure_model(self):
        """Runs on every rank once torch.distributed is up: the mesh, then the parallelisms and
        memory knobs in their fixed order (:func:`megabase.pipeline.distributed.parallelize`)."""
        if self._parallelized:
            return
        t = self.cfg.train
        self.layout = make_layout(t.context_parallel, self.trainer.strategy.root_device.type)
        parallelize(self.model, self.layout, t.recompute, t.offload, t.trim_heap)
        self._parallelized = True

    def training_step(self, batch, batch_idx):
        length = self.lengths.length
        ids, targets, mask = crop(batch["input_ids"], batch["targets"], batch["loss_mask"], length,
                                  self.cfg.data.max_n_frac)
        frac = repeat_frac_at(self.global_step, self.cfg.data)
        if frac > 0:
            ids, targets, mask = self._plant_repeats(targets, frac,
                                                     batch_idx % self.cfg.train.grad_accum)
        warm = self.global_step < self.cfg.train.indexer_warmup_steps
        ctx = self.model.context(dense_warmup=warm)
        self._segments = self.segments(ids.shape[1], ctx)
        if self._segments > 1:  # the context group walks the whole window, sharing each segment
            out = walked_forward(self.model, ids, targets, mask, self.cfg.train.segment, ctx,
                                 self._between_segments(ids.shape[1]))
        else:
            ids, targets, mask = self.layout.shard(ids, targets, mask)
            out = self.model(ids, targets, loss_mask=mask, ctx=ctx)
        step = objective(out, self.layout)
        # the global loss across processes, so that every rank stops together
        total = step.objective.detach() if self.layout.world == 1 else step.lm_loss + step.aux_loss
        if not torch.isfinite(total):
            raise TrainingDivergedError(self.global_step + 1, float(total))
        load, margins = out.expert_load.detach(), out.expert_margins
        self._load = load if self._load is None else self._load + load
        if margins is not None:
            self._margins = margins if self._margins is None else self._margins + margins
        self._tokens += step.n_tokens
        first = batch_idx % self.cfg.train.grad_accum == 0
        self._lm = step.lm_loss if first else self._lm + step.lm_loss
        if out.indexer_kl is not None:
            kl = out.indexer_kl
            self._kl = kl if first or self._kl is None else self._kl + kl
        self._aux = step.aux_loss
        return step.objective / self.cfg.train.grad_accum

    def segments(self, length: int, ctx) -> int:
        """How many segments a window of ``length`` tokens is trained in under ``ctx``: walked
        (:mod:`megabase.model.walk`) where it can be (not the dense indexer's steps) once each
        rank's share is longer than ``train.segment_from``, in segments of ``train.segment``
        tokens per rank of the context group."""
        t, P = self.cfg.train, self.layout.cp_size
        if not t.walks(length // P) or unwalkable(self.model, ctx):
            return 1
        return len(segment_bounds(length, t.segment * P))

    def _between_segments(self, length: int):
        """What runs after each of a walked step's segment passes (its forward's and, later, its
        backward's): on a CPU, the heap handed back to the OS (a segment's freed activations
        otherwise stay in glibc's heap and the next segments add to theirs: at 262,144 tokens
        4.6 GB resident instead of 2.3); on rank 0 with progress on, the passes counted (a bar on
        a terminal, lines in a log), so a step of minutes shows that it moves."""
        trim = heap_trimmer() if self.device.type == "cpu" else None
        total = 2 * self._segments
        bar = Progress(total, f"step {self.global_step + 1} ({length:,} tokens, forward + backward)",
                       "segment",
                       enabled=self.progress and self.trainer.is_global_zero)
        bar.eta = lambda: walk_eta(bar.n, self._segments, time.monotonic() - bar.started)

        def between():
            if trim is not None:
                trim()
            bar.update(1)
            if bar.n == total:  # the backward's last pass: the step's walk is done
                bar.close()

        return between

    def _plant_repeats(self, targets: torch.Tensor, frac: float, micro: int):
        """The synthetic-repeat curriculum on a batch's targets ``[B, L]``: new ``(input_ids,
        targets, loss_mask)``, drawn from (seed, step, micro-batch, data replica) so a resumed or
        context-parallel run plants the same copies."""

        d = self.cfg.data
        rng = np.random.default_rng((self.cfg.train.seed, self.global_step, micro,
                                     self.layout.dp_rank))
        rows = [plant_repeats(row, rng, frac, tuple(d.repeat_length), d.repeat_divergence)
                for row in targets.cpu().numpy()]
        new = torch.from_numpy(np.stack(rows)).to(targets.device)
        ids = torch.cat([torch.full_like(new[:, :1], SEP), new[:, :-1]], dim=1)
        return ids, new, new < N_BASES

    def on_before_optimizer_step(self, optimizer):
        if self._load is not None and self._load.numel():
            self._load = self.layout.sum(self._load)  # global counts: the bias stays the same everywhere
            if self._margins is not None:
                self._margins = self.layout.sum(self._margins)
            self.model.update_moe_bias(self._load, self._margins)

    def record_step(self, batch_idx: int) -> None:
        """The step's row: train log (on disk), history, MLflow, collapse warnings. Called by
        :class:`StepLog`, a callback placed before the checkpoint's, so that a checkpoint of step
        ``s`` is never on disk without the log row of ``s`` (a kill between them lost the row)."""
        if (batch_idx + 1) % self.cfg.train.grad_accum:
            return
        now = time.perf_counter()
        lm = float(self._lm) / self.cfg.train.grad_accum
        row = {"step": self.global_step, "loss": lm, "bits_per_base": lm / math.log(2),
               "aux_loss": float(self._aux), "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
               "tokens_per_s": self._tokens / max(now - self._tick, 1e-9),
               "peak_mem_gib": step_peak_gib(self.device),
               "window_length": self.lengths.at(self.global_step - 1),
               "segments": self._segments}
        per_layer = {}
        if self._load is not None and self._load.numel():
            load = self._load.float()
            ratio = load.max(-1).values / load.mean(-1).clamp_min(1e-9)
            idle = (load == 0).sum(-1)
            row["moe_load_max_over_mean"] = float(ratio.max())
            row["moe_load_per_layer"] = [round(float(r), 4) for r in ratio]
            row["moe_idle_experts"] = [int(i) for i in idle]
            row["moe_bias_norm"] = float(torch.stack([m.bias.norm() for m in self.model.moe_layers()]).norm())
            per_layer = {f"moe_load_max_over_mean/layer_{i}": float(r) for i, r in enumerate(ratio)}
            self._warn_collapse(ratio, idle)
        if self._kl is not None:  # each DSA layer's indexer KL, averaged over ranks and micro-batches
            kl = self.layout.sum(self._kl) / (self.layout.world * self.cfg.train.grad_accum)
            row["indexer_kl"] = [round(float(k), 5) for k in kl]
            per_layer |= {f"indexer_kl/layer_{i}": float(k) for i, k in enumerate(kl)}
        self.history.append(row)
        if self.log_path is not None and self.trainer.is_global_zero:  # on disk before the next step
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        shown = ("bits_per_base", "tokens_per_s")
        self.log_dict({k: row[k] for k in shown}, on_step=True, prog_bar=True)
        self.log_dict({k: v for k, v in row.items() if k not in ("step", *shown)
                       and not isinstance(v, list)} | per_layer, on_step=True)
        self._load, self._margins, self._kl, self._tokens, self._tick = None, None, None, 0, now
        self.lengths.advance(self.global_step, self._training_minutes())

    def _training_minutes(self) -> float | None:
        """Minutes of training so far by Lightning's timer (``train.max_minutes``'s clock, which
        a resumed run carries on), rank 0's on every rank (a collective); None without a cap."""
        minutes = self.timer_minutes()
        return None if minutes is None else self.trainer.strategy.broadcast(minutes, src=0)

    def timer_minutes(self) -> float | None:
        """This process's :meth:`_training_minutes`, without the collective."""
        from lightning.pytorch.callbacks import Timer

        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        return None if timer is None else timer.time_elapsed("train") / 60

    def _warn_collapse(self, ratio: torch.Tensor, idle: torch.Tensor) -> None:
        """One line in the progress output the first time a MoE layer routes more than
        ``COLLAPSE_RATIO`` times the mean load to one expert, or leaves an expert idle."""
        for i, (r, n) in enumerate(zip(ratio.tolist(), idle.tolist())):
            if i not in self._flagged and (r > COLLAPSE_RATIO or n > 0):
                self._flagged.add(i)
                if self.trainer.is_global_zero:
                    from tqdm import tqdm

                    tqdm.write(moe_warning(i, r, int(n), self.global_step))

    def configure_optimizers(self):
        t = self.cfg.train
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                 {"params": rest, "weight_decay": 0.0}],
                                lr=t.lr, betas=(t.beta1, t.beta2),
                                # one pass over the k-mer tables instead of a dozen (0.04 vs 0.15 s
                                # a step on cpu-small); Lightning refuses it with clipping under AMP
                                fused=t.precision == "fp32")
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        t = self.cfg.train
        checkpoint["megabase_data"] = {  # where the sample stream resumes (see TrainingStream)
            "samples_consumed": self.global_step * t.batch_size * t.grad_accum, "seed": t.seed}
        checkpoint["megabase_rng"] = {
            "torch": torch.get_rng_state(), "numpy": np.random.get_state()[1].tolist(),
            "python": list(random.getstate()[1])}
        checkpoint["megabase_lengths"] = self.lengths.state_dict()

    def on_load_checkpoint(self, checkpoint):
        self.lengths.load_state_dict(checkpoint.get("megabase_lengths"),
                                     int(checkpoint.get("global_step", 0)))
        rng = checkpoint.get("megabase_rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            state = np.random.get_state()
            np.random.set_state((state[0], np.array(rng["numpy"], dtype=np.uint32), *state[2:]))
            py = random.getstate()
            random.setstate((py[0], tuple(rng["python"]), py[2]))

