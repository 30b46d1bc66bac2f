"""Training over a long window in segments, with the gradients of the whole window.

A training step over ``T`` tokens keeps every layer's activations of all ``T`` for its backward;
at a megabase that is most of a 24 GiB machine, and every elementwise op streams full-length
tensors through memory. :func:`walked_forward` runs the same step one segment at a time, as
scoring does, and keeps only what crosses from a segment to the next:

* forward, segments in order, without autograd: each layer's boundary values are kept (the KDA
  state at each segment's start, the short conv's and the k-mer hash's last inputs, the DSA
  layers' keys, values and index keys of every position so far);
* backward, segments in reverse: a segment's forward is run again with autograd, starting from the
  kept boundary values as leaves; one ``torch.autograd.grad`` over its loss and its boundary
  outputs (with the gradients later segments sent back to them) gives its share of the parameter
  gradients and the gradients of its own boundary inputs, which go to the segment before it. The
  DSA keys and values of earlier positions that a segment's queries selected get their gradient
  added into a whole-window buffer by the kernels, in place, which the segment that made them
  reads when its turn comes.

This is context parallelism laid out in time: a :class:`Segment` is the
:mod:`megabase.model.sequence` interface (``before``, ``prefix``, ``kda``, ``balance``) for one
segment of the window, handed to every layer in its call's context, so the layers' forwards are
the ones every other pass runs. Per-token quantities (MoE, the loss, the indexer KL) stay in their
segment; the sequence-wise balance loss reads the expert counts of the whole window, summed in the
forward. The gradients equal the full backward's to fp32 round-off; the tests compare every
parameter's.

Context parallelism composes as the walk's inner level: a group of ``P`` ranks walks the window in
segments of ``P`` pieces, rank ``r`` holding the ``r``-th piece of each. Within a segment the group
exchanges as it does over a whole sequence (the previous rank's last rows, the KDA maps folded
into each rank's incoming state); across segments the walk carries what the last rank's piece
ends with to the first rank's next piece, and in the backward sends its gradient back between
passes (:meth:`Walk.send_back`). Every rank keeps the window's DSA keys; the gradients its
queries add to a segment's keys are summed over the group when that segment's backward comes.

Activation recompute (``pipeline.memory``) composes: a recomputed block calls the same interface
again inside the backward, and a :class:`Segment` layer view answers those calls with what it
answered the first time, registering nothing twice (its calls are kept in order; a recompute
replays them from the first).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace

import numpy as np
import torch

from .context import Context
from .lm import LMOutput
from .sequence import ONE_PROCESS, OneProcess


def segment_bounds(length: int, segment: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the segments of a ``length``-token window: ``segment`` tokens each,
    the last one ragged."""
    if segment < 1:
        raise ValueError(f"a segment must hold at least one token, got {segment}")
    return [(s, min(s + segment, length)) for s in range(0, length, segment)]


class Walk:
    """What crosses the segment borders of one window ``ids [B, T]`` cut at ``bounds``, in both
    directions: kept in the forward (``tails``, ``states``, ``keys``, the balance loss's counts) and
    sent back in the backward (their gradients)."""

    def __init__(self, ids: torch.Tensor, bounds: list[tuple[int, int]], between=None,
                 group: OneProcess = ONE_PROCESS, fan: bool = False):
        self.ids, self.bounds, self.T = ids, bounds, bounds[-1][1]
        # the last segment continues the window's one row as several (RL: a prompt read once,
        # then its group's samples; :mod:`megabase.model.walk_group`), its rows not in ``ids``
        self.fan = fan
        self.group = group  # the context-parallel group sharing each segment (ONE_PROCESS: none)
        self.tails: dict = {}  # (key, segment) -> the segment's last rows of a layer's input
        self.states: dict = {}  # (key, segment) -> the KDA state at the segment's start
        self.keys: dict = {}  # key -> [B, T, ...] buffers of keys / values / index keys
        self.key_grads: dict = {}  # key -> their gradients, summed over later queries
        self.selected = Kept()  # (key, segment) -> the indexer's top-k, forward to backward
        self.counts: dict = {}  # key -> the window's expert counts (balance loss)
        self.shares: dict = {}  # key -> (loss function, the window's summed shares)
        self.tail_grads: dict = {}  # (key, segment) -> gradient of the segment's last rows
        self.state_grads: dict = {}  # (key, segment) -> gradient of the segment's final state
        self.roots: list[tuple[torch.Tensor, torch.Tensor]] = []  # this segment's boundary outputs
        self.leaves: list[tuple[torch.Tensor, dict, tuple]] = []  # and inputs, where their grad goes
        self.between = between or (lambda: None)  # called after each segment's pass

    def piece(self, index: int) -> tuple[int, int]:
        """``(start, end)`` of this rank's piece of segment ``index``: the ``P`` ranks of the
        group hold its equal parts in rank order."""
        a, b = self.bounds[index]
        n = (b - a) // self.group.size
        return a + self.group.rank * n, a + (self.group.rank + 1) * n

    def send_back(self, index: int) -> None:
        """After segment ``index``'s backward: the gradients of the tails and KDA states that rank
        0 took from segment ``index - 1`` go to the last rank, which made them (with one rank
        they are where they belong)."""
        g = self.group
        if g.size == 1 or index == 0:
            return
        made = [(value, self.tail_grads, k) for k, value in self.tails.items()
                if k[1] == index - 1 and value.is_floating_point()]
        made += [(value, self.state_grads, (k[0], index - 1)) for k, value in self.states.items()
                 if k[1] == index]
        for value, grads, key in made:
            mine = grads.pop(key, None) if g.rank == 0 else None
            got = g.gather(torch.zeros_like(value) if mine is None else mine)[0]
            if g.rank == g.size - 1:
                grads[key] = got

    def backward(self, params, grads: list, objective: torch.Tensor | None = None) -> None:
        """One segment's backward: from ``objective`` (its own loss, if any) and the boundary
        outputs later segments sent gradients to, add its share of each parameter's gradient into
        ``grads`` and send its boundary inputs' gradients where they go."""
        roots = ([] if objective is None else [objective]) + [r for r, _ in self.roots]
        sent = ([] if objective is None else [None]) + [g for _, g in self.roots]
        leaves = [leaf for leaf, _, _ in self.leaves]
        found = torch.autograd.grad(roots, list(params) + leaves, sent, allow_unused=True) \
            if roots else [None] * (len(params) + len(leaves))
        for j, g in enumerate(found[: len(params)]):
            if g is not None:
                grads[j] = g if grads[j] is None else grads[j] + g
        for (_, sink, key), g in zip(self.leaves, found[len(params):]):
            if g is not None:
                sink[key] = g
        self.roots, self.leaves = [], []

    def root(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        self.roots.append((output, grad))

    def leaf(self, value: torch.Tensor, sink: dict, key: tuple) -> torch.Tensor:
        """``value`` as a leaf of this segment's backward whose gradient goes to ``sink[key]``."""
        value = value.detach().requires_grad_()
        self.leaves.append((value, sink, key))
        return value


class Kept:
    """The indexer's selections of a walked window, kept from each segment's forward for its
    backward (int32, ``[B, n, topk]`` per segment and DSA layer: 2 GB for a 1,048,576-token window
    of cpu-small). On the CPU they go to an unlinked temporary file, which nothing outlives: the
    OS's page cache holds them while memory is free, and they never count as the process's own
    (resident) memory. Elsewhere they stay where they are."""

    def __init__(self):
        self.file = None
        self.places: dict = {}  # key -> (offset, shape) in the file, or the tensor itself
        self.size = 0

    def put(self, key, idx: torch.Tensor) -> None:
        idx = idx.to(torch.int32).contiguous()
        if idx.device.type != "cpu":
            self.places[key] = idx
            return
        if self.file is None:
            self.file = tempfile.TemporaryFile(prefix="megabase-walk-")
        data = idx.numpy().view(np.uint8).reshape(-1)
        os.pwrite(self.file.fileno(), data, self.size)
        self.places[key] = (self.size, tuple(idx.shape))
        self.size += data.size

    def take(self, key) -> torch.Tensor:
        """The selections put under ``key`` (int64, as the kernels take them), forgotten here."""
        place = self.places.pop(key)
        if torch.is_tensor(place):
            return place.long()
        offset, shape = place
        out = torch.empty(shape, dtype=torch.int32)
        got = os.preadv(self.file.fileno(), [out.numpy().view(np.uint8).reshape(-1)], offset)
        if got != out.numel() * 4:
            raise OSError(f"the walk's kept selections file returned {got} of "
                          f"{out.numel() * 4} bytes")
        return out.long()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class Segment(OneProcess):
    """One segment of a walked window, as the layers see their sequence (the top-level view:
    the embedding's and the seeds' calls). :meth:`layer` gives each layer its own view.
    ``grad``: the backward's pass of the segment (the forward's runs without autograd)."""

    def __init__(self, walk: Walk, index: int, grad: bool, layer: int = -1):
        self.walk, self.index, self.grad, self.layer_index = walk, index, grad, layer
        self.start, self.end = walk.piece(index)  # this rank's rows
        self.span = walk.bounds[index]  # the segment's, all ranks'
        self.first = walk.group.rank == 0  # the rank whose piece starts the segment
        self.final = walk.group.rank == walk.group.size - 1  # and the one that ends it
        self.last = index == len(walk.bounds) - 1
        self.fan = walk.fan and self.last  # this segment's rows all continue the one before
        self.calls: list = []  # what each call returned, in order (a recompute replays them)
        self.sinks = None  # the key gradient buffers of this layer's prefix (the backward's pass)
        self.sealed = False
        self.replayed = 0
        self.views: dict[int, Segment] = {}

    def layer(self, index: int) -> "Segment":
        if index not in self.views:
            self.views[index] = Segment(self.walk, self.index, self.grad, index)
        return self.views[index]

    def seal(self) -> None:
        """The segment's forward is done: calls from now on are a recompute's (replays)."""
        self.sealed = True
        for view in self.views.values():
            view.sealed = True

    def release(self) -> None:
        """The pass is over: what the calls returned is dropped (autograd's graph can hold the
        views in reference cycles, through checkpoint closures, until the garbage collector runs;
        the selections and borders they kept must not wait with them)."""
        for view in [self, *self.views.values()]:
            view.calls.clear()
            view.sinks = None

    def _next(self, kind: str):
        """``(key, replay)``: the call's key, and what it returned before if this is a replay."""
        if self.sealed:
            kind_then, result = self.calls[self.replayed]
            if kind_then != kind:
                raise RuntimeError(f"a recompute called {kind} where the forward called {kind_then}")
            self.replayed += 1
            return None, result
        return (self.layer_index, kind, len(self.calls)), None

    def _keep(self, kind: str, result):
        self.calls.append((kind, result))
        return result

    def offset(self, length: int) -> int:
        return self.start

    def fraction(self, length: int) -> float:
        return length / self.walk.T

    def prefix_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fan:
            return torch.cat([_rows(self.walk.ids, ids).to(ids.dtype), ids], 1)
        return self.walk.ids[:, : self.end].to(ids.dtype)

    def check_streaming(self) -> None:
        raise ValueError("a walked window is not streamed (state=...): each segment is a full pass")

    def before(self, x: torch.Tensor, n: int) -> torch.Tensor | None:
        """The ``n`` rows of ``x`` before this piece: the previous rank's last rows, or on the
        first rank the previous segment's (kept from the forward). In the backward they are a
        leaf (first rank) or come through the group's exchange, and the last rank's own last
        rows get the gradient the next segment sent back."""
        key, replay = self._next("before")
        if key is None:
            return replay
        w, g = self.walk, self.walk.group
        rows = x[:, x.shape[1] - n :]
        if not self.grad:
            every = g.gather(rows.detach())  # [P, B, n, ...]
            if not self.last:
                if x.shape[1] < n:
                    raise ValueError(f"segments of {x.shape[1]} tokens are shorter than a layer's "
                                     f"{n}-row border")
                w.tails[key, self.index] = every[-1].clone()
            prev = w.tails.get((key, self.index - 1)) if self.first else every[g.rank - 1]
            return self._keep("before", _rows(prev, x))
        kept = w.tails.get((key, self.index - 1))
        if not x.is_floating_point():
            prev = kept
            if g.size > 1:  # every rank joins the exchange
                every = g.gather(rows)
                prev = kept if self.first else every[g.rank - 1]
            return self._keep("before", _rows(prev, x))
        if self.final:
            sent = w.tail_grads.pop((key, self.index), None)
            if sent is not None:
                w.root(rows, sent)
        if kept is not None and self.first:
            kept = w.leaf(kept, w.tail_grads, (key, self.index - 1))
        if g.size == 1:
            return self._keep("before", _rows(kept, x))
        every = g.gather(rows)  # differentiable: its backward reaches every rank
        head = torch.zeros_like(every[0]) if kept is None else kept
        return self._keep("before", torch.cat([head[None], every[:-1]])[g.rank])

    def prefix(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``x`` preceded by the rows of every earlier piece, read from the window's buffers
        (the forward writes each segment's pieces there, every rank's, as the segments pass)."""
        key, replay = self._next("prefix")
        if key is None:
            return replay
        w, g = self.walk, self.walk.group
        if key not in w.keys:
            w.keys[key] = [x.new_empty(x.shape[0], w.T, *x.shape[2:]) for x in xs]
        buffers = w.keys[key]
        if self.fan:
            return self._keep("prefix", self._fanned(key, xs))
        if not self.grad:  # written once: the backward's pass recomputes the same rows
            a, b = self.span
            every = g.gather(_packed([x.detach() for x in xs]))  # [P, B, n, channels]
            _unpack(every.transpose(0, 1).flatten(1, 2), buffers, a, b)
            return self._keep("prefix", tuple(buf[:, : self.end] for buf in buffers))
        if key not in w.key_grads:
            w.key_grads[key] = [torch.zeros_like(buf) for buf in buffers]
        self.sinks = w.key_grads[key]
        out = _Prefix.apply(self, buffers, self.sinks, *xs)
        if w.fan:
            # no loss of its own here: a layer whose output reaches no later border (the last
            # DSA layer) must still send its keys what the fanned rows' queries gave them
            w.root(out[0], out[0].new_zeros(()).expand_as(out[0]))
        return self._keep("prefix", out)

    def _fanned(self, key, xs) -> tuple[torch.Tensor, ...]:
        """The fan-out segment's keys: the window's rows before it, the same for each of its
        rows, then each row's own; in the backward the kernels add into a gradient buffer per row,
        summed over the rows into the window's."""
        a, w = self.start, self.walk
        buffers = w.keys[key]
        if not self.grad:
            return tuple(torch.cat([_rows(buf[:, :a], x), x], 1) for buf, x in zip(buffers, xs))
        if key not in w.key_grads:
            w.key_grads[key] = [torch.zeros_like(buf) for buf in buffers]
        self.sinks = [x.new_zeros(x.shape[0], self.end, *x.shape[2:]) for x in xs]
        return _FanPrefix.apply(a, buffers, self.sinks, w.key_grads[key], *xs)

    def key_grads(self) -> list[torch.Tensor] | None:
        """In the backward's pass, the window's gradient buffers of the keys ``prefix`` returned:
        the kernels add into them where the rows are (earlier segments' rows and this one's)."""
        return self.sinks

    def selects(self) -> bool:
        return not self.grad

    def select(self, indexer) -> torch.Tensor:
        """The forward's pass runs ``indexer()`` and keeps its top-k (int32); the backward's pass
        takes them back instead of selecting again."""
        key, replay = self._next("select")
        if key is None:
            return replay
        if not self.grad:
            idx = indexer()
            self.walk.selected.put((key, self.index), idx)
            return self._keep("select", idx)
        return self._keep("select", self.walk.selected.take((key, self.index)))

    def kda(self, q, k, v, g, beta, initial_state=None, output_final_state=False, backend="auto"):
        """The KDA op over this piece (the group's op: the ranks fold their maps), the segment
        starting from the state the previous one ended in (a leaf in the backward), its final
        state kept for the next."""
        if initial_state is not None or output_final_state:
            self.check_streaming()
        key, replay = self._next("kda")
        group = self.walk.group
        if key is None:
            return group.kda(q, k, v, g, beta, initial_state=replay, output_final_state=True,
                             backend=backend)[0], None
        w = self.walk
        start = w.states.get((key, self.index)) if self.first else None
        if self.grad and start is not None:
            start = w.leaf(start, w.state_grads, (key, self.index - 1))
        start = _rows(start, q)
        o, final = group.kda(q, k, v, g, beta, initial_state=start, output_final_state=True,
                             backend=backend)
        if not self.grad and not self.last:
            w.states[key, self.index + 1] = group.gather(final.detach())[-1]
        if self.grad and self.final:
            sent = w.state_grads.pop((key, self.index), None)
            if sent is not None:
                w.root(final, sent)
        self._keep("kda", start)
        return o, None

    def balance(self, loss, load: torch.Tensor, share: torch.Tensor, length: int) -> torch.Tensor:
        """The sequence-wise balance loss of the whole window: its counts are summed in the
        forward (which returns zero here: :func:`walked_forward` adds the window's value once),
        and a segment's share of it is ``loss(counts, share, T)`` (linear in ``share``)."""
        key, replay = self._next("balance")
        w = self.walk
        if key is None:
            return loss(replay, share, w.T)
        if not self.grad:
            w.counts[key] = w.counts.get(key, 0) + w.group.reduce(load)
            fn, total = w.shares.get(key, (loss, 0))
            w.shares[key] = (fn, total + share.detach())
            self._keep("balance", None)
            return share.new_zeros(())
        self._keep("balance", w.counts[key])
        return loss(w.counts[key], share, w.T)


class _Prefix(torch.autograd.Function):
    """``x [B, n, ...]`` (a piece's rows) -> the window buffer's rows ``[:, :end]`` (earlier
    pieces', then ``x``'s). The gradient of those rows gathers in ``grads`` (``[B, T, ...]``): the
    kernels add into it in place (``Segment.key_grads``), and a gradient that reaches this node
    is added too. Then the segment's rows are summed over the group (every rank's queries read
    them), and ``x`` gets its own rows', which hold what later segments' queries added before."""

    @staticmethod
    def forward(ctx, segment, buffers, grads, *xs):
        # its numbers, not the segment: the segment keeps this node's outputs (a cycle would
        # keep the pass's whole graph alive until the garbage collector ran)
        ctx.span, ctx.rows, ctx.grads = segment.span, (segment.start, segment.end), grads
        ctx.group = segment.walk.group
        ctx.set_materialize_grads(False)  # a kernel that added in place sends none
        return tuple(buf[:, : segment.end] for buf in buffers)

    @staticmethod
    def backward(ctx, *outs):
        (a, b), (start, end), group = ctx.span, ctx.rows, ctx.group
        for g, acc in zip(outs, ctx.grads):
            if g is not None:
                acc[:, :end] += g
        if group.size > 1:
            _unpack(group.reduce(_packed([acc[:, a:b] for acc in ctx.grads])), ctx.grads, a, b)
        return (None, None, None, *(acc[:, start:end].clone() for acc in ctx.grads))


class _FanPrefix(torch.autograd.Function):
    """``x [G, n, ...]`` (the fan-out segment's rows) -> ``[G, a + n, ...]``: the window buffer's
    first ``a`` rows (its one row, the same for each of the ``G``) then ``x``. The kernels add the
    gradient of those rows into ``sinks`` (``[G, a + n, ...]``) in place; a gradient that reaches
    this node is added too, then the first ``a`` rows' are summed over ``G`` into the window's
    gradient buffer ``grads`` and ``x`` gets the rest."""

    @staticmethod
    def forward(ctx, a, buffers, sinks, grads, *xs):
        ctx.a, ctx.sinks, ctx.grads = a, sinks, grads
        ctx.set_materialize_grads(False)
        return tuple(torch.cat([_rows(buf[:, :a], x), x], 1) for buf, x in zip(buffers, xs))

    @staticmethod
    def backward(ctx, *outs):
        a = ctx.a
        for g, acc, window in zip(outs, ctx.sinks, ctx.grads):
            if g is not None:
                acc += g
            window[:, :a] += acc[:, :a].sum(0, keepdim=True)
        return (None, None, None, None, *(acc[:, a:].clone() for acc in ctx.sinks))


def _rows(prev: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``prev [1, ...]`` (the one row before a fan-out segment) for each of ``x``'s rows; as is
    where the rows already match."""
    if prev is None or prev.shape[0] == x.shape[0]:
        return prev
    return prev.expand(x.shape[0], *prev.shape[1:]).contiguous()


def _packed(xs: list[torch.Tensor]) -> torch.Tensor:
    """``[B, n, ...]`` tensors side by side as ``[B, n, channels]``: one exchange for them all."""
    return torch.cat([x.flatten(2) for x in xs], dim=-1)


def _unpack(rows: torch.Tensor, buffers: list[torch.Tensor], a: int, b: int) -> None:
    """:func:`_packed` ``rows [B, b - a, channels]`` written back into ``buffers[:, a:b]``."""
    widths = [buf[0, 0].numel() for buf in buffers]
    for buf, part in zip(buffers, rows.split(widths, dim=-1)):
        buf[:, a:b] = part.unflatten(-1, buf.shape[2:])


def unwalkable(model, ctx: Context) -> str | None:
    """Why a call of ``model`` with ``ctx`` cannot be walked, or None when it can."""
    if ctx.dense_warmup or model.cfg.indexer_mode == "dense":
        return "the dense indexer warm-up attends over whole rows: it is not walked"
    if ctx.replay is not None or ctx.capture is not None or ctx.state is not None:
        return "routing replay, selection capture and streaming are not walked"
    return None


def walked_forward(model, input_ids: torch.Tensor, targets: torch.Tensor,
                   loss_mask: torch.Tensor | None = None, segment: int = 8192,
                   ctx: Context | None = None, between=None):
    """``model(input_ids, targets, loss_mask)`` for a training step, walked in segments of
    ``segment`` tokens: the same :class:`~megabase.model.LMOutput` (loss, lm_loss and aux_loss
    differentiable, their backward the walk's), with one segment's activations alive at a time.
    ``ctx``: the call's context (the dense indexer warm-up attends over whole rows and is not
    walked); with a context-parallel sequence (``ctx.sequence`` of ``P`` ranks) every rank passes
    the whole window and the group walks it in segments of ``P * segment`` tokens, each rank
    holding ``segment`` of each, so the result is this rank's part (its tokens' loss; its
    parameter gradients, summed over the group, are the window's). ``between``: called with no
    arguments after each of the ``2 * len(segments)`` passes (forward and backward), once the
    pass's tensors are freed: the trainer's progress and heap trim."""
    ctx = model.context() if ctx is None else ctx
    reason = unwalkable(model, ctx)
    if reason:
        raise ValueError(reason)
    if loss_mask is None:
        loss_mask = torch.ones_like(targets, dtype=torch.bool)
    group, T = ctx.sequence, input_ids.shape[1]
    if T % group.size:
        raise ValueError(f"a {T:,}-token window does not split into {group.size} equal "
                         "context-parallel pieces")
    walk = Walk(input_ids, segment_bounds(T, segment * group.size), between, group)
    params = [p for p in model.parameters() if p.requires_grad]
    report: dict = {}
    lm, aux = _Walked.apply(walk, model, targets, loss_mask, ctx, report, *params)
    return LMOutput(lm + aux, lm, report["nll"], report["mask"], aux, report["expert_load"],
                    report["n_tokens"], expert_margins=report["expert_margins"],
                    routing=report["routing"], router_choice=report["router_choice"],
                    indexer_kl=report["indexer_kl"])


def _segment_call(model, walk: Walk, index: int, grad: bool, targets, loss_mask, ctx: Context):
    a, b = walk.piece(index)
    seq = Segment(walk, index, grad)
    out = model(walk.ids[:, a:b], targets[:, a:b], loss_mask=loss_mask[:, a:b],
                ctx=replace(ctx, sequence=seq, train_indexer=True))
    return out, seq


class _Walked(torch.autograd.Function):
    """The walked step as one autograd node: forward ``(lm_loss, aux_loss)``; backward the reverse
    walk, returning every parameter's gradient (so DDP's hooks see one gradient per parameter)."""

    @staticmethod
    def forward(fn_ctx, walk, model, targets, loss_mask, ctx, report, *params):
        lm_sum = aux = 0.0
        n = 0
        nll, masks, loads, margins, used, own, kls = [], [], [], [], [], [], []
        with torch.no_grad():
            for i in range(len(walk.bounds)):
                a, b = walk.piece(i)
                out, seq = _segment_call(model, walk, i, False, targets, loss_mask, ctx)
                seq.release()
                lm_sum = lm_sum + out.lm_loss.double() * out.n_tokens
                aux = aux + out.aux_loss.double()
                n += out.n_tokens
                nll.append(out.nll)
                masks.append(out.mask)
                loads.append(out.expert_load)
                margins.append(out.expert_margins)
                used.append(out.routing)
                own.append(out.router_choice)
                if out.indexer_kl is not None:
                    kls.append(out.indexer_kl * ((b - a) / walk.T))
                del out
                walk.between()
            B = walk.ids.shape[0]
            for key, (loss, share) in walk.shares.items():
                aux = aux + loss(walk.counts[key], share, walk.T).double() / B
        fn_ctx.walk, fn_ctx.model, fn_ctx.ctx = walk, model, ctx
        fn_ctx.targets, fn_ctx.loss_mask, fn_ctx.n = targets, loss_mask, n
        fn_ctx.params = params
        report.update(
            nll=torch.cat(nll, 1), mask=torch.cat(masks, 1), n_tokens=n,
            expert_load=sum(loads), expert_margins=sum(margins),
            routing=[torch.cat(r, 1) for r in zip(*used)],
            router_choice=[torch.cat(r, 1) for r in zip(*own)],
            indexer_kl=sum(kls) if kls else None)
        lm = (lm_sum / max(n, 1)).float()
        return lm, torch.as_tensor(aux, dtype=torch.float32)

    @staticmethod
    def backward(fn_ctx, g_lm, g_aux):
        walk, model, params = fn_ctx.walk, fn_ctx.model, fn_ctx.params
        grads: list[torch.Tensor | None] = [None] * len(params)
        for i in reversed(range(len(walk.bounds))):
            with torch.enable_grad():
                out, seq = _segment_call(model, walk, i, True, fn_ctx.targets, fn_ctx.loss_mask,
                                         fn_ctx.ctx)
                seq.seal()
                objective = out.lm_loss * (out.n_tokens / max(fn_ctx.n, 1)) * g_lm + \
                    out.aux_loss * g_aux
                walk.backward(params, grads, objective)
            walk.send_back(i)
            seq.release()
            del out, objective
            walk.between()
        walk.selected.close()
        return (None,) * 6 + tuple(grads)


def border_bytes(model, length: int = 64) -> dict[str, int]:
    """Bytes per window token that a walked step of ``model`` keeps whatever its segment size,
    read from a no-grad walk of two ``length``-token segments of a probe window: ``keys`` (every
    DSA layer's key, value and index-key buffers; their gradients take as much again),
    ``selected`` (the indexer's top-k, kept from the forward for the backward: in a file, see
    :class:`Kept`), ``layer`` (the
    largest one layer's keys: where the C kernels are not built, the backward makes their
    gradient as one full-window tensor per segment), ``report`` (the per-token outputs gathered
    over the window: NLL, mask, routing)."""
    ids = torch.zeros(1, 2 * length, dtype=torch.long)
    walk = Walk(ids, segment_bounds(2 * length, length))
    params = [p for p in model.parameters() if p.requires_grad]
    report: dict = {}
    with torch.no_grad():
        _Walked.apply(walk, model, ids, ids < 4, model.context(), report, *params)
    per_layer = [sum(b[0, 0].numel() * b.element_size() for b in bufs) for bufs in walk.keys.values()]
    per_token = [t for v in report.values() for t in (v if isinstance(v, list) else [v])
                 if torch.is_tensor(t) and t.dim() > 1 and t.shape[1] == 2 * length]
    selected = walk.selected.size // (2 * length)
    return {"keys": sum(per_layer), "selected": selected, "layer": max(per_layer, default=0),
            "report": sum(t[0, 0].numel() * t.element_size() for t in per_token)}
