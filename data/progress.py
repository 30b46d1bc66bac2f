"""Progress that reaches a log: a tqdm bar on a terminal, periodic plain lines otherwise.

A cluster job's stderr is a file, where a bar is either hidden (tqdm's ``disable=None``) or a
stream of carriage returns; a long phase would then look hung. So when stderr is not a terminal,
:func:`progress` prints one line every ``every_s`` seconds (default 30, or
``$MEGABASE_PROGRESS_EVERY_S``)::

    megabase: model: 12/40 windows (30%), 0.40 windows/s, 786k bases/s, ETA 1 min 10 s

and a closing line (``... done in 5 min 2 s``) only when it printed any, so a phase shorter than
``every_s`` writes nothing (a command that fails fast keeps its one error line). Usage::

    with progress(len(windows), "model", unit="window", enabled=not quiet) as bar:
        for w in windows:
            ...
            bar.update(1, bases=w.length)   # extra counters print as rates

Any extra keyword of :meth:`Progress.update` is a counter shown as ``<rate> <name>/s``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

EVERY_S = 30.0  # seconds between log lines when stderr is not a terminal
ENV_EVERY_S = "MEGABASE_PROGRESS_EVERY_S"


def _seconds(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _count(x: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


class Progress:
    """Counts work done out of ``total`` (None: unknown) and reports it: through a tqdm bar when
    ``bar`` is True, as log lines on ``stream`` every ``every_s`` seconds otherwise; nothing
    when ``enabled`` is False. Build it with :func:`progress`."""

    def __init__(self, total: int | None, desc: str, unit: str = "item", enabled: bool = True,
                 every_s: float | None = None, stream=None, bar: bool | None = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = float(os.environ.get(ENV_EVERY_S, EVERY_S)) if every_s is None else every_s
        self.enabled = bool(enabled)
        self.n, self.counts, self.lines, self.note = 0, {}, 0, ""
        # seconds left, where the caller knows better than the mean rate (units of unequal cost)
        self.eta: Callable[[], float | None] | None = None
        self.started = self.last = time.monotonic()
        self._bar = None
        if self.enabled and (bar if bar is not None else _isatty(self.stream)):
            from tqdm import tqdm  # imported only for a terminal: its monitor thread costs

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=self.stream)

    def update(self, n: int = 1, note: str | None = None, **counts: float) -> None:
        """``n`` more units done; ``counts`` (e.g. ``bases=65536``) add to counters whose rates
        the log lines show; ``note`` (e.g. the latest loss) replaces the text shown after them."""
        self.n += n
        if note is not None:
            self.note = note
            if self._bar is not None:
                self._bar.set_postfix_str(note, refresh=False)
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self.last >= self.every_s:
            self._line()

    def line(self) -> str:
        """The current state as one line (what the log shows)."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        units = self.unit + ("" if self.unit.endswith("s") else "s")
        done = f"{self.n:,}/{self.total:,}" if self.total is not None else f"{self.n:,}"
        parts = [f"{done} {units}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{_count(self.n / elapsed)} {units}/s")
        parts += [f"{_count(v / elapsed)} {k}/s" for k, v in self.counts.items()]
        if self.total and 0 < self.n < self.total:
            left = self.eta() if self.eta is not None else elapsed * (self.total - self.n) / self.n
            if left is not None:
                parts.append(f"ETA {_seconds(left)}")
        if self.note:
            parts.append(self.note)
        return f"megabase: {self.desc}: " + ", ".join(parts)

    def _line(self) -> None:
        self.last = time.monotonic()
        self.lines += 1
        print(self.line(), file=self.stream, flush=True)

    def write(self, message: str) -> None:
        """One line of text that does not break the bar."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar, or log the closing line when any line was logged."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.lines:
            self.lines = 0
            print(f"megabase: {self.desc}: {self.n:,} {self.unit}s done in "
                  f"{_seconds(time.monotonic() - self.started)}", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False


def progress(total: int | None, desc: str, unit: str = "item", enabled: bool = True,
             every_s: float | None = None, stream=None) -> Progress:
    """A :class:`Progress` of ``total`` ``unit``s named ``desc`` on ``stream`` (default stderr):
    a bar on a terminal, a log line every ``every_s`` seconds (default :data:`EVERY_S` or
    ``$MEGABASE_PROGRESS_EVERY_S``) elsewhere, nothing unless ``enabled``."""
    return Progress(total, desc, unit, enabled, every_s, stream)


def tracked(items, desc: str, unit: str = "item", enabled: bool = True, total: int | None = None,
            every_s: float | None = None):
    """Yield every item of ``items``, counting each as one ``unit`` (:func:`progress`)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with progress(total, desc, unit, enabled, every_s) as bar:
        for item in items:
            yield item
            bar.update(1)
