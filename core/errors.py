"""The errors every floor raises: :class:`InputError` for bad user input (the CLI prints one line
and exits 2) and :class:`TrainingError` for a job that fails after its input was accepted (one
line, exit 3)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class InputError(Exception):
    """Bad input from the user: a file, a record, an option. ``str()`` is the whole message.

    Messages read ``<file>: record '<name>': <what is wrong>``; parts that don't apply are left out.
    A library function names its own arguments: ``options`` lists the ones ``what`` refers to as
    ``{name}``. ``str()`` shows them as written (``length must be positive``); a caller that knows
    them by other names (the CLI's ``--length``, a config's ``data.window_length``) asks for
    :meth:`named` with its own naming.
    """

    def __init__(self, what: str, path: str | Path | None = None, record: str | None = None,
                 options: tuple[str, ...] = ()):
        self.what, self.path, self.record, self.options = what, path, record, tuple(options)
        super().__init__(self.named())

    def named(self, name_of: Callable[[str], str] = str) -> str:
        """The message with each option ``{name}`` written as ``name_of(name)`` (default: as is)."""
        what = self.what
        for option in self.options:
            what = what.replace("{" + option + "}", name_of(option))
        parts = []
        if self.path is not None:
            parts.append(str(self.path))
        if self.record is not None:
            parts.append(f"record {self.record!r}")
        parts.append(what)
        return ": ".join(parts)

    def __reduce__(self):  # across processes (spawned ranks) with its parts, not only its text
        return type(self), (self.what, self.path, self.record, self.options)

class TrainingError(RuntimeError):
    pass


class TrainingDivergedError(TrainingError):
    """The loss became NaN or infinite; ``step`` is the optimizer step that produced it."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss became {loss} at step {step}; stopped without updating, the last "
                         "good checkpoint is kept")
        self.step = step


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written; the previous one is untouched and still ``latest``."""


class Interrupted(KeyboardInterrupt):
    """A stop (Ctrl-C, SIGTERM) that kept finished work to resume from; ``kept`` says what, and
    how to resume, in words for the command's last line."""

    def __init__(self, kept: str):
        super().__init__(kept)
        self.kept = kept
