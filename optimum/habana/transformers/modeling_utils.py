"""`GaudiAttentionMixin`: what turns any transformers causal LM into one that runs the Gaudi attention and its flags.

Mixed in before the stock class (`class GaudiLlamaForCausalLM(GaudiAttentionMixin, LlamaForCausalLM)`), it keeps
the model transformers' own (same layers, weights, loading and saving) and adds:

- the attention: every attention layer looks up the Gaudi attention, whatever `attn_implementation` the user
  chose; that choice stays on `config._attn_implementation` and sets the model's default `use_flash_attention`
  ("eager" -> off, "sdpa" and "gaudi_fused_sdpa" -> on, "gaudi" or nothing -> the generation config decides);
- the flags as `forward` keyword arguments, resolved once per call, falling back to `model.generation_config`;
- gradient checkpointing forcing the kernel's recompute, and the causal-mask mode's per-row valid lengths;
- the generation config loaded as a `GaudiGenerationConfig`, and the bridge that carries the flags from
  `generate()` to every forward; a `BucketedStaticCache` learns each step's length before the step runs.
"""

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils.generic import TransformersKwargs

from ..kernels.dispatch import needs_padding_mask
from .attention import ATTENTION_IMPLEMENTATION, FUSED_SDPA_IMPLEMENTATION, MASK_FREE_PREFILL, AttentionConfigView
from .attention_flags import (
    ATTENTION_FLAG_NAMES,
    DEFAULT_PATH_FLAGS,
    FLASH_ATTENTION_COMPANIONS,
    AttentionFlagKwargs,
    attention_flags_of,
    pop_attention_flags,
    resolve_attention_flags,
)
from .cache import BucketedStaticCache
from .continuous_batching import ChosenAttnImplementation, engine_flags, init_manager
from .generation import GaudiGenerationConfig, GaudiGenerationMixin
from .packing import can_run_packed, packed_sequence_lengths


# The `attn_implementation` values a Gaudi model accepts, and the default `use_flash_attention` each one sets
# (None: leave it to the generation config).
# generate() keyword arguments that its decoding loop reads and that stock generate() passes on to forward.
GENERATION_ONLY_KWARGS = ("tokenizer", "assistant_tokenizer")

ATTENTION_IMPLEMENTATIONS: dict[str, bool | None] = {
    ATTENTION_IMPLEMENTATION: None,
    "eager": False,
    "sdpa": True,
    FUSED_SDPA_IMPLEMENTATION: True,
}


class GaudiModelKwargs(TransformersKwargs, AttentionFlagKwargs, total=False):
    """What a Gaudi model's forward takes besides its named inputs: transformers' own kwargs and the flags."""


class GaudiAttentionMixin(GaudiGenerationMixin):
    """Mix into a causal LM of transformers before the stock class; see the module docstring."""

    generation_config_class = GaudiGenerationConfig

    def __init__(self, config: PreTrainedConfig, *args: Any, **kwargs: Any) -> None:
        # A copy: the attention choice written below must not leak into a stock model built from the same object.
        super().__init__(copy.deepcopy(config), *args, **kwargs)
        view = AttentionConfigView(self.config)
        for module in self.modules():
            if not isinstance(module, PreTrainedModel) and getattr(module, "config", None) is self.config:
                module.config = view
        self._apply_attn_implementation_default()

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        """One rule for the constructor's config, `from_pretrained`, `_from_config` and `set_attn_implementation`."""
        if attn_implementation is None:
            return ATTENTION_IMPLEMENTATION
        if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"{type(self).__name__} runs the Gaudi attention and takes attn_implementation "
                f"{', '.join(repr(name) for name in ATTENTION_IMPLEMENTATIONS)}, got {attn_implementation!r}. "
                "'eager' selects the default attention, 'sdpa' and 'gaudi_fused_sdpa' the fused kernel "
                "(use_flash_attention=True), 'gaudi' leaves the choice to use_flash_attention."
            )
        return attn_implementation

    def set_attn_implementation(self, attn_implementation: str | dict, **kwargs: Any) -> None:
        if isinstance(attn_implementation, ChosenAttnImplementation):  # a continuous batching manager stopped
            self.config._attn_implementation_internal = str(attn_implementation)
            return
        super().set_attn_implementation(attn_implementation, **kwargs)
        self._apply_attn_implementation_default()

    @torch.no_grad()
    def init_continuous_batching(
        self,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: Any = None,
        workload_hints: Any = None,
    ) -> Any:
        """transformers' continuous batching manager, with the Gaudi attention on every call (`continuous_batching`).

        `generate_batch` and `continuous_batching_context_manager` come through here too.
        """
        engine_generation_config = generation_config if generation_config is not None else self.generation_config
        self._continuous_batching_flags = engine_flags(self.generation_config, engine_generation_config)
        return init_manager(self, generation_config, continuous_batching_config, workload_hints)

    def _apply_attn_implementation_default(self) -> None:
        """Make the requested attention the model's default: the flags in `generation_config` follow it."""
        use_flash_attention = ATTENTION_IMPLEMENTATIONS[self.config._attn_implementation]
        if use_flash_attention is None:
            return
        config = self.generation_config
        config.use_flash_attention = use_flash_attention
        for name in DEFAULT_PATH_FLAGS if use_flash_attention else FLASH_ATTENTION_COMPANIONS:
            setattr(config, name, None)  # settings of the other path would now contradict the flag

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, info) with output_loading_info=True
        if not isinstance(model.generation_config, GaudiGenerationConfig):
            model.generation_config = _load_gaudi_generation_config(
                pretrained_model_name_or_path, model.generation_config, kwargs
            )
        model._apply_attn_implementation_default()
        return loaded

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Also tell a bucketed static cache how many tokens the next forward adds, outside any compiled region.

        The signature is the stock one: generate() reads it to decide whether `inputs_embeds` is supported.
        generate()'s tokenizers (stop strings, assisted decoding) ride along in the model kwargs; they are not
        forward arguments, and the Gaudi attention refuses arguments it does not know.
        """
        for name in GENERATION_ONLY_KWARGS:
            kwargs.pop(name, None)
        if isinstance(past_key_values, BucketedStaticCache):
            new_tokens = next_sequence_length
            if new_tokens is None:
                prompt_embeds = inputs_embeds is not None and is_first_iteration
                new_tokens = inputs_embeds.shape[1] if prompt_embeds else input_ids.shape[1] - past_key_values.tokens
            past_key_values.prepare_for_new_tokens(new_tokens)
        return super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )

    def _validate_model_kwargs(self, model_kwargs: dict[str, Any]) -> None:
        # The flags are forward arguments through `**kwargs`, which transformers' check cannot see.
        super()._validate_model_kwargs({k: v for k, v in model_kwargs.items() if k not in ATTENTION_FLAG_NAMES})

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[GaudiModelKwargs],
    ) -> CausalLMOutputWithPast:
        if isinstance(kwargs.get("cache"), PagedAttentionCache):  # a continuous batching step: the engine's flags
            defaults = getattr(self, "_continuous_batching_flags", None) or attention_flags_of(self.generation_config)
        else:
            defaults = attention_flags_of(self.generation_config)
        flags = resolve_attention_flags(pop_attention_flags(kwargs), defaults)
        flags = flags.as_dict()
        if flags["use_flash_attention"]:
            if kwargs.get("output_attentions") is None and self.config.output_attentions:
                kwargs["output_attentions"] = True  # the attention runs such calls on the default path, and says so
            if self.training and getattr(self.base_model, "gradient_checkpointing", False):
                # Checkpointed layers run forward twice; the kernel must not keep its intermediates either.
                flags["flash_attention_recompute"] = True
        tokens = input_ids if input_ids is not None else inputs_embeds
        packed = None
        if can_run_packed(self.config):
            packed = packed_sequence_lengths(position_ids, attention_mask, past_key_values, tokens, kwargs)
        if packed is not None:
            # Padding-free packing, flag or not: the attention isolates the examples, transformers builds no mask.
            kwargs["packed_sequence_lengths"] = packed
            mask_free = True
        elif flags["use_flash_attention"]:
            # A padded prompt whose layers need nothing but causality and the padding skips transformers' mask,
            # unless the device's kernel reads it (Gaudi without the causal-mask mode).
            mask_free = padding_mask_is_all_it_needs(self.config) and not needs_padding_mask(
                tokens, flags["flash_attention_causal_mask"]
            )
            if flags["flash_attention_causal_mask"] or mask_free:
                padding = causal_prefill_padding(attention_mask, input_ids, inputs_embeds, past_key_values)
                kwargs.update(padding)
                mask_free = mask_free and bool(padding)
        else:
            mask_free = False
        with mask_free_prefill(self.config) if mask_free else contextlib.nullcontext():
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **flags,
                **kwargs,
            )


def padding_mask_is_all_it_needs(config: PreTrainedConfig) -> bool:
    """Whether every layer's mask is causal plus padding: no sliding window, no bidirectional or chunked layers."""
    if not getattr(config, "is_causal", True) or getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(layer_type == "full_attention" for layer_type in layer_types)
    return getattr(config, "sliding_window", None) is None


@contextlib.contextmanager
def mask_free_prefill(config: PreTrainedConfig) -> Iterator[None]:
    """Make transformers' mask construction build nothing for this forward.

    transformers picks the mask function by `config._attn_implementation`, and would build a `[B, 1, q, q]` mask
    (O(N²) memory, several copies) for a padded prompt. The layers read the Gaudi attention through their config
    view, so only the mask construction sees the temporary name; the user's choice is restored afterwards.
    """
    chosen = config._attn_implementation_internal
    config._attn_implementation_internal = MASK_FREE_PREFILL
    try:
        yield
    finally:
        config._attn_implementation_internal = chosen


def _load_gaudi_generation_config(
    pretrained_model_name_or_path: Any, loaded: GenerationConfig, kwargs: dict[str, Any]
) -> GaudiGenerationConfig:
    """Re-read the checkpoint's generation config as ours.

    transformers loads it as a plain GenerationConfig, which drops custom entries such as our flags when the file
    was first derived from the model config; converting `loaded` would lose them.
    """
    if kwargs.get("generation_config") is None:
        hub_kwargs = {name: kwargs[name] for name in _HUB_KWARGS if name in kwargs}
        try:
            return GaudiGenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        except OSError:
            pass  # no generation_config.json: transformers derived `loaded` from the model config
    return GaudiGenerationConfig.from_dict(loaded.to_dict())


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def causal_prefill_padding(
    attention_mask: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    past_key_values: Cache | None,
) -> dict[str, Any]:
    """Per-row valid lengths for a prefill from an empty cache, when the padding is all on one side.

    Returns `{"valid_sequence_lengths": int32 [B], "padding_side": ...}`, or nothing when the mask is needed
    (decode, a non-empty cache, padding on both sides or in the middle): the attention then reads the mask.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return {}  # None, a prepared 4-D mask, or a dict of masks per layer type: the attention reads those
    q_len = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
    if q_len == 1 or past_len != 0 or attention_mask.shape[1] != q_len:
        return {}
    real = attention_mask.bool()
    # int32: the Gaudi kernel requires it, and torch.compile traces it without recompiling.
    lengths = real.sum(dim=-1, dtype=torch.int32)
    positions = torch.arange(q_len, device=real.device)
    if torch.equal(real, positions >= (q_len - lengths)[:, None]):
        return {"valid_sequence_lengths": lengths, "padding_side": "left"}
    if torch.equal(real, positions < lengths[:, None]):
        return {"valid_sequence_lengths": lengths, "padding_side": "right"}
    return {}
