"""The tokenizer of an exported megabase model: one token per base, exactly as ``megabase prepare``
maps a FASTA (the same table, from the carried megabase code).

``A C G T`` (either case) are 0..3; every IUPAC ambiguity code (``N R Y K M S W B D H V U``, either
case) and the gaps ``-`` ``.`` are ``N`` = 4; ``<pad>`` = 5, ``<sep>`` = 6, the start of every
sequence (added by default, as megabase reads a window from a ``<sep>``). Whitespace (line ends of
a pasted FASTA record) is skipped; any other character is an error naming it and its position.
Case is not kept (megabase records it as a repeat mask, not a token).

Text is DNA only: ``<pad>`` and ``<sep>`` are added by the tokenizer (start, padding), never read
from the text, so ``"A<sep>C"`` is refused at ``<`` like any other non-DNA character. ``N`` is a
base, not an unknown token: there is no unknown token (a non-DNA character is an error, not a
guess), and ``decode(..., skip_special_tokens=True)`` drops only ``<pad>`` and ``<sep>``. Decoding
gives the bases in upper case (``<pad>`` and ``<sep>`` are not written out in either case).
"""

from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizer

SYMBOLS = ("A", "C", "G", "T", "N", "<pad>", "<sep>")
_WHITESPACE = str.maketrans("", "", " \t\r\n\v\f")


class MegabaseTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "vocab.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str | None = None, bos_token="<sep>", pad_token="<pad>",
                 add_bos_token: bool = True, padding_side="right", **kwargs):
        if vocab_file is not None:
            with open(vocab_file) as fh:
                symbols = json.load(fh)
            if tuple(symbols) != SYMBOLS:
                raise ValueError(f"{vocab_file} is not megabase's vocabulary {list(SYMBOLS)}")
        self._ids = {s: i for i, s in enumerate(SYMBOLS)}
        self.add_bos_token = add_bos_token
        if kwargs.get("unk_token") is not None:  # an unknown token is skipped as special
            raise ValueError("megabase's tokenizer has no unknown token (N is a base); "
                             "leave out unk_token")
        kwargs.pop("unk_token", None)
        super().__init__(bos_token=bos_token, pad_token=pad_token, padding_side=padding_side,
                         **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(SYMBOLS)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    def tokenize(self, text: str, **kwargs) -> list[str]:
        """The tokens of DNA ``text``. Unlike other tokenizers, special-token strings written in the
        text are not split out as special tokens (they are not DNA: refused at their first
        character), whatever ``split_special_tokens`` says."""
        kwargs.pop("split_special_tokens", None)
        text, kwargs = self.prepare_for_tokenization(text, **kwargs)
        return self._tokenize(text)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        from .megabase_code import megabase_module

        vocab = megabase_module("core.vocab")
        clean = text.translate(_WHITESPACE)
        try:
            ids = vocab.tokenize(clean)
        except ValueError as exc:  # name the position in the text as given
            raise ValueError(f"not DNA: {exc} (whitespace removed)") from None
        return [SYMBOLS[i] for i in ids.tolist()]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self._ids:
            return self._ids[token]
        tokens = self._tokenize(token)  # an IUPAC code or lower case, as in text; else refused
        if len(tokens) != 1:
            raise ValueError(f"{token!r} is not a token of megabase's vocabulary {list(SYMBOLS)}")
        return self._ids[tokens[0]]

    def _convert_id_to_token(self, index: int) -> str:
        return SYMBOLS[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(t for t in tokens if t in SYMBOLS[:5])

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        start = [self.bos_token_id] if self.add_bos_token else []
        if token_ids_1 is None:
            return start + token_ids_0
        return start + token_ids_0 + start + token_ids_1

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            return [int(t in (self.bos_token_id, self.pad_token_id)) for t in token_ids_0]
        start = [1] if self.add_bos_token else []
        mask = start + [0] * len(token_ids_0)
        if token_ids_1 is not None:
            mask += start + [0] * len(token_ids_1)
        return mask

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "vocab.json")
        with open(path, "w") as fh:
            json.dump(list(SYMBOLS), fh)
        return (path,)

