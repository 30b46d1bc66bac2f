"""The asynchronous generator: rank 1 of the trainer's process group (:mod:`megabase.rl.transport`).

Rank 1 runs :func:`generator_main`: batch after batch of the same :class:`SyncGenerator` the
synchronous loop uses, each announced (``STARTED``) and sent with its rewards (``BATCH``). Batch
``b`` starts only with weights of version ``b - async_level`` or newer: the trainer takes batch
``b`` at its step ``b``, so no group is more than ``async_level`` versions behind (prime-rl's
rule; waiting only for the trainer to have *taken* batch ``b - async_level`` let it run two
versions behind whenever the trainer was the slower side). Between decoding steps it takes the
newest ``WEIGHTS`` the trainer sent. Rank 0 holds an :class:`AsyncGenerator`, the trainer's view
of it: the next batch, the weights to publish, the counts in flight and in queue, and the
shutdown (``STOP``, then every message up to the generator's ``BYE``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback

import torch

from megabase.core.errors import TrainingError
from megabase.data import InputError
from megabase.infer.common import load_model

from . import transport
from .config import RLConfig
from .generator import SyncGenerator, flat_parameters, load_flat
from .rollout import Rollout
from .transport import BATCH, BYE, ERROR, GONE, STARTED, STOP, WEIGHTS, Link


class Stopped(Exception):
    """The trainer said stop (or went away): the generator leaves its batch where it is."""


class RemoteWeights:
    """The generator's side of the link: the trainer's newest weights, read from the link's inbox
    without waiting (:meth:`take`) or waiting for a version (:meth:`wait`)."""

    def __init__(self, link: Link):
        self.link = link
        self.latest: tuple[int, torch.Tensor] | None = None

    @property
    def version(self) -> int:
        return 0 if self.latest is None else self.latest[0]

    def _handle(self, item) -> None:
        kind, a, _, payload = item
        if kind in (STOP, GONE):
            raise Stopped
        if kind == WEIGHTS and a > self.version:
            self.latest = (a, payload)

    def _drain(self) -> None:
        while not self.link.inbox.empty():
            self._handle(self.link.inbox.get_nowait())

    def take(self, model, have: int) -> int | None:
        self._drain()
        if self.latest is None or self.latest[0] == have:
            return None
        version, flat = self.latest
        load_flat(model, flat)
        return version

    def wait(self, version: int) -> None:
        """Until the trainer's weights of ``version`` or newer are here."""
        self._drain()
        while self.version < version:
            self._handle(self.link.get())


def threads_for(cfg: RLConfig) -> int:
    """Torch threads per process: ``cfg.threads``, else the cores split between the processes
    sharing this machine (two when asynchronous and started here)."""
    if cfg.threads is not None:
        return cfg.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    shared = 2 if cfg.asynchronous and "WORLD_SIZE" not in os.environ else 1
    return max(1, (cores or 1) // shared)


def generator_main(cfg: RLConfig, checkpoint: str, address: str | None = None) -> None:
    """Rank 1: generate until the trainer says stop; a failure goes to the trainer as one
    message (it reports it), then ``BYE``."""
    transport.connect(1, address)
    link = Link(peer=0)
    try:
        torch.set_num_threads(threads_for(cfg))
        weights = RemoteWeights(link)
        source = SyncGenerator(cfg, load_model(checkpoint), weights, copy=False)
        while True:
            weights.wait(source.batch - cfg.async_level)  # lag <= async_level at the trainer
            link.send(STARTED, source.batch)
            groups = source.next()
            link.send_object(BATCH, groups, source.batch - 1)
    except Stopped:
        pass
    except BaseException as exc:
        kind = error_kind(exc)
        line = str(exc) if kind in ("input", "training") else f"{type(exc).__name__}: {exc}"
        link.send_object(ERROR, (line, kind, traceback.format_exc()))
        if not isinstance(exc, Exception):
            raise
    finally:
        link.send(BYE)
        link.settle()
        link.join(timeout=60)
        transport.disconnect()


def error_kind(exc: BaseException) -> str | None:
    """How the trainer reports a generator's failure: ``"input"`` (one line, exit 2),
    ``"training"`` (one line, exit 3), ``"interrupted"`` (as a Ctrl-C), None (a bug: the
    traceback)."""
    if isinstance(exc, InputError):
        return "input"
    if isinstance(exc, TrainingError):
        return "training"
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else None


def _spawned(cfg: RLConfig, checkpoint: str, address: str, parent: int) -> None:
    """The generator process ``megabase rl`` starts: it ignores Ctrl-C (the trainer, which gets
    it too, stops it and prints the one line) and ends with its parent, however that ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards one that came while it started
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the trainer
    die_with_parent(parent)
    generator_main(cfg, checkpoint, address)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this process when ``parent`` ends: a trainer killed with SIGKILL sends no ``STOP``,
    and the rendezvous would wait 24 h (with it, the resource tracker, which ends when the
    last process holding its pipe does). On Linux the kernel sends SIGKILL (prctl
    ``PR_SET_PDEATHSIG``); elsewhere a thread checks ``os.getppid()`` every ``poll_s`` s."""
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(poll_s)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="megabase-rl-parent").start()


@contextlib.contextmanager
def sigint_blocked():
    """SIGINT blocked in this thread for the block: a process started in it inherits the mask,
    so a Ctrl-C while it imports waits until :func:`_spawned` ignores it (else its
    KeyboardInterrupt traceback); here, one that came meanwhile arrives when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class AsyncGenerator:
    """The trainer's side. Without a launcher (no ``WORLD_SIZE``) it starts rank 1 in a
    process of its own; under one, rank 1 is the launcher's other process."""

    def __init__(self, cfg: RLConfig, checkpoint: str):
        self.proc = None
        address = None
        if "WORLD_SIZE" not in os.environ:
            import torch.multiprocessing as mp

            address = f"tcp://127.0.0.1:{transport.free_port()}"
            self.proc = mp.get_context("spawn").Process(
                target=_spawned, args=(cfg, checkpoint, address, os.getpid()), daemon=True)
            with sigint_blocked():
                self.proc.start()
        try:
            transport.connect(0, address, self._alive)
        except transport.PeerGone as exc:
            raise TrainingError(f"{exc} (exit code {self.proc.exitcode}); nothing was trained") from None
        self.link = Link(peer=1)
        self.started = self.received = 0
        self.ended = False
        self.waiting: list[list[Rollout]] = []

    def _alive(self) -> bool:
        return self.proc is None or self.proc.is_alive()

    def _handle(self, item) -> None:
        kind, a, _, payload = item
        if kind == STARTED:
            self.started = max(self.started, a + 1)
        elif kind == BATCH:
            self.received += 1
            self.waiting.append(payload)
        elif kind == ERROR:
            line, what, trace = payload
            self.ended = True
            if what == "input":
                raise InputError(line)
            if what == "training":
                raise TrainingError(f"the generator stopped: {line}")
            if what == "interrupted":
                raise KeyboardInterrupt
            raise RuntimeError(f"the generator failed: {line}\n{trace}")
        elif kind in (BYE, GONE):
            self.ended = True
            why = payload if kind == GONE else "it said goodbye"
            raise TrainingError(f"the generator's rank stopped before the trainer ({why}) after "
                                f"{self.received} batches; no checkpoint was written")

    def next(self) -> list[Rollout]:
        while not self.waiting:
            self._handle(self.link.get(self._alive))
        return self.waiting.pop(0)

    def publish(self, model, version: int) -> None:
        self.link.send(WEIGHTS, version, 0, flat_parameters(model))

    def counts(self) -> dict[str, float]:
        while not self.link.inbox.empty():
            self._handle(self.link.inbox.get_nowait())
        return {"in_flight": float(self.started - self.received), "in_queue": float(len(self.waiting))}

    def close(self) -> None:
        """``STOP``, then read up to the generator's ``BYE`` (its last sends must be received
        for it to exit), and leave the group."""
        try:
            if not self.ended:
                self.link.send(STOP)
                while True:
                    item = self.link.get(self._alive, timeout=120)
                    if item is None or item[0] in (BYE, GONE):
                        break
            self.link.settle()
        except RuntimeError:  # gloo: the generator's connection is already closed
            pass
        finally:
            self.link.join(timeout=5)
            if self.proc is not None:
                self.proc.join(timeout=30)
                if self.proc.is_alive():
                    self.proc.kill()
            transport.disconnect()
