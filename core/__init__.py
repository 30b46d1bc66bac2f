"""megabase.core: what every floor stands on, with no dependency on any of them.

``errors`` (:class:`InputError`, :class:`TrainingError` and its kinds), ``atomic`` (writes that
appear whole or not at all, temporaries named so a later run can sweep them), ``locks`` (one job
per folder, readers' holds on checkpoints) and ``vocab`` (the nucleotide tokens). Only the standard
library and numpy are imported here, so every command starts fast.
"""

from .errors import CheckpointWriteError, InputError, TrainingDivergedError, TrainingError

__all__ = ["CheckpointWriteError", "InputError", "TrainingDivergedError", "TrainingError"]
