"""PyTorch access to windows: a map-style dataset over store + BED, and a resumable shuffling sampler.

Each item reads only its window from the memory-mapped store (one copy for tokens, one for the
mask). Token tensors are ``uint8`` to keep host memory and host-to-device traffic at one byte per
base; the model casts to ``long`` on its device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from megabase.core.errors import InputError
from .store import TokenStore
from megabase.core.vocab import N_BASES, PAD, RC_LUT, SEP
from .windows import Window, select_windows


class WindowDataset(torch.utils.data.Dataset):
    """Windows of a token store as language-model examples.

    For a window of ``n`` bases padded to ``L = pad_to or n``, an item is a dict of:

    - ``input_ids``  uint8 ``[L]``: ``<sep>`` then the window's first ``n-1`` bases (then ``<pad>``),
      so the target at offset ``i`` has exactly ``i`` bases of prior context;
    - ``targets``    uint8 ``[L]``: the window's bases (then ``<pad>``);
    - ``loss_mask``  bool ``[L]``: True where the target is a base ``A C G T`` (never ``N``/pad);
    - ``repeat_mask`` bool ``[L]``: True where the target base was soft-masked;
    - ``index``, ``chrom``, ``start``, ``end``, ``rc`` (whether reverse-complemented).

    Args:
        store: a :class:`TokenStore` or its path.
        windows: a list of :class:`Window` or a BED path.
        split: keep only windows of this split.
        rc_prob: probability of reverse-complementing a window (augmentation); default 0.
        seed: seeds the augmentation; the draw depends on (seed, epoch, index) only.
        pad_to: pad every item to this length; default: the longest window, so batches stack.

    Indices ``>= len(self)`` address later epochs (``epoch = i // len``); :class:`ResumableSampler`
    uses this so augmentation is reproducible per epoch even inside DataLoader worker processes.
    """

    def __init__(
        self,
        store: TokenStore | str | Path,
        windows: Sequence[Window] | str | Path,
        split: str | None = None,
        rc_prob: float = 0.0,
        seed: int = 0,
        pad_to: int | None = None,
    ):
        self.store = store if isinstance(store, TokenStore) else TokenStore(store)
        self.windows = select_windows(windows, split)
        if not self.windows:
            raise InputError("no windows to read" + (f" in split {split!r}" if split else ""))
        for w in self.windows:
            name = self.store.resolve(w.chrom)
            if w.end > self.store.length(name):
                raise InputError(f"window {w.start}-{w.end} runs past the record's end "
                                 f"({self.store.length(name):,})", self.store.path, name)
        if not 0.0 <= rc_prob <= 1.0:
            raise InputError(f"rc_prob must be within [0, 1], got {rc_prob}")
        longest = max(w.length for w in self.windows)
        if pad_to is not None and pad_to < longest:
            raise InputError(f"pad_to={pad_to} is shorter than the longest window ({longest})")
        self.rc_prob, self.seed, self.pad_to = rc_prob, seed, pad_to or longest

    def __len__(self) -> int:
        return len(self.windows)

    def _use_rc(self, epoch: int, index: int) -> bool:
        if self.rc_prob <= 0.0:
            return False
        return bool(np.random.default_rng((self.seed, epoch, index)).random() < self.rc_prob)

    def __getitem__(self, i: int) -> dict:
        epoch, index = divmod(int(i), len(self.windows))
        w = self.windows[index]
        n = w.length
        tokens = self.store.tokens(w.chrom)[w.start : w.end]
        mask = self.store.mask(w.chrom)[w.start : w.end]
        rc = self._use_rc(epoch, index)
        # One buffer holds <sep> + window + padding; inputs and targets are views shifted by one.
        buf = np.empty(self.pad_to + 1, dtype=np.uint8)
        buf[0] = SEP
        buf[n + 1 :] = PAD
        repeat = np.zeros(self.pad_to, dtype=bool)
        if rc:
            np.take(RC_LUT, tokens[::-1], out=buf[1 : n + 1])
            repeat[:n] = mask[::-1]
        else:
            buf[1 : n + 1] = tokens
            repeat[:n] = mask
        seq = torch.from_numpy(buf)
        targets = seq[1:]
        return {
            "input_ids": seq[:-1],
            "targets": targets,
            "loss_mask": targets < N_BASES,
            "repeat_mask": torch.from_numpy(repeat),
            "index": index,
            "chrom": w.chrom,
            "start": w.start,
            "end": w.end,
            "rc": rc,
        }


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Seeded shuffle over ``n`` items, epoch after epoch, whose position can be saved and restored.

    Yields ``epoch * n + index`` (see :class:`WindowDataset`). ``state_dict()`` gives
    ``{"seed", "epoch", "position"}``; a sampler loaded with it continues with the same sequence.
    A trainer that prefetches should save the number of samples it actually consumed as position.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        if n < 1:
            raise ValueError("ResumableSampler needs at least one item")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng((self.seed, epoch)).permutation(self.n)

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        while self.position < self.n:
            index = int(order[self.position])
            self.position += 1
            yield self.epoch * self.n + index
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.n - self.position

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler seed {self.seed} differs from the saved {state['seed']}")
        if not 0 <= state["position"] <= self.n:
            raise ValueError(f"saved position {state['position']} is outside 0..{self.n}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
