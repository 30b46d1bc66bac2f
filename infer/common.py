"""What every use of a trained model shares: the checkpoint, the store, regions, output files."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megabase.core.atomic import remove_stale_temps
from megabase.core.locks import holding
from megabase.data import InputError, TokenStore
from megabase.data.names import parse_region
from megabase.model import load_checkpoint
from megabase.model.checkpoint import resolve_checkpoint
from megabase.model.config import STAGES


LN2 = float(np.log(2.0))
# bases per streamed piece: memory is bounded by this, not by the region; pieces of 16,384 ran
# 1.65x faster than 65,536 on 2 cores (the activations of a piece stay in cache), same numbers
DEFAULT_SEGMENT = 16_384


@dataclass(frozen=True)
class Interval:
    """A resolved region: record ``chrom``, 0-based half-open ``[start, end)``, as the user wrote it."""

    chrom: str
    start: int
    end: int
    spec: str

    @property
    def length(self) -> int:
        return self.end - self.start


def resolve_regions(store: TokenStore, specs: list[str]) -> list[Interval]:
    """``chr22``, ``22`` or ``chr22:1,000,001-2,000,000`` against the store's records (one line
    naming the store and suggesting ``chr22``<->``22`` where a name is missing)."""
    if not specs:
        raise InputError("name at least one region ({regions}), e.g. chr22:1-100,000",
                         str(store.path), options=("regions",))
    out = []
    for spec in specs:
        region = parse_region(spec, store.names, str(store.path))
        length = store.length(region.name)
        end = length if region.end is None else region.end
        if end > length:
            raise InputError(f"region {spec!r} ends at {end:,}, past the end of {region.name} "
                             f"({length:,} bases)", str(store.path))
        if end <= region.start:
            raise InputError(f"region {spec!r} is empty", str(store.path))
        out.append(Interval(region.name, region.start, end, spec))
    return out


def load_model(checkpoint: str | Path, dsa_stage: str | None = None):
    """The checkpoint's model in eval mode (one line naming the file if it is damaged). A run's
    folder (``work/runs/demo``) means its latest checkpoint. ``dsa_stage``: the DSA indexer's
    candidate stage to run it with (``exact``, ``max``, ``mean``); None: the checkpoint's."""

    if dsa_stage is not None and dsa_stage not in STAGES:
        raise InputError(f"{{dsa_stage}} must be one of {', '.join(STAGES)}, got {dsa_stage!r}",
                         options=("dsa_stage",))
    stage = {} if dsa_stage is None else {"dsa_stage": dsa_stage}
    return load_checkpoint(resolve_checkpoint(checkpoint), **stage).eval()


def check_output_dir(out: Path) -> Path:
    """``out`` may be new or a folder; files megabase writes in it are replaced, nothing else is
    touched. Checked before minutes of work."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError("exists and is not a directory; choose another {out}", out,
                         options=("out",))
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(parent, os.W_OK):
        raise InputError("is not writable; choose another {out}", parent, options=("out",))
    return out


@contextmanager
def sole_writer(out: Path | None, command: str, names: tuple[str, ...] = ()) -> Iterator[None]:
    """Hold the output folder ``out`` for ``megabase <command>`` for the block (None: nothing to
    hold): one such command writes into a folder at a time, so two runs never leave a mix of
    their files; a second one is refused at once, in one line naming the first. The lock
    (``core.locks``, dropped by the kernel however its holder ends) is ``.<command>.lock`` inside
    ``out``, which is made here (and removed again if the command fails and leaves it empty):
    ``out`` is where the user may write, its parent need not be. Temporaries of the files
    ``names`` that a writer killed earlier left in ``out`` are cleared."""
    if out is None:
        yield
        return
    import glob


    out = Path(out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    held = False
    try:
        with holding(out / command, "this output folder"):
            held = True
            for name in names:
                remove_stale_temps(out, glob.escape(name))
            yield
    except BaseException as exc:
        if made:
            with suppress(OSError):
                out.rmdir()  # only when empty: nothing the command wrote, nothing of the user's
        if isinstance(exc, InputError) and not held:  # the folder given, not the lock's stand-in
            raise InputError(exc.what, out) from None
        raise


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tokens_of(store: TokenStore, iv: Interval, before: int = 0) -> tuple[np.ndarray, int]:
    """The region's tokens with up to ``before`` bases of the record before it: ``(tokens, how
    many of them precede the region)``."""
    lo = max(0, iv.start - before)
    return np.asarray(store.tokens(iv.chrom)[lo : iv.end]), iv.start - lo
