"""Rewards of a design task that need no oracle model: transcription-factor motif hits scored with
JASPAR position weight matrices, minus synthesis constraints; or any Python callable.

A reward maps ``tokens [N, L]`` (A/C/G/T ids) to ``[N]`` floats. :func:`build_reward` makes the
one a config names, :func:`heldout_check` the check the policy is not trained on.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megabase.core.errors import InputError
from megabase.core.vocab import SYMBOLS, is_gc, tokenize

from .config import RewardConfig

FLOAT32_MAX = float(np.finfo(np.float32).max)  # a reward's largest magnitude
PSEUDOCOUNT = 0.8  # per base, spread as JASPAR's own tools do before taking log-odds


@dataclass(frozen=True)
class PWM:
    """A motif's log-odds matrix ``[w, 4]`` (natural log, uniform background) and its range."""

    name: str
    log_odds: np.ndarray

    @property
    def width(self) -> int:
        return self.log_odds.shape[0]

    @classmethod
    def from_counts(cls, name: str, counts: np.ndarray) -> "PWM":
        """``counts [w, 4]`` (A, C, G, T columns) -> log-odds with a pseudocount."""
        counts = np.asarray(counts, dtype=np.float64)
        probs = (counts + PSEUDOCOUNT / 4) / (counts.sum(1, keepdims=True) + PSEUDOCOUNT)
        return cls(name, np.log(probs / 0.25))

    def relative_scores(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens [N, L]`` -> ``[N, L - w + 1]``: the best strand's score of each word, scaled so
        the worst possible word is 0 and the best 1 (JASPAR's relative score)."""
        w = self.width
        if tokens.shape[1] < w:
            return np.zeros((tokens.shape[0], 0))
        words = np.lib.stride_tricks.sliding_window_view(tokens, w, axis=1)  # [N, P, w]
        cols = np.arange(w)
        fwd = self.log_odds[cols, words].sum(-1)
        rc = self.log_odds[::-1, ::-1]  # the matrix of the reverse-complement strand
        rev = rc[cols, words].sum(-1)
        lo, hi = self.log_odds.min(1).sum(), self.log_odds.max(1).sum()
        return (np.maximum(fwd, rev) - lo) / (hi - lo)

    def hits(self, tokens: np.ndarray, threshold: float) -> np.ndarray:
        """Sites scoring at least ``threshold`` on either strand, per sequence: ``[N]``. Sites do
        not overlap: read left to right, a site takes its ``width`` bases (a factor occupies its
        site; counting every overlapping word let a short repeat score 17 "sites" in 100 bases)."""
        good = self.relative_scores(tokens) >= threshold
        out = np.zeros(good.shape[0], dtype=np.int64)
        for i, row in enumerate(good):
            free = 0
            for p in np.flatnonzero(row):
                if p >= free:
                    out[i] += 1
                    free = p + self.width
        return out


def jaspar_pwms(ids: Sequence[str], release: str) -> list[PWM]:
    """The matrices ``ids`` (``MA0139.2``) of a JASPAR release, from pyjaspar's bundled database."""
    try:
        from pyjaspar import jaspardb
    except ImportError:
        raise InputError("motif rewards need pyjaspar: pip install 'megabase[rl]'",
                         options=("reward",)) from None
    import warnings

    try:
        db = jaspardb(release=release)
    except Exception:
        raise InputError(f"reward.release {release!r} is not a JASPAR release pyjaspar ships",
                         options=("reward",)) from None
    out = []
    for mid in ids:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            motif = db.fetch_motif_by_id(mid)
        if motif is None:
            raise InputError(f"reward motif {mid!r} is not in {release} (ids look like MA0139.2)",
                             options=("reward",))
        counts = np.array([[motif.counts[b][j] for b in "ACGT"] for j in range(motif.length)])
        out.append(PWM.from_counts(f"{mid} {motif.name}", counts))
    return out


def gc_violations(tokens: np.ndarray, window: int, lo: float, hi: float) -> np.ndarray:
    """Share of the ``window``-base sliding windows whose GC is outside ``[lo, hi]``, times the
    number of whole windows the sequence holds (a sequence out of band throughout costs as many
    violations as it has windows): ``[N]`` floats."""
    N, L = tokens.shape
    if L < window:
        return np.zeros(N)
    gc = is_gc(tokens).astype(np.int32)
    csum = np.concatenate([np.zeros((N, 1), np.int32), gc.cumsum(1)], 1)
    frac = (csum[:, window:] - csum[:, :-window]) / window
    return ((frac < lo) | (frac > hi)).mean(1) * (L // window)


def long_runs(tokens: np.ndarray, longest: int) -> np.ndarray:
    """Runs of one base longer than ``longest``, per sequence: ``[N]``."""
    out = np.zeros(tokens.shape[0])
    for i, row in enumerate(tokens):
        edges = np.flatnonzero(np.diff(row) != 0)
        lengths = np.diff(np.concatenate([[-1], edges, [len(row) - 1]]))
        out[i] = (lengths > longest).sum()
    return out


def site_count(tokens: np.ndarray, sites: Sequence[str]) -> np.ndarray:
    """Occurrences of each site or its reverse complement (a palindrome once): ``[N]``."""
    out = np.zeros(tokens.shape[0])
    for site in sites:
        word = tokenize(site.upper()).astype(np.int64)
        words = {tuple(word.tolist()), tuple((3 - word[::-1]).tolist())}
        if tokens.shape[1] < len(word):
            continue
        view = np.lib.stride_tricks.sliding_window_view(tokens, len(word), axis=1)
        for w in words:
            out += (view == np.array(w)).all(-1).sum(1)
    return out


def canonical_words(tokens: np.ndarray, k: int) -> np.ndarray:
    """``tokens [..., L]`` (A/C/G/T ids, N allowed) -> ``[..., L - k + 1]`` int64: each ``k``-base
    word's code, the smaller of its own and its reverse complement's (a word and its other strand
    are one word); -1 where the word holds a base that is not A/C/G/T."""
    view = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.int64), k, axis=-1)
    weights = 4 ** np.arange(k - 1, -1, -1, dtype=np.int64)
    fwd = (np.minimum(view, 3) * weights).sum(-1)
    rev = ((3 - np.minimum(view, 3)[..., ::-1]) * weights).sum(-1)
    return np.where((view > 3).any(-1), -1, np.minimum(fwd, rev))


def shared_words(tokens: np.ndarray, context: np.ndarray, k: int) -> np.ndarray:
    """Positions of each design ``tokens [N, L]`` whose ``k``-base word occurs in ``context [P]``
    (the bases the design is inserted after) on either strand: ``[N]``. A probe, guide or insert
    that shares a word with its neighbourhood can bind or recombine there."""
    N, L = tokens.shape
    if k < 1 or L < k or len(context) < k:
        return np.zeros(N)
    near = canonical_words(np.asarray(context), k)
    near = np.unique(near[near >= 0])
    return np.isin(canonical_words(tokens, k), near).sum(1).astype(np.float64)


def repeats(tokens: np.ndarray, k: int) -> np.ndarray:
    """Positions whose ``k``-base word already occurred earlier in the sequence, directly or as
    its reverse complement (repeats are what DNA synthesis and assembly fail on): ``[N]``."""
    N, L = tokens.shape
    out = np.zeros(N)
    if k < 1 or L < k:
        return out
    for i, row in enumerate(canonical_words(tokens, k)):
        out[i] = len(row) - len(np.unique(row))
    return out


class MotifReward:
    """``sum over motifs of hits - penalty * (GC violations + long runs + forbidden sites +
    repeats + words shared with the neighbourhood)``; the last only when a context is given
    and ``neighbourhood_k`` is set."""

    def __init__(self, cfg: RewardConfig, motifs: Sequence[str] | None = None,
                 threshold: float | None = None):
        self.cfg = cfg
        self.pwms = jaspar_pwms(cfg.motifs if motifs is None else motifs, cfg.release)
        self.threshold = cfg.threshold if threshold is None else threshold

    def parts(self, tokens: np.ndarray, context: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """``tokens [N, L]``, the designs; ``context [P]``, the prompt they follow."""
        c = self.cfg
        hits = sum(p.hits(tokens, self.threshold) for p in self.pwms)
        out = {"motif_hits": np.asarray(hits, dtype=np.float64),
               "gc_violations": gc_violations(tokens, c.gc_window, c.gc_min, c.gc_max),
               "long_runs": long_runs(tokens, c.max_homopolymer),
               "sites": site_count(tokens, c.sites),
               "repeats": repeats(tokens, c.repeat_k)}
        if c.neighbourhood_k and context is not None:
            out["neighbourhood_words"] = shared_words(tokens, context, c.neighbourhood_k)
        return out

    def __call__(self, tokens: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        p = self.parts(tokens, context)
        return p.pop("motif_hits") - self.cfg.penalty * sum(p.values())


class CallableReward:
    """A user's ``function(sequences: list[str]) -> sequence of floats``, checked on every call."""

    def __init__(self, spec: str, base: Path):
        self.spec = spec
        self.fn = load_callable(spec, base)

    def __call__(self, tokens: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        """``tokens [N, L]`` -> ``[N]`` float64 rewards, each finite in float32 (the precision
        they travel and train in); ``context``, the prompt, is not passed to the function."""
        seqs = ["".join(SYMBOLS[t] for t in row.tolist()) for row in tokens]
        try:
            values = self.fn(seqs)
        except SystemExit as exc:  # sys.exit() in a reward would end megabase with its code
            raise InputError(f"reward.function {self.spec!r} called sys.exit({exc.code!r}) when "
                             "called; a reward must return its numbers") from None
        except Exception as exc:
            raise InputError(f"reward.function {self.spec!r} raised {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        try:
            out = np.asarray(values, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise InputError(f"reward.function {self.spec!r} must return numbers, got "
                             f"{type(values).__name__}") from None
        if out.shape[0] != len(seqs):
            raise InputError(f"reward.function {self.spec!r} must return one finite number per "
                             f"sequence ({len(seqs)}), got {out.shape[0]} numbers")
        # +-1e39 is finite in float64 but infinite in float32, where it became NaN advantages
        with np.errstate(over="ignore", invalid="ignore"):  # the overflow is what is checked
            bad = np.flatnonzero(~np.isfinite(out.astype(np.float32)))
        if len(bad):
            raise InputError(f"reward.function {self.spec!r} must return one finite number per "
                             f"sequence (within +-{FLOAT32_MAX:.3g}), got {float(out[bad[0]])} for "
                             f"sequence {bad[0] + 1} of {len(seqs)}"
                             + (f" ({len(bad)} such values)" if len(bad) > 1 else ""))
        return out


def load_callable(spec: str, base: Path) -> Callable:
    """``module:function`` or ``path/file.py:function`` (relative to ``base``)."""
    if ":" not in spec:
        raise InputError(f"reward.function {spec!r}: expected module:function or file.py:function")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where) if Path(where).is_absolute() else base / where
            if not path.is_file():
                raise InputError(f"reward.function {spec!r}: file not found", path)
            module_spec = importlib.util.spec_from_file_location(f"megabase_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except SystemExit as exc:  # else sys.exit(0) at import ended `megabase rl` with 0, silently
        raise InputError(f"reward.function {spec!r}: {where} called sys.exit({exc.code!r}) when "
                         "imported; a reward module must only define its function") from None
    except Exception as exc:
        raise InputError(f"reward.function {spec!r} could not be loaded: {type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InputError(f"reward.function {spec!r}: {where} has no function {name!r}")
    return fn


def build_reward(cfg: RewardConfig, base: Path) -> Callable[[np.ndarray], np.ndarray]:
    return CallableReward(cfg.function, base) if cfg.function else MotifReward(cfg)


def heldout_check(cfg: RewardConfig) -> MotifReward | None:
    """Hits of other matrices at another threshold, with the same constraints; None without any."""
    if not cfg.heldout_motifs:
        return None
    return MotifReward(cfg, cfg.heldout_motifs, cfg.heldout_threshold)


def diversity(tokens: np.ndarray, k: int = 6) -> dict[str, float]:
    """Mean pairwise Hamming distance (per base) and distinct ``k``-mers over all sequences (share
    of the ``4**k`` possible and of the k-mer positions)."""
    N, L = tokens.shape
    if N > 1:
        same = (tokens[:, None, :] == tokens[None, :, :]).mean(-1)
        hamming = float((1 - same)[np.triu_indices(N, 1)].mean())
    else:
        hamming = math.nan
    if L < k:
        return {"hamming": hamming, "distinct_kmers": 0.0}
    view = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.int64), k, axis=1)
    codes = (view * (4 ** np.arange(k - 1, -1, -1))).sum(-1)
    distinct = len(np.unique(codes))
    return {"hamming": hamming, "distinct_kmers": distinct / min(codes.size, 4**k)}
