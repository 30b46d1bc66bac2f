"""Will a training step fit in this machine's memory: measured on the run's own model before it starts.

A CPU step's peak resident memory is estimated as

    now + moments + activations(L) + borders(T)

* ``now``: this process as it stood before the probes (Python, torch, the libraries);
* ``moments``: the model's weights and AdamW's two moments (three copies of the parameters);
* ``activations(L)``: what one forward and backward of ``L`` tokens holds at its peak, measured:
  two probe steps of the run's model (its recompute mode applied) on random bases at
  :data:`PROBE` and twice as many tokens, their peak resident memory above the start fitted as
  ``c + a L`` (gradients included). ``L`` is the window for a whole-window step and one segment
  for a walked one (:mod:`megabase.model.walk`);
* ``borders(T)``: a walked step's window-long buffers, per token from
  :func:`megabase.model.walk.border_bytes` (the DSA keys and their gradients, the per-token
  report; where the C DSA kernels are not built, the largest layer's full-window key gradient)
  plus the batch's tokens, targets and mask. The kept selections are in a file (the page cache).

So a layer's change moves the estimate with it; what it leaves out is the heap's slack (glibc
keeps freed pages; the walk hands them back between segments) and costs that grow faster than
the window (the DSA candidate stage's seeds are rebuilt per segment, a few MB). The bench
(benchmarks/bench_walk.py) prints it beside the measured peak. :func:`check_fits` refuses a run
whose step cannot fit, naming the knob that would make it fit; GPU runs are left to
``megabase plan`` (issue 45).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megabase.core.errors import InputError
from megabase.kernels.dsa import cpu as dsa_cpu
from megabase.model.walk import border_bytes

from .config import RunConfig, model_config
from .memory import apply_recompute, heap_trimmer, proc_status, reset_peak_rss

PROBE = 2048  # tokens of the smaller probe step (the larger has twice as many)
HEADROOM = 0.9  # the share of available memory a step may plan to use
SEGMENTS = (8192, 4096, 2048, 1024)  # segment sizes a refusal may suggest, largest first


@dataclass(frozen=True)
class Need:
    """A step's estimated peak (bytes), and its parts."""

    now: int
    moments: int
    activations: int
    borders: int

    @property
    def total(self) -> int:
        return self.now + self.moments + self.activations + self.borders


def available_bytes() -> int | None:
    """Memory this process may still take: ``MemAvailable`` and the cgroup's limit, whichever is
    lower, plus what the process already holds; None where neither can be read."""
    rss = proc_status("VmRSS") or 0
    limits = []
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        if found:
            limits.append(int(found.group(1)) * 1024 + rss)
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:
            limits.append(int(value))
    return min(limits) if limits else None


def measured_peak(run: Callable[[], None], trim: Callable[[], None] | None = None) -> int:
    """Peak resident bytes above the start of ``run()`` (the heap handed back first with ``trim``,
    :func:`~megabase.pipeline.memory.heap_trimmer`'s, so earlier freed pages do not hide it)."""
    if trim is not None:
        trim()
    start = proc_status("VmRSS") or 0
    reset_peak_rss()
    run()
    return (proc_status("VmHWM") or start) - start


def line_through(xs: tuple[int, int], ys: list[int]) -> tuple[float, float]:
    """``(c, a)`` of the line ``c + a x`` through two measurements (a slope below 0, noise, is
    taken as 0)."""
    a = max(ys[1] - ys[0], 0) / (xs[1] - xs[0])
    return ys[0] - a * xs[0], a


class Probe:
    """Peak-memory measurements of one run's model on the CPU, made once each and reused."""

    def __init__(self, cfg: RunConfig):
        from megabase.model import build_model

        self.cfg = cfg
        self.now = proc_status("VmRSS") or 0
        torch.manual_seed(0)
        self.model = build_model(model_config(cfg)).train()
        if self.model.head is not None:  # zero-started: the layers' backward would be idle
            with torch.no_grad():
                self.model.head.weight.normal_(0, 0.5)
        self.params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.trim = heap_trimmer()
        self._fits: dict[str, tuple[float, float]] = {}
        self._borders = None

    def activations(self, recompute: str, batch: int, length: int) -> int:
        """Peak bytes above the start of a forward and backward of ``[batch, length]``."""
        if recompute not in self._fits:
            model = self.model if recompute == "none" else apply_recompute(
                copy.deepcopy(self.model), recompute)
            self._step(model, batch, PROBE // 8)  # first-call costs (kernels, pools) out of the fit
            sizes = (PROBE * batch, 2 * PROBE * batch)
            self._fits[recompute] = line_through(
                sizes, [self._step(model, batch, n) for n in (PROBE, 2 * PROBE)])
        c, a = self._fits[recompute]
        return int(c + a * batch * length)

    def borders(self, batch: int, length: int) -> int:
        if self._borders is None:
            self._borders = border_bytes(self.model)
        b = self._borders
        batch_bytes = 8 + 8 + 1  # the batch's input ids, targets (int64) and loss mask
        per = 2 * b["keys"] + b["report"] + batch_bytes  # the kept selections go to a file
        if not dsa_cpu.available():  # the reference adds each segment's full-window key gradient
            per += b["layer"]
        return per * batch * length

    def _step(self, model, batch: int, n: int) -> int:
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(0, 4, (batch, n + 1), generator=gen)
        model.zero_grad(set_to_none=True)
        peak = measured_peak(lambda: model(ids[:, :-1], ids[:, 1:]).loss.backward(), self.trim)
        model.zero_grad(set_to_none=True)
        return peak

    def close(self) -> None:
        """Free the probe's model and hand its memory back before the run builds its own (the
        peak RSS is reset too, so the run's logged peak is its own)."""
        self.model = None
        if self.trim is not None:
            self.trim()
        reset_peak_rss()


def step_need(probe: Probe, cfg: RunConfig, length: int | None = None) -> Need:
    """The estimated peak of one training step of ``cfg`` at ``length`` tokens (default its
    window), for one process."""
    t = cfg.train
    length = cfg.data.window_length if length is None else length
    walked = t.walks(length) and t.context_parallel == 1 and t.indexer_warmup_steps == 0
    batch = t.batch_size // max(1, t.devices * t.num_nodes // t.context_parallel)
    shard = length // t.context_parallel
    now, moments = probe.now, 3 * probe.params
    if walked:
        return Need(now, moments, probe.activations(t.recompute, batch, t.segment),
                    probe.borders(batch, length))
    return Need(now, moments, probe.activations(t.recompute, batch, shard), 0)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(cfg: RunConfig) -> Need | None:
    """Refuse (an :class:`InputError`, one line) a CPU run whose training step at its window
    cannot fit in this machine's memory, naming the knob that would make it fit; the estimate
    where it fits, None where it is not checked (a GPU run, no ``/proc``)."""
    if torch.cuda.is_available() or not reset_peak_rss():
        return None
    room = available_bytes()
    if room is None:
        return None
    ranks = cfg.train.devices  # the processes of one node share its memory
    probe = Probe(cfg)
    need = step_need(probe, cfg)
    if need.total * ranks <= HEADROOM * room:
        probe.close()
        return need
    what = (f"a training step at {cfg.data.window_length:,} tokens needs ~{_gb(need.total * ranks)}"
            f" of the {_gb(room)} this machine has free")
    for knobs in _suggestions(cfg):
        tried = step_need(probe, _with(cfg, knobs)).total * ranks
        if tried <= HEADROOM * room:
            sets = " ".join(f"--set train.{k}={'null' if v is None else v}" for k, v in knobs.items())
            raise InputError(f"{what}; with {sets} it needs ~{_gb(tried)}")
    raise InputError(f"{what}, and no memory knob brings it under (the least: train.segment=1024 "
                     "with train.recompute=layer); choose a smaller model.preset, "
                     "data.window_length or train.batch_size")


def _with(cfg: RunConfig, knobs: dict) -> RunConfig:
    return replace(cfg, train=replace(cfg.train, **knobs))


def _suggestions(cfg: RunConfig):
    """Memory knobs to try, each a dict of train fields, the cheapest in time first."""
    t, T = cfg.train, cfg.data.window_length
    walk = {"segment_from": 0} if T <= t.segment_from else {}
    for recompute in dict.fromkeys([t.recompute, "layer"]):
        for size in SEGMENTS:
            if size < T and (t.segment is None or size <= t.segment):
                knobs = {**walk, "segment": size}
                if recompute != t.recompute:
                    knobs["recompute"] = recompute
                if knobs != {"segment": t.segment}:
                    yield knobs
    if t.batch_size > 1:
        yield {"batch_size": 1, "grad_accum": t.grad_accum * t.batch_size, "segment": SEGMENTS[-1],
               "recompute": "layer", **walk}

