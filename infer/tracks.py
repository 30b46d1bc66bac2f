"""Per-base tracks on disk: bedGraph (text) and bigWig (``pyBigWig``), for a genome browser."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import numpy as np

from megabase.data import InputError
from megabase.core.atomic import writing

from .common import Interval


def require_pybigwig():
    try:
        import pyBigWig
    except ImportError:
        raise InputError("bigWig output needs pyBigWig (pip install pyBigWig), or choose "
                         "{formats} bedgraph", options=("formats",)) from None
    return pyBigWig


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of finite values (bases that are not A/C/G/T are NaN: left out)."""
    ok = np.concatenate([[False], np.isfinite(values), [False]])
    edges = np.flatnonzero(ok[1:] != ok[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _ordered(tracks: list[tuple[Interval, np.ndarray]], order: list[str]) -> list:
    """Tracks by record (in ``order``) and position."""
    rank = {name: i for i, name in enumerate(order)}
    tracks = sorted(tracks, key=lambda t: (rank.get(t[0].chrom, len(rank)), t[0].start))
    check_disjoint([iv for iv, _ in tracks])
    return tracks


def check_disjoint(intervals: list[Interval]) -> None:
    """A browser track holds one value per base: overlapping regions are refused."""
    ordered = sorted(intervals, key=lambda iv: (iv.chrom, iv.start))
    for a, b in zip(ordered, ordered[1:]):
        if a.chrom == b.chrom and b.start < a.end:
            raise InputError(f"regions {a.spec!r} and {b.spec!r} overlap; a track holds one value "
                             "per base: score them separately", options=("regions",))


def write_bedgraph(path: str | Path, tracks: list[tuple[Interval, np.ndarray]],
                   name: str = "megabase") -> Path:
    """One line per scored base, ``chrom start end value`` (0-based, 4 decimals), after a
    ``track`` line; written whole or not at all."""
    tracks = _ordered(tracks, [])
    with writing(path) as tmp, open(tmp, "w") as fh:
        fh.write(f'track type=bedGraph name="{name}"\n')
        for iv, values in tracks:
            for lo, hi in _runs(values):
                pos = np.arange(iv.start + lo, iv.start + hi)
                text = np.char.mod("%.4f", values[lo:hi].astype(np.float64))
                fh.write("\n".join(f"{iv.chrom}\t{p}\t{p + 1}\t{v}" for p, v in zip(pos.tolist(),
                                                                                 text.tolist())))
                fh.write("\n")
    return Path(path)


def write_bigwig(path: str | Path, tracks: list[tuple[Interval, np.ndarray]],
                 sizes: dict[str, int]) -> Path:
    """A bigWig of one value per scored base over the records ``sizes`` (name -> length, the
    store's order)."""
    pyBigWig = require_pybigwig()
    tracks = _ordered(tracks, list(sizes))

    def write(tmp: Path) -> None:
        bw = pyBigWig.open(str(tmp), "w")
        try:
            bw.addHeader(list(sizes.items()), maxZooms=10)
            for iv, values in tracks:
                for lo, hi in _runs(values):
                    bw.addEntries(iv.chrom, iv.start + lo, values=values[lo:hi].astype(np.float64),
                                  span=1, step=1)
        finally:
            bw.close()

    with writing(path) as tmp:
        in_child(write, tmp, Path(path))
    return Path(path)


def in_child(write, tmp: Path, target: Path) -> None:
    """``write(tmp)`` in a forked process where fork exists: libBigWig does not check its writes,
    so a full disk or a file-size limit crashed the whole command (SIGSEGV, nothing said). A
    child that dies or fails is an OSError naming ``target``."""
    if not hasattr(os, "fork"):
        write(tmp)
        return
    pid = os.fork()
    if pid == 0:  # the child: no torch work here, only the writer's C calls
        code = 0
        try:
            # libBigWig's and glibc's own words on a failed write would break the one line
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            write(tmp)
        except OSError as exc:
            code = exc.errno or errno.EIO
        except BaseException:
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise OSError(errno.EIO, f"the bigWig writer died ({signal.Signals(os.WTERMSIG(status)).name}"
                      "): is the disk full, or a file-size limit set?", str(target))
    code = os.WEXITSTATUS(status)
    if code:
        reason = os.strerror(code) if code != 255 else "the bigWig writer failed"
        raise OSError(code if code != 255 else errno.EIO, reason, str(target))
