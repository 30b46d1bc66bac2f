"""The copy-model reference: what a DNA compressor's repeat models get from a window's context.

Order-k Markov chains fitted on the training regions (as the baselines are) are mixed online with
exact-match copy models that look back only within the scored window, as GeCo3 and JARVIS mix
their context models with repeat models:

- one copy model per seed length (default 12, 16 and 20 bases) and strand: where the last ``s``
  bases occurred earlier in the window (the most recent occurrence), it predicts the base that
  followed them (forward), or the complement of the base before a reverse-complement occurrence;
- it follows that occurrence base by base through mismatches until more than ``max_miss`` of its
  last 16 predictions missed (GeCo3's substitution-tolerant context models), then seeds again;
- its confidence is learned per state (its run of hits since the last miss, bucketed 0, 1, 2-3,
  4-7, 8-15, 16+, times its misses among the last 16, 0..3+): ``p`` on the predicted base,
  ``(1 - p) / 3`` on each other;
- the mixture is geometric (logistic mixing, as in the PAQ/cmix family): ``log p(y) =
  sum_i w_i log q_i(y) - log Z``, one weight set per mixer context (the longest run of any active
  copy model, 7 sets), one gradient step of ``lr`` on ``log p(x_t)`` after every base.

The mixer weights and confidences start from a state learned on a held-aside tenth of the training
regions (at most :data:`ASIDE_MAX` bases, scored by chains fitted on the rest; the chains then
count it too) and adapt within each window; every window (and every piece of a truncation
control) starts from that state again, so the reference's context gain is what the window's own
earlier bases give it, as for the model.

``CopyModel.nll(tokens [n]) -> float64 [n]`` (nats, NaN where the target is not a base) is a
scorer (:mod:`megabase.eval.score`). The C kernel (``copymodel.c``) does the per-base loop;
:func:`reference_nll` is the plain-Python definition it is tested against.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megabase.core.vocab import N_BASES
from megabase.kernels import native

from .markov import MAX_ORDER, MarkovModel

N_CTX, N_CONF, HISTORY = 7, 24, 16
BLOCK = 2048  # positions whose chain terms the kernel gathers at once (copymodel.c: BLOCK)
ASIDE_FRACTION, ASIDE_MAX, ASIDE_WINDOW = 0.1, 2_000_000, 65_536
MAX_SEED = 32


@dataclass(frozen=True)
class CopySpec:
    """What the reference mixes (defaults: those of every report)."""

    orders: tuple[int, ...] = (2, 4, 8, 12)  # Markov chains, fitted on the training regions
    seeds: tuple[int, ...] = (12, 16, 20)  # seed lengths of the copy models (each strand)
    max_miss: int = 4  # a match is dropped when more of its last 16 predictions missed
    lr: float = 0.02  # the mixer's learning rate

    def check(self) -> "CopySpec":
        if not self.orders or any(not 0 <= o <= MAX_ORDER for o in self.orders):
            raise ValueError(f"copy model orders must be Markov orders 0..{MAX_ORDER}, got "
                             f"{list(self.orders)}")
        if not self.seeds or any(not 1 <= s <= MAX_SEED for s in self.seeds) or \
                len(self.seeds) > 32:
            raise ValueError(f"copy model seed lengths must be 1..{MAX_SEED}, got {list(self.seeds)}")
        if not 0 <= self.max_miss < HISTORY:
            raise ValueError(f"max_miss must be within 0..{HISTORY - 1}, got {self.max_miss}")
        if not self.lr >= 0:
            raise ValueError(f"the mixer's lr must be >= 0, got {self.lr}")
        return self

    def label(self) -> str:
        return (f"copy model (Markov {'/'.join(map(str, self.orders))} + copies "
                f"{'/'.join(map(str, self.seeds))}, both strands)")


def initial_state(spec: CopySpec) -> tuple[np.ndarray, np.ndarray]:
    """The mixer's weights ``[N_CTX, M + 2S]`` (the chains' geometric mean, copy models at 0.3)
    and the copy models' confidence counts ``[2S, N_CONF, 2]`` (hits, predictions: 1 of 2)."""
    M, E = len(spec.orders), 2 * len(spec.seeds)
    weights = np.zeros((N_CTX, M + E))
    weights[:, :M] = 1.0 / M
    weights[:, M:] = 0.3
    conf = np.zeros((E, N_CONF, 2))
    conf[..., 0], conf[..., 1] = 1.0, 2.0
    return weights, conf


def _lib():
    P, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    return native.bind(str(Path(__file__).with_name("copymodel.c")), {
        "megabase_copy_score": [P, I, P, I, P, I, D, P, I, I, D, P, P, P, P, P, P],
        "megabase_copy_slots": [I]},
        extra=("-ffp-contract=off",))


class Workspace:
    """The kernel's seed tables and chain terms, kept between windows (fresh pages cost more than
    scoring a short window)."""

    def __init__(self):
        self.slots = self.terms = np.empty(0)

    def get(self, lib, n: int, n_seeds: int, n_chains: int):
        lib.megabase_copy_slots.restype = ctypes.c_int64
        words = 2 * n_seeds * lib.megabase_copy_slots(n)  # a key and a position per slot
        if len(self.slots) < words:
            self.slots = np.empty(words, np.uint64)
        if len(self.terms) < BLOCK * n_chains * 4:
            self.terms = np.empty(BLOCK * n_chains * 4)
        return self.slots.ctypes.data, self.terms.ctypes.data


def score_window(tokens: np.ndarray, markov: MarkovModel, spec: CopySpec, weights: np.ndarray,
                 conf: np.ndarray, stats: np.ndarray | None = None,
                 work: Workspace | None = None) -> np.ndarray:
    """``-log p(x_t)`` per position (nats, NaN off bases) of one window; ``weights`` and ``conf``
    (:func:`initial_state`'s shapes, float64) are updated in place. ``markov``: the fitted chains
    (orders up to ``max(spec.orders)``). ``stats`` (int64 [3]) counts matches started,
    predictions made and hits; ``work`` is reused memory (a fresh one by default). The C kernel,
    or :func:`reference_nll` where it cannot be built."""
    tokens = np.ascontiguousarray(tokens, dtype=np.uint8)
    stats = np.zeros(3, np.int64) if stats is None else stats
    if markov.order < max(spec.orders):
        raise ValueError(f"the chains are fitted to order {markov.order}, the spec mixes "
                         f"{max(spec.orders)}")
    lib = _lib()
    if lib is None:
        return reference_nll(tokens, markov, spec, weights, conf, stats)
    kmax = max(spec.orders)
    counts = [np.ascontiguousarray(c, dtype=np.int64) for c in markov.counts[: kmax + 1]]
    pointers = np.array([c.ctypes.data for c in counts], dtype=np.uint64)
    orders = np.asarray(spec.orders, dtype=np.int64)
    seeds = np.asarray(spec.seeds, dtype=np.int64)
    for a in (weights, conf, stats):
        if not a.flags.c_contiguous:
            raise ValueError("weights, conf and stats must be C-contiguous")
    out = np.empty(len(tokens))
    work = work or Workspace()  # held here: the kernel writes into its arrays
    status = lib.megabase_copy_score(
        tokens.ctypes.data, len(tokens), pointers.ctypes.data, kmax, orders.ctypes.data,
        len(orders), markov.alpha, seeds.ctypes.data, len(seeds), spec.max_miss, spec.lr,
        weights.ctypes.data, conf.ctypes.data, out.ctypes.data, stats.ctypes.data,
        *work.get(lib, len(tokens), len(seeds), len(orders)))
    if status != 0:
        raise ValueError(f"the copy model cannot score {len(tokens):,} bases with {len(seeds)} "
                         f"seed lengths and {len(orders)} chains")
    return out


def _bucket(run: int) -> int:
    return run if run < 2 else 2 if run < 4 else 3 if run < 8 else 4 if run < 16 else 5


def reference_nll(tokens, markov: MarkovModel, spec: CopySpec, weights, conf,
                  stats=None) -> np.ndarray:
    """:func:`score_window` in plain Python (dictionaries of k-mer ends): the definition. A chain
    enters the mixture as ``log(n(c, y) + alpha)``: its normaliser, the same for every ``y``,
    cancels in the geometric mixture and in the mixer's gradient."""
    tokens = [int(v) for v in tokens]
    seeds, M = list(spec.seeds), len(spec.orders)
    E = 2 * len(seeds)
    stats = np.zeros(3, np.int64) if stats is None else stats
    last: list[dict[tuple, int]] = [{} for _ in seeds]
    active, ptr, run, hist = [False] * E, [0] * E, [0] * E, [0] * E
    out = np.empty(len(tokens))
    for t, x in enumerate(tokens):
        clean = 0  # clean bases ending at t - 1, as far as a seed or a chain looks
        while clean < min(t, max(*seeds, *spec.orders)) and tokens[t - 1 - clean] < N_BASES:
            clean += 1
        for e in range(E):
            s = seeds[e // 2]
            if active[e] or clean < s:
                continue
            kmer = tuple(tokens[t - s : t])
            key = kmer if e % 2 == 0 else tuple(3 - b for b in reversed(kmer))
            end = last[e // 2].get(key)
            if end is None:
                continue
            at = end + 1 if e % 2 == 0 else end - s
            if at < 0 or tokens[at] >= N_BASES:
                continue
            active[e], ptr[e], run[e], hist[e] = True, at, 0, 0
            stats[0] += 1
        for j, s in enumerate(seeds):
            if clean >= s:
                last[j][tuple(tokens[t - s : t])] = t - 1
        if x >= N_BASES:
            out[t] = math.nan
            active = [False] * E
            continue
        ctx = 0
        for e in range(E):
            if active[e] and tokens[ptr[e]] >= N_BASES:
                active[e] = False
            if active[e]:
                ctx = max(ctx, 1 + _bucket(run[e]))
        lm = []
        for order in spec.orders:
            k = min(clean, order)
            code = 0
            for b in tokens[t - k : t][::-1] if k else []:  # the newest base most significant
                code = code * 4 + b
            row = markov.counts[k][code * 4 : code * 4 + 4]
            lm.append([math.log(float(c) + markov.alpha) for c in row])
        w = weights[ctx]
        z = [sum(float(w[m]) * float(lm[m][y]) for m in range(M)) for y in range(4)]
        lq, pred, state = {}, {}, {}
        for e in range(E):
            if not active[e]:
                continue
            pred[e] = tokens[ptr[e]] if e % 2 == 0 else 3 - tokens[ptr[e]]
            state[e] = _bucket(run[e]) * 4 + min(bin(hist[e]).count("1"), 3)
            ph = float(conf[e, state[e], 0]) / float(conf[e, state[e], 1])
            hit, other = math.log(ph), math.log((1.0 - ph) / 3.0)
            lq[e] = [hit if y == pred[e] else other for y in range(4)]
            for y in range(4):
                z[y] += float(w[M + e]) * lq[e][y]
        top = max(z)
        p = [math.exp(v - top) for v in z]
        total = sum(p)
        p = [v / total for v in p]
        out[t] = -(z[x] - top - math.log(total))
        for m in range(M):
            expect = sum(p[y] * float(lm[m][y]) for y in range(4))
            w[m] += spec.lr * (float(lm[m][x]) - expect)
        for e in range(E):
            if not active[e]:
                continue
            expect = sum(p[y] * lq[e][y] for y in range(4))
            w[M + e] += spec.lr * (lq[e][x] - expect)
            good = pred[e] == x
            conf[e, state[e], 0] += float(good)
            conf[e, state[e], 1] += 1.0
            stats[1] += 1
            stats[2] += good
            hist[e] = ((hist[e] << 1) | (not good)) & 0xFFFF
            run[e] = run[e] + 1 if good else 0
            ptr[e] += 1 if e % 2 == 0 else -1
            if bin(hist[e]).count("1") > spec.max_miss or ptr[e] < 0:
                active[e] = False
    return out


class CopyModel:
    """The reference, fitted on training sequences; :meth:`nll` scores one window (a scorer)."""

    def __init__(self, spec: CopySpec | None = None):
        self.spec = (spec or CopySpec()).check()
        self.markov = MarkovModel(max(self.spec.orders))
        self.weights, self.conf = initial_state(self.spec)
        self.stats = np.zeros(3, np.int64)  # over every window scored: matches, predictions, hits
        self.work = Workspace()

    def fit(self, sequences: list[np.ndarray]) -> "CopyModel":
        """Fit the chains on ``sequences`` (``uint8`` tokens each) and the mixer's starting state on
        their held-aside tails (a tenth of each, :data:`ASIDE_MAX` bases at most in all), scored by
        chains that have not seen them; the chains then count the tails too."""
        total = sum(len(s) for s in sequences)
        share = min(ASIDE_FRACTION, ASIDE_MAX / total) if total else 0.0
        tails = []
        for seq in sequences:
            cut = len(seq) - int(len(seq) * share)
            self.markov.fit(seq[:cut])
            tails.append(seq[cut:])
        for tail in tails:
            for start in range(0, len(tail), ASIDE_WINDOW):
                window = np.asarray(tail[start : start + ASIDE_WINDOW])
                if (window < N_BASES).any():
                    score_window(window, self.markov, self.spec, self.weights, self.conf,
                                 work=self.work)
        for tail in tails:
            self.markov.fit(tail)
        return self

    def nll(self, tokens: np.ndarray) -> np.ndarray:
        """``-log p(x_t | x_<t in the window)`` (nats), NaN where the target is not a base; the
        mixer starts from the fitted state and adapts within the window only."""
        weights, conf = self.weights.copy(), self.conf.copy()
        return score_window(tokens, self.markov, self.spec, weights, conf, self.stats, self.work)

    __call__ = nll
