"""An exported megabase model in transformers: causal LM, base model and sequence classifier.

Load with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` (or
``AutoModel``, ``AutoModelForSequenceClassification``). No megabase install is needed: the model's
code travels in ``megabase_sources.py`` (megabase's own layers and kernels, renamed to a package
of their own), written out once under ``$MEGABASE_CACHE/hf`` (default ``~/.cache/megabase/hf``)
and imported from there. On a CPU with a C compiler megabase's C kernels build on first use, as in
megabase; without one the PyTorch forms run (~18x slower; log-probs to fp32 round-off, except where
that round-off flips a DSA layer's top-k choice: on 16,384 held-out human bases, mean |delta| 9e-7,
the worst base 2.6e-3); on CUDA the Triton kernels (and flash-linear-attention, where installed).

Tokens: ``A C G T N <pad> <sep>`` = 0..6, one per base; a sequence starts with ``<sep>`` (the
tokenizer adds it). The head scores the four bases only: ``logits [B, T, 4]`` over A/C/G/T, whose
indices are their token ids, so ``generate()`` samples bases only and from the four probabilities
megabase draws from (with the same seed, the same bases).
Right padding only (the model reads left to right, so pads after a sequence change nothing in it).
``hidden_states[i]`` is the residual stream after block ``i`` (``[0]``: the embeddings), as
``megabase embed --layer i`` gives it; ``last_hidden_state`` of the base model is after the final
norm. ``generate()`` carries megabase's streaming state (KDA states, conv tails, DSA caches) as its
cache: a new base costs one step, and with the same seed it draws megabase generate's bases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_megabase import MegabaseConfig
from .megabase_code import megabase_module

N_BASES, PAD_ID = 4, 5
PREFILL = 16_384  # prompt bases per step of the prefill, as megabase generate reads them


def megabase_modules():
    """``(lm, config, stream)``: the carried megabase modules the wrapper uses."""
    return tuple(megabase_module(f"model.{name}") for name in ("lm", "config", "stream"))


megabase_modules()  # imported now: transformers builds the model under a meta device, imports must not


class MegabaseCache:
    """megabase's streaming state (one dict per layer, then the input's last tokens) as a
    transformers cache: what ``generate()`` hands back on each step."""

    is_compileable = False

    def __init__(self, state: list[dict]):
        self.state = state
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen


@dataclass
class MegabaseLMOutput(ModelOutput):
    """``logits [B, T, 4]`` fp32 over A/C/G/T (token ids 0..3: a sampled index is the base's
    token); ``loss``: mean NLL (nats) of the A/C/G/T labels; ``cache`` (also as
    ``past_key_values``): the state to continue from."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: MegabaseCache | None = None
    past_key_values: MegabaseCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class MegabaseModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class MegabaseClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


def _check_padding(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > 1:
        if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("megabase reads left to right: pad on the right (tokenizer "
                             "padding_side='right'), not the left")


class MegabasePreTrainedModel(PreTrainedModel):
    config_class = MegabaseConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]

    def __init__(self, config: MegabaseConfig):
        super().__init__(config)
        lm, mb_config, _ = megabase_modules()
        self.model = lm.HybridLM(mb_config.ModelConfig.from_dict(dict(config.megabase)))

    @torch.no_grad()
    def _init_weights(self, module):
        """The classifier head, where a checkpoint has none (megabase's layers come from it)."""
        if module is getattr(self, "score", None):
            module.weight.normal_(0.0, 0.02)
            module.bias.zero_()

    def _run(self, input_ids, state=None, hidden=False, untiled=None):
        """HybridLM over ``input_ids`` (from ``state`` when given): ``(logits [B, T, 4],
        hidden states or None, final normed hidden [B, T, d])``. ``untiled``: products on the
        rows given (a decoding step); by default unless ``canonical_tiles``."""
        captured, normed = [], []
        hooks = [self.model.norm.register_forward_hook(lambda m, a, out: normed.append(out))]
        if hidden:
            hooks.append(self.model.blocks[0].register_forward_pre_hook(
                lambda m, args: captured.append(args[0])))
            hooks += [b.register_forward_hook(lambda m, a, out: captured.append(out[0]))
                      for b in self.model.blocks]
        untiled = not self.config.canonical_tiles if untiled is None else untiled
        try:
            logits = self.model(input_ids, state=state, ctx=self.model.context(untiled=untiled)).logits
        finally:
            for h in hooks:
                h.remove()
        return logits, (tuple(captured) if hidden else None), normed[-1]


class MegabaseModel(MegabasePreTrainedModel):
    """The residual stream: ``last_hidden_state [B, T, d]`` after the final norm."""

    def __init__(self, config: MegabaseConfig):
        super().__init__(config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        _check_padding(attention_mask)
        _, hidden, last = self._run(input_ids, hidden=bool(output_hidden_states))
        return MegabaseModelOutput(last_hidden_state=last, hidden_states=hidden)


class MegabaseForCausalLM(MegabasePreTrainedModel, GenerationMixin):
    """Next-base logits; ``labels`` (the input ids, as transformers passes them) give the mean NLL
    of every A/C/G/T target."""

    def __init__(self, config: MegabaseConfig):
        super().__init__(config)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is megabase's own state (see MegabaseCache)

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None,
                                      attention_mask=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            input_ids = input_ids[:, cache.seen :]
        return {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask,
                "use_cache": kwargs.get("use_cache", True)}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens: int = 1):
        model_kwargs["cache"] = outputs.cache
        model_kwargs.pop("past_key_values", None)
        if model_kwargs.get("attention_mask") is not None:
            mask = model_kwargs["attention_mask"]
            model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
        return model_kwargs

    def forward(self, input_ids, attention_mask=None, labels=None, cache=None,
                past_key_values=None, use_cache=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        _check_padding(attention_mask)
        cache = cache if cache is not None else past_key_values
        use_cache = bool(use_cache) or cache is not None
        hidden = bool(output_hidden_states)
        if not use_cache:
            logits, states, _ = self._run(input_ids, hidden=hidden)
        else:
            cache = cache if cache is not None else MegabaseCache(self.model.init_state())
            logits, states = self._step(input_ids, cache, hidden)
        loss = None
        if labels is not None:
            targets = labels[:, 1:].long()
            keep = (targets >= 0) & (targets < N_BASES)
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, N_BASES),
                                  targets.clamp(0, N_BASES - 1).reshape(-1), reduction="none")
            loss = (nll * keep.reshape(-1)).sum() / keep.sum().clamp(min=1)
        return MegabaseLMOutput(loss=loss, logits=logits, cache=cache if use_cache else None,
                                past_key_values=cache if use_cache else None,
                                hidden_states=states)

    def _step(self, input_ids, cache: MegabaseCache, hidden: bool):
        """Continue the carried state: a prompt in pieces of ``PREFILL`` bases (as megabase reads
        it), one new base as megabase's decoding step (``stream.decode_step``: untiled products,
        one thread)."""
        _, _, stream = megabase_modules()
        T = input_ids.shape[1]
        if T == 1 and cache.seen > 0 and not hidden:
            cache.seen += 1
            return stream.decode_step(self.model, input_ids, cache.state).logits, None
        if T == 1 and cache.seen > 0:  # the same step, with the hidden states captured
            with stream.one_thread():
                logits, states, _ = self._run(input_ids, cache.state, hidden, untiled=True)
            cache.seen += 1
            return logits, states
        parts, all_states = [], []
        for s in range(0, T, PREFILL):
            logits, states, _ = self._run(input_ids[:, s : s + PREFILL], cache.state, hidden)
            parts.append(logits)
            all_states.append(states)
        cache.seen += T
        states = None if not hidden else tuple(torch.cat(h, dim=1) for h in zip(*all_states))
        return torch.cat(parts, dim=1), states


class MegabaseForSequenceClassification(MegabasePreTrainedModel):
    """A label per sequence from the mean of the final normed hidden states over its bases
    (``attention_mask``; ``<sep>`` and padding left out): ``score = Linear(d, num_labels)``."""

    def __init__(self, config: MegabaseConfig):
        super().__init__(config)
        self.score = nn.Linear(config.megabase["d_model"], config.num_labels)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, labels=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        _check_padding(attention_mask)
        _, states, last = self._run(input_ids, hidden=bool(output_hidden_states))
        keep = (input_ids < N_BASES + 1).to(last.dtype)  # bases and N, not <pad> / <sep>
        if attention_mask is not None:
            keep = keep * attention_mask.to(last.dtype)
        pooled = (last * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
        logits = self.score(pooled.to(self.score.weight.dtype))
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
            else:
                loss = F.cross_entropy(logits, labels.long())
        return MegabaseClassifierOutput(loss=loss, logits=logits, hidden_states=states)

