"""The trainer and the generator as the two ranks of a torch.distributed process group (gloo).

Rank 0 trains, rank 1 generates. ``megabase rl`` starts rank 1 itself (torch.multiprocessing,
spawn, a free local port); under ``torchrun --nnodes 2 --nproc-per-node 1`` (or any launcher
that sets ``RANK``/``WORLD_SIZE``), each node runs one rank, so the generator can sit on another
machine. gloo carries CPU tensors on any machine, GPU ones included (weights pass through host
memory).

Each message is a header ``int64 [kind, a, b, n]`` (tag 1) and, where ``n > 0``, a payload of
``n`` values (tag 2): fp32 weights, or the bytes of a pickled object. gloo keeps the order of
each tag between two ranks. A thread on each side receives into a queue, so the generator polls
for new weights between decoding steps at the cost of a queue read, and a dead peer (a closed
connection) reaches the other side as an item instead of a hang.

trainer -> generator: ``WEIGHTS`` (version; the flat parameters), ``STOP``. generator ->
trainer: ``STARTED`` (batch), ``BATCH`` (batch; the pickled groups), ``ERROR`` (the pickled
one-line message, whether it is an input error, the traceback), ``BYE``.
"""

from __future__ import annotations

import pickle
import queue as queue_mod
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

WEIGHTS, STOP, STARTED, BATCH, ERROR, BYE, GONE = range(7)


class PeerGone(RuntimeError):
    """The other rank went away before it joined."""
_HEADER, _PAYLOAD = 1, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# a rank may wait long for the other (a long batch, a slow step): failures reach it as a closed
# connection, not as a timeout
TIMEOUT = timedelta(hours=24)


def connect(rank: int, address: str | None = None, alive: Callable[[], bool] | None = None) -> None:
    """Join the two-rank gloo group: at ``address`` (``tcp://host:port``), or from the
    launcher's environment when ``address`` is None. ``alive``: checked every second while
    waiting for the other rank (a generator process that died before joining ends the wait)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        kwargs = {"timeout": TIMEOUT} if address is None else \
            {"init_method": address, "rank": rank, "world_size": 2, "timeout": TIMEOUT}
        errors: list[BaseException] = []

        def join():
            try:
                dist.init_process_group("gloo", **kwargs)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=join, daemon=True, name="megabase-rl-connect")
        thread.start()
        while thread.is_alive():
            thread.join(1.0)
            if thread.is_alive() and alive is not None and not alive():
                raise PeerGone("the generator's process ended before it joined the trainer")
        if errors:
            raise errors[0]
    if dist.get_world_size() != 2:
        raise RuntimeError(f"megabase rl runs on two ranks (trainer, generator), not "
                           f"{dist.get_world_size()}")


class Link:
    """Messages to and from the other rank; received ones wait in :attr:`inbox` as
    ``(kind, a, b, payload or None)``. The receiving thread stops after ``STOP``/``BYE``, or
    puts ``(GONE, ...)`` when the connection fails."""

    def __init__(self, peer: int):
        self.peer = peer
        self.inbox: queue_mod.Queue = queue_mod.Queue()
        self._sent: list = []
        self._thread = threading.Thread(target=self._receive, daemon=True, name="megabase-rl-link")
        self._thread.start()

    def send(self, kind: int, a: int = 0, b: int = 0, payload: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        self.settle()  # one message in flight: the previous weights are read before the next go
        n = 0 if payload is None else payload.numel()
        header = torch.tensor([kind, a, b, n], dtype=torch.int64)
        works = [dist.isend(header, self.peer, tag=_HEADER)]
        if n:
            works.append(dist.isend(payload, self.peer, tag=_PAYLOAD))
        self._sent = [(w, t) for w, t in zip(works, (header, payload))]

    def send_object(self, kind: int, obj, a: int = 0, b: int = 0) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.send(kind, a, b, torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def settle(self) -> None:
        """Wait until what was sent has been received."""
        for work, _ in self._sent:
            work.wait()
        self._sent = []

    def _receive(self) -> None:
        import torch.distributed as dist

        while True:
            try:
                header = torch.empty(4, dtype=torch.int64)
                dist.recv(header, self.peer, tag=_HEADER)
                kind, a, b, n = (int(v) for v in header)
                payload = None
                if n:
                    payload = torch.empty(n, dtype=torch.float32 if kind == WEIGHTS else torch.uint8)
                    dist.recv(payload, self.peer, tag=_PAYLOAD)
            except Exception as exc:  # the peer's process ended or its connection broke
                first = (str(exc).strip().splitlines() or [""])[0]
                self.inbox.put((GONE, 0, 0, f"{type(exc).__name__}: {first}"))
                return
            if payload is not None and kind != WEIGHTS:
                payload = pickle.loads(payload.numpy().tobytes())
            self.inbox.put((kind, a, b, payload))
            if kind in (STOP, BYE):
                return

    def get(self, alive: Callable[[], bool] | None = None, timeout: float | None = None):
        """The next message; waits, checking ``alive`` every second (a False answer gives a
        ``GONE`` item) until ``timeout`` seconds have passed (then None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            try:
                return self.inbox.get(timeout=wait)
            except queue_mod.Empty:
                if alive is not None and not alive():
                    return (GONE, 0, 0, "the generator process ended without a word")
                if deadline is not None and time.monotonic() >= deadline:
                    return None

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def disconnect() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
