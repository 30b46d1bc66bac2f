"""The configuration of an exported megabase model (transformers ``AutoConfig``).

``megabase`` holds the megabase ``ModelConfig`` fields the model was trained with; the rest are
transformers' own (vocabulary, special tokens, classification labels). Written by ``megabase
export-model``; loaded with ``trust_remote_code=True``.
"""

from transformers import PretrainedConfig


class MegabaseConfig(PretrainedConfig):
    model_type = "megabase"

    def __init__(self, megabase: dict | None = None, vocab_size: int = 7, pad_token_id: int = 5,
                 bos_token_id: int = 6, eos_token_id: int | None = None,
                 tie_word_embeddings: bool = False, **kwargs):
        self.megabase = dict(megabase or {})
        self.vocab_size = vocab_size
        d_model = self.megabase.get("d_model")
        if d_model is not None:
            self.hidden_size = d_model
            self.num_hidden_layers = self.megabase.get("n_layers")
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)
