"""What a stopped evaluation had finished, so that the next try scores only the rest.

An evaluation at a megabase costs hours (a window with two controls and the copy model ~16
minutes on 2 cores), longer than a cluster job's time limit or a working session. Each window of
each series (the model, a control, the copy model, a Markov baseline, a recall-probe window) is
scored alone, so its per-window sums are its whole contribution to the report: the journal keeps
them, one JSON line per finished window, in the report's folder
(``.megabase-evaluation.jsonl``). A later try of the *same* evaluation (the same checkpoint
weights, windows and options: its first line) takes them as they are and scores the rest, so its
report equals an uninterrupted one's; a journal of another evaluation is replaced. The report's
``seconds`` then counts every try (each up to its last finished window) and ``tries`` how many.
The journal is removed once the report is written; it is megabase's own file, and nothing else in
the folder is touched.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from megabase.core.atomic import write_atomic

NAME = ".megabase-evaluation.jsonl"


class Journal:
    """Finished windows by ``(series, index)``, read from ``folder/NAME`` when its first line is
    ``fingerprint`` (a JSON-able dict), else started afresh there."""

    def __init__(self, folder: str | Path, fingerprint: dict):
        self.path = Path(folder) / NAME
        self.fingerprint = json.loads(json.dumps(fingerprint))
        self.done: dict[tuple[str, int], dict] = {}
        self.tries, self.spent = 1, 0.0  # seconds of earlier tries
        self.started = time.perf_counter()
        self._file = None
        self._read()

    def _read(self) -> None:
        try:
            lines = self.path.read_text().splitlines()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, UnicodeDecodeError):
            return
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # the line a stopped process was writing
                break
        if not entries or entries[0].get("fingerprint") != self.fingerprint:
            return
        spent: dict[int, float] = {}
        for e in entries[1:]:
            if "series" in e:
                self.done[(e["series"], e["index"])] = e["data"]
                spent[e["try"]] = max(spent.get(e["try"], 0.0), e["seconds"])
        self.tries = entries[0].get("tries", 1) + 1
        self.spent = sum(spent.values())

    def __len__(self) -> int:
        return len(self.done)

    def get(self, series: str, index: int) -> dict | None:
        """The finished window ``index`` of ``series``: what :meth:`add` was given (arrays as
        nested lists), or None."""
        return self.done.get((series, index))

    def add(self, series: str, index: int, **data) -> None:
        """Window ``index`` of ``series`` is finished: ``data`` (arrays and numbers; floats kept
        to the last bit, as JSON writes a Python float) is on disk before this returns."""
        data = {k: np.asarray(v).tolist() if isinstance(v, np.ndarray) else v
                for k, v in data.items()}
        if self._file is None:
            self._open()
        self.done[(series, index)] = data
        line = {"series": series, "index": index, "try": self.tries, "seconds": self.elapsed(),
                "data": data}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _open(self) -> None:
        """The journal file, with this try's header; written anew (from the windows already
        read) so that a replaced journal leaves no line of another evaluation."""
        lines = [{"fingerprint": self.fingerprint, "tries": self.tries}]
        lines += [{"series": series, "index": index, "try": 0, "seconds": self.spent, "data": data}
                  for (series, index), data in self.done.items()]
        write_atomic(self.path, "".join(json.dumps(x) + "\n" for x in lines).encode())
        self._file = open(self.path, "a")

    def elapsed(self) -> float:
        """Seconds of this try so far."""
        return time.perf_counter() - self.started

    def seconds(self) -> float:
        """Seconds of every try: the earlier ones' (up to each one's last finished window) and
        this one's."""
        return self.spent + self.elapsed()

    def close(self, finished: bool) -> None:
        """Close the file; ``finished`` (the report is written): remove it."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if finished:
            self.path.unlink(missing_ok=True)
