"""The configuration of an exported megabase model (transformers ``AutoConfig``).

``megabase`` holds the megabase ``ModelConfig`` fields the model was trained with;
``canonical_tiles`` (default True) keeps megabase's canonical row tiles, which make every base's
numbers independent of the batch and of where a sequence is cut (megabase's own log-probs to the
last bit); False runs the products on the rows as given: numbers move by fp32 round-off (~1e-6),
and a batch of short sequences runs several times faster (each expert's few rows are not padded
to a 1,024-row tile), what fine-tuning on short windows wants. The rest are transformers' own
(vocabulary, special tokens, classification labels). Written by ``megabase export-model``; loaded
with ``trust_remote_code=True``.
"""

from transformers import PretrainedConfig


class MegabaseConfig(PretrainedConfig):
    model_type = "megabase"

    def __init__(self, megabase: dict | None = None, vocab_size: int = 7, pad_token_id: int = 5,
                 bos_token_id: int = 6, eos_token_id: int | None = None,
                 tie_word_embeddings: bool = False, canonical_tiles: bool = True, **kwargs):
        self.megabase = dict(megabase or {})
        self.canonical_tiles = bool(canonical_tiles)
        self.vocab_size = vocab_size
        d_model = self.megabase.get("d_model")
        if d_model is not None:
            self.hidden_size = d_model
            self.num_hidden_layers = self.megabase.get("n_layers")
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)
