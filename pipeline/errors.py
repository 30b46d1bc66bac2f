"""Errors of the training stage that are not bad input (those are :class:`InputError`).

The CLI prints them as one line and exits with status 3.
"""

from __future__ import annotations


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
