"""The one exception type for bad user input; the CLI prints it as one line and exits non-zero."""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """Bad input from the user: a file, a record, an option. ``str()`` is the whole message.

    Messages read ``<file>: record '<name>': <what is wrong>``; parts that don't apply are left out.
    """

    def __init__(self, what: str, path: str | Path | None = None, record: str | None = None):
        parts = []
        if path is not None:
            parts.append(str(path))
        if record is not None:
            parts.append(f"record {record!r}")
        parts.append(what)
        super().__init__(": ".join(parts))
