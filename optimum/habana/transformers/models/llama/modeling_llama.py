"""Llama with the Gaudi attention: transformers' own Llama, its attention looked up under the name "gaudi"."""

from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...attention import ATTENTION_IMPLEMENTATION, gaudi_attention_forward
from ...attention_flags import attention_flags_of, resolve_attention_flags
from ...generation import GaudiGenerationConfig, GaudiGenerationMixin


class GaudiLlamaForCausalLM(GaudiGenerationMixin, LlamaForCausalLM):
    """`LlamaForCausalLM` whose attention is the Gaudi attention, whatever `attn_implementation` the config says.

    The attention flags are forward arguments, so `model(...)`, `generate(...)`, PEFT wrappers and the Trainer can
    pass them; unset flags come from `model.generation_config` (a `GaudiGenerationConfig`), then default to off.
    """

    generation_config_class = GaudiGenerationConfig

    def __init__(self, config: LlamaConfig) -> None:
        config._attn_implementation = ATTENTION_IMPLEMENTATION
        super().__init__(config)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Any, *args: Any, attn_implementation: str | None = None, **kwargs: Any
    ) -> "GaudiLlamaForCausalLM":
        if attn_implementation not in (None, ATTENTION_IMPLEMENTATION):
            raise ValueError(
                "GaudiLlamaForCausalLM always uses the Gaudi attention, got "
                f"attn_implementation={attn_implementation!r}. Drop the argument and choose the fused kernel or the "
                "default path with `use_flash_attention`."
            )
        model = super().from_pretrained(
            pretrained_model_name_or_path, *args, attn_implementation=ATTENTION_IMPLEMENTATION, **kwargs
        )
        if not isinstance(model.generation_config, GaudiGenerationConfig):
            model.generation_config = _load_gaudi_generation_config(
                pretrained_model_name_or_path, model.generation_config, kwargs
            )
        return model

    def set_attn_implementation(self, attn_implementation: str | dict, **kwargs: Any) -> None:
        if attn_implementation != ATTENTION_IMPLEMENTATION:
            raise ValueError(
                f"GaudiLlamaForCausalLM always uses the Gaudi attention, got {attn_implementation!r}: "
                "choose the fused kernel or the default path with `use_flash_attention`."
            )
        super().set_attn_implementation(attn_implementation, **kwargs)

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
        use_flash_attention: bool | None = None,
        flash_attention_recompute: bool | None = None,
        flash_attention_causal_mask: bool | None = None,
        flash_attention_fast_softmax: bool | None = None,
        attn_softmax_bf16: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        call_flags = {
            "use_flash_attention": use_flash_attention,
            "flash_attention_recompute": flash_attention_recompute,
            "flash_attention_causal_mask": flash_attention_causal_mask,
            "flash_attention_fast_softmax": flash_attention_fast_softmax,
            "attn_softmax_bf16": attn_softmax_bf16,
        }
        flags = resolve_attention_flags(call_flags, attention_flags_of(self.generation_config)).as_dict()
        if flags["use_flash_attention"]:
            output_attentions = kwargs.get("output_attentions")
            if output_attentions if output_attentions is not None else self.config.output_attentions:
                raise ValueError(
                    "output_attentions=True cannot be combined with use_flash_attention=True: the fused kernel never "
                    "materialises the attention weights. Pass use_flash_attention=False for this call."
                )
            if self.training and self.model.gradient_checkpointing:
                # Checkpointed layers run forward twice; the kernel must not keep its intermediates either.
                flags["flash_attention_recompute"] = True
            if flags["flash_attention_causal_mask"]:
                kwargs.update(causal_prefill_padding(attention_mask, input_ids, inputs_embeds, past_key_values))

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
    if attention_mask is None or attention_mask.dim() != 2:
        return {}
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


__all__ = ["GaudiLlamaForCausalLM", "causal_prefill_padding", "gaudi_attention_forward"]
