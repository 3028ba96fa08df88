"""`GaudiAttentionMixin`: what turns any transformers causal LM into one that runs the Gaudi attention and its flags.

Mixed in before the stock class (`class GaudiLlamaForCausalLM(GaudiAttentionMixin, LlamaForCausalLM)`), it keeps
the model transformers' own (same layers, weights, loading and saving, attention names) and adds:

- the attention: every attention layer looks up the Gaudi attention, whatever `attn_implementation` says; that
  name stays on `config._attn_implementation` as transformers keeps it (stock's choice, "sdpa", when none is
  given), and an explicit choice sets the model's default `use_flash_attention` ("eager" -> off, "sdpa" and
  "gaudi_fused_sdpa" -> on, "gaudi" -> the generation config decides);
- the flags, resolved where the attention runs: a call's flags (forward, generate) over the model's defaults
  (`model.generation_config`), from every entry point: the causal LM, the decoder (`model.base_model`, which TRL
  calls), a layer or an attention module (`decoder_inputs`, and the attention's own fallback);
- the generation config loaded as a `GaudiGenerationConfig`, and the bridge that carries the flags from
  `generate()` to every forward; a `BucketedStaticCache` learns each step's length before the step runs.
"""

import copy
import functools
import inspect
import json
import os
import weakref
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils import CONFIG_NAME
from transformers.utils.generic import TransformersKwargs

from ..utils.atomic import atomic_write_text
from .attention import FUSED_SDPA_IMPLEMENTATION
from .attention_flags import (
    ATTENTION_FLAG_NAMES,
    DEFAULT_PATH_FLAGS,
    FLASH_ATTENTION_COMPANIONS,
    AttentionFlagKwargs,
    attention_flags_of,
    check_flag_spelling,
    pop_attention_flags,
    resolve_attention_flags,
)
from .batch_layout import (
    ReadPaddingSide,
    generation_masks_are_the_familys,
    is_padding_mask,
    padding_side_of,
    prompt_is_planned,
)
from .cache import BucketedStaticCache
from .config_view import ATTENTION_IMPLEMENTATION, AttentionConfigView
from .continuous_batching import ChosenAttnImplementation, engine_flags, init_manager, with_call_flags
from .decoder_inputs import prepare_decoder_call
from .families.lookups import attention_with_its_own_mask, family_is_windowed, family_runs_mask_free
from .families.source_facts import decoder_path
from .generation import GaudiGenerationConfig, GaudiGenerationMixin
from .latent_attention import keep_latent_compressed


# The `attn_implementation` values a Gaudi model accepts, and the default `use_flash_attention` each one sets
# (None: leave it to the generation config).
# generate() keyword arguments that its decoding loop reads and that stock generate() passes on to forward.
GENERATION_ONLY_KWARGS = ("tokenizer", "assistant_tokenizer")

# The configs of built Gaudi models whose attention name is stock's choice, filled in by the build (configs compare
# by value, so they are kept by identity; an entry leaves with its config).
_FILLED_IN_CONFIGS: weakref.WeakValueDictionary[int, PreTrainedConfig] = weakref.WeakValueDictionary()

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Each Gaudi class's forward declares the stock class's return type (MoE families return router logits).
        A subclass that writes its own forward (a user's, over a Gaudi class) keeps it, as over a stock class."""
        super().__init_subclass__(**kwargs)
        stock_forward = _stock_class(cls).forward
        stock_return = stock_forward.__annotations__.get("return")
        # Decided once per class, a constant to a compiled forward: MusicGen Melody's decoder takes no logits_to_keep.
        cls._stock_takes_logits_to_keep = "logits_to_keep" in inspect.signature(stock_forward).parameters
        if _is_own_class(cls):
            _share_stock_conversions(cls)
        if "forward" in cls.__dict__:
            return

        # The stock forward's signature, positional order included (GPT-2 takes `past_key_values` second, the MoE
        # families `output_router_logits` eighth): what a caller binds by position, and what transformers reads to
        # decide which inputs generate() and the Trainer hand on (`token_type_ids`).
        stock_signature = inspect.signature(stock_forward)
        positional = [
            name
            for name, parameter in list(stock_signature.parameters.items())[1:]
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        ]

        @functools.wraps(GaudiAttentionMixin.forward)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if len(args) > len(positional):
                raise TypeError(
                    f"{type(self).__name__}.forward() takes {len(positional)} positional arguments after self, as "
                    f"{_stock_class(type(self)).__name__}.forward() does, but {len(args)} were given"
                )
            for name, value in zip(positional, args, strict=False):  # fewer arguments than parameters
                if name in kwargs:
                    raise TypeError(f"{type(self).__name__}.forward() got multiple values for argument {name!r}")
                kwargs[name] = value
            return GaudiAttentionMixin.forward(self, **kwargs)

        forward.__annotations__ = {**GaudiAttentionMixin.forward.__annotations__, "return": stock_return}
        forward.__signature__ = stock_signature
        cls.forward = forward

    def __init__(self, config: PreTrainedConfig, *args: Any, **kwargs: Any) -> None:
        config = _own_copy(config)
        # The stock decoder inside checks its config's name itself, and refuses any name containing "sdpa" where stock
        # SDPA cannot take the family's attention (gpt-oss's sinks): the Gaudi attention can, so the decoders are built
        # under the name "gaudi" and the fused name is put back, the flag following it as the outer check recorded.
        fused_name_configs = _configs_naming(config, FUSED_SDPA_IMPLEMENTATION)
        for named in fused_name_configs:
            named._attn_implementation_internal = ATTENTION_IMPLEMENTATION
        super().__init__(config, *args, **kwargs)
        for named in fused_name_configs:
            named._attn_implementation_internal = FUSED_SDPA_IMPLEMENTATION
        family_runs_mask_free(self.config.model_type)  # known before any forward asks, also inside a graph
        family_is_windowed(self.config.model_type)
        attention_with_its_own_mask(self.config.model_type)
        view = AttentionConfigView(self.config, self.generation_config)
        self.__dict__["_attention_config_view"] = view
        for module in self.modules():
            if not isinstance(module, PreTrainedModel) and getattr(module, "config", None) is self.config:
                module.config = view
        keep_latent_compressed(self)  # latent attention expands its cache in the attention (latent_attention.py)
        # The decoder the causal LM's forward calls, which is not always its base model (OPT calls the base model's
        # own decoder): the hook must run where the keyword arguments enter the layers' path.
        path = decoder_path(_stock_class(type(self)))
        decoder = functools.reduce(getattr, path, self) if path else self.base_model
        decoder.register_forward_pre_hook(functools.partial(prepare_decoder_call, view), with_kwargs=True)
        self._apply_attn_implementation_default()
        if not self.__dict__.get("_attn_implementation_chosen"):
            _FILLED_IN_CONFIGS[id(self.config)] = self.config

    @classmethod
    def _from_config(cls, config: PreTrainedConfig, **kwargs: Any) -> "GaudiAttentionMixin":
        """Stock's, on a copy: transformers writes the dtype and the attention choice into the config it is given."""
        return super()._from_config(_own_copy(config), **kwargs)

    @property
    def generation_config(self) -> GenerationConfig | None:
        return self.__dict__.get("_generation_config")

    @generation_config.setter
    def generation_config(self, value: GenerationConfig | None) -> None:
        # The attention layers' view reads the model's flag defaults from it: a replaced config must reach them.
        self.__dict__["_generation_config"] = value
        if (view := self.__dict__.get("_attention_config_view")) is not None:
            view.model_generation_config = value

    @classmethod
    def is_custom_code(cls) -> bool:
        """A Gaudi class is the stock modeling code with another attention: transformers must convert its checkpoints'
        keys and initialise what a checkpoint lacks as for the stock class (custom code gets neither: GPT-NeoX's
        `embed_out` stayed unloaded, Falcon-H1's `mup_vector` uninitialised). A user's subclass defined elsewhere is
        custom code, as over a stock class."""
        if _is_own_class(cls):
            return _stock_class(cls).is_custom_code()
        return super().is_custom_code()

    def _get_name(self) -> str:
        """The stock class's name: transformers' Trainer shifts the labels of its label smoothing only for a class
        it finds by name among the causal LMs (a Gaudi class's own name taught the model the current token). A user's
        subclass keeps its own name, as over a stock class."""
        if _is_own_class(type(self)):
            return _stock_class(type(self)).__name__
        return super()._get_name()

    def __repr__(self) -> str:
        # torch's repr starts with `_get_name()`: it names the Gaudi class still.
        return type(self).__name__ + super().__repr__().removeprefix(self._get_name())

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        # transformers reads the answer off the class's module source; the stock class's module is the one to read.
        return _stock_class(cls)._can_set_attn_implementation()

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # Likewise: without it an MoE family would run the eager experts loop instead of grouped_mm.
        return _stock_class(cls)._can_set_experts_implementation()

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        """One rule for the constructor's config, `from_pretrained`, `_from_config` and `set_attn_implementation`.

        None takes stock's choice ("sdpa", or "eager" where SDPA cannot run), which leaves the flag to the
        generation config; a name outside the Gaudi attention's is refused in stock's words.
        """
        self.__dict__["_attn_implementation_chosen"] = attn_implementation is not None
        if attn_implementation is None:
            return super()._check_and_adjust_attn_implementation(None, is_init_check, allow_all_kernels)
        names = [name for name in ATTENTION_IMPLEMENTATIONS if name != "sdpa" or self._supports_sdpa]
        if attn_implementation not in names:
            if attn_implementation == "sdpa":  # stock SDPA cannot take the family's attention (sinks): stock's words
                self._sdpa_can_dispatch(is_init_check)
            fused = " and ".join(repr(name) for name in names if ATTENTION_IMPLEMENTATIONS[name])
            raise ValueError(
                f'Specified `attn_implementation="{attn_implementation}"` is not supported by {type(self).__name__}, '
                "which runs the Gaudi attention. The only possible arguments are "
                f"{', '.join(f'`attn_implementation={name!r}`' for name in names)}: 'eager' selects the default "
                f"attention, {fused} the fused kernel (use_flash_attention=True), 'gaudi' leaves the choice to "
                "use_flash_attention."
            )
        return attn_implementation

    def set_attn_implementation(self, attn_implementation: str | dict, **kwargs: Any) -> None:
        if isinstance(attn_implementation, ChosenAttnImplementation):  # a continuous batching manager stopped
            self.config._attn_implementation_internal = str(attn_implementation)
            return
        super().set_attn_implementation(attn_implementation, **kwargs)
        self.__dict__["_attn_implementation_chosen"] = True  # also when it names the current one
        _FILLED_IN_CONFIGS.pop(id(self.config), None)
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
        flags = engine_flags(self.generation_config, engine_generation_config)
        return init_manager(self, flags, generation_config, continuous_batching_config, workload_hints)

    def generate_batch(
        self, inputs: list[list[int]], generation_config: GenerationConfig | None = None, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """Stock's, taking the attention flags per call as generate() does (`with_call_flags`)."""
        generation_config = with_call_flags(generation_config, self.generation_config, kwargs)
        return super().generate_batch(inputs, generation_config, *args, **kwargs)

    def _apply_attn_implementation_default(self) -> None:
        """Make a chosen attention the model's default: the flags in `generation_config` follow it."""
        if not self.__dict__.get("_attn_implementation_chosen"):
            return
        use_flash_attention = ATTENTION_IMPLEMENTATIONS.get(self.config._attn_implementation)
        if use_flash_attention is None:
            return
        config = self.generation_config
        config.use_flash_attention = use_flash_attention
        for name in DEFAULT_PATH_FLAGS if use_flash_attention else FLASH_ATTENTION_COMPANIONS:
            setattr(config, name, None)  # settings of the other path would now contradict the flag

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        check_flag_spelling(kwargs)
        flags = [name for name in ATTENTION_FLAG_NAMES if name in kwargs]
        if flags:  # transformers would hand it to the model's __init__: "unexpected keyword argument"
            raise TypeError(
                f"`{flags[0]}` is not an argument of from_pretrained(): the flags are given per call (generate(), "
                f"forward()) or as the model's default (`model.generation_config.{flags[0]} = ...`); "
                "attn_implementation='gaudi_fused_sdpa' loads the model with the fused kernel on."
            )
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, info) with output_loading_info=True
        if not isinstance(model.generation_config, GaudiGenerationConfig):  # a GGUF file: stock loads none
            model.generation_config = _load_gaudi_generation_config(
                pretrained_model_name_or_path, model.generation_config, kwargs
            )
        model._apply_attn_implementation_default()
        return loaded

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """Stock's save, its `config.json` naming the stock class (`architectures`), as a stock checkpoint does: tools
        that build the class from that name (`transformers serve`, PEFT's `AutoPeftModel`) find no Gaudi class in
        transformers. The Gaudi class loads it as before (by model type, after `adapt_transformers_to_gaudi()`).
        A push to the Hub goes through `push_to_hub`, which saves through here."""
        push = kwargs.pop("push_to_hub", False)
        hub = {name: kwargs.pop(name) for name in ("repo_id", "commit_message", "create_pr") if name in kwargs}
        super().save_pretrained(save_directory, *args, **kwargs)
        saves = self.should_save_on_this_rank(kwargs.get("is_main_process", True))
        if _is_own_class(type(self)):
            stock_names = [_stock_class(type(self)).__name__]
            self.config.architectures = stock_names
            config_file = Path(save_directory) / CONFIG_NAME
            if saves and config_file.is_file():  # not in PEFT's format, which saves no config
                saved = json.loads(config_file.read_text(encoding="utf-8"))
                text = json.dumps({**saved, "architectures": stock_names}, indent=2, sort_keys=True) + "\n"
                atomic_write_text(config_file, text)
        if push and saves:
            self.push_to_hub(hub.pop("repo_id", Path(save_directory).name), token=kwargs.get("token"), **hub)

    def adjust_generation_fn(
        self,
        generation_config: GenerationConfig | None,
        from_auto_class: bool,
        from_pipeline: Any,
        pretrained_model_name_or_path: Any,
        **kwargs: Any,
    ) -> None:
        """Stock's loading of the checkpoint's generation config, then the same read as a `GaudiGenerationConfig`,
        with the same arguments: from_pretrained's generation settings (`eos_token_id=...`) are applied to it, as
        stock applies them. Stock reads a plain GenerationConfig, which drops our flags from a file first derived
        from the model config."""
        super().adjust_generation_fn(
            generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, **kwargs
        )
        if isinstance(self.generation_config, GaudiGenerationConfig):
            return
        if generation_config is None and pretrained_model_name_or_path is not None:
            loading = {name: value for name, value in kwargs.items() if name != "trust_remote_code"}
            try:
                self.generation_config = GaudiGenerationConfig.from_pretrained(
                    pretrained_model_name_or_path, _from_auto=from_auto_class, _from_pipeline=from_pipeline, **loading
                )
                return
            except OSError:
                pass  # no generation_config.json: stock derived its config from the model config
        self.generation_config = GaudiGenerationConfig.from_dict(self.generation_config.to_dict())

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
        """Also tell a bucketed static cache how many tokens the next forward adds, and the prompt's forward where its
        padding lies (with the flag: one host read per generate() call), outside any compiled region or HPU graph.

        The signature is the stock one: generate() reads it to decide whether `inputs_embeds` is supported.
        generate()'s tokenizers (stop strings, assisted decoding) ride along in the model kwargs; they are not
        forward arguments, and the Gaudi attention refuses arguments it does not know.
        """
        for name in GENERATION_ONLY_KWARGS:
            kwargs.pop(name, None)
        planned_prompt = (
            is_first_iteration
            and kwargs.get("use_flash_attention")
            and is_padding_mask(attention_mask)
            and prompt_is_planned(self.config, input_ids, bool(kwargs.get("flash_attention_causal_mask")))
            and generation_masks_are_the_familys(self.config)
        )
        if is_first_iteration and kwargs.get("use_flash_attention") and is_padding_mask(attention_mask):
            kwargs["padding_side"] = ReadPaddingSide(padding_side_of(attention_mask), attention_mask.shape[-1])
        if isinstance(past_key_values, BucketedStaticCache):
            new_tokens = next_sequence_length
            if new_tokens is None:
                prompt_embeds = inputs_embeds is not None and is_first_iteration
                new_tokens = inputs_embeds.shape[1] if prompt_embeds else input_ids.shape[1] - past_key_values.tokens
            past_key_values.prepare_for_new_tokens(new_tokens)
        inputs = super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        tokens = inputs.get("inputs_embeds") if inputs.get("inputs_embeds") is not None else inputs.get("input_ids")
        if planned_prompt and tokens is not None and attention_mask.shape[1] == tokens.shape[1]:
            # A static cache gets transformers' 4-D masks from generate(); the fused path plans the prompt from its
            # 2-D mask instead (batch_layout): without the [B, 1, q, max_cache_len] one where it runs mask-free, and
            # in the causal-mask mode with the rows' valid lengths (the decoder builds the windowed layers' masks).
            inputs["attention_mask"] = attention_mask
        return inputs

    def _validate_model_kwargs(self, model_kwargs: dict[str, Any]) -> None:
        # The flags are forward arguments through `**kwargs`, which transformers' check cannot see.
        check_flag_spelling(model_kwargs)
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
        # All five, resolved here: the decoder's pre-hook (`decoder_inputs`) then acts on them.
        flags = resolve_attention_flags(pop_attention_flags(kwargs), defaults).as_dict()
        if self._stock_takes_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        # else the stock forward computes every position's logits whatever is asked, and would hand the argument on to
        # its layers' keyword arguments (MusicGen Melody's), which the Gaudi attention refuses as unknown
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            **flags,
            **kwargs,
        )


def _stock_class(gaudi_class: type) -> type[PreTrainedModel]:
    """The transformers class a Gaudi class extends: the first class after the mixin in the MRO that is a transformers
    model. Read from the MRO, not `__bases__`, so that a user's `class MyLlama(GaudiLlamaForCausalLM, SomeMixin)`
    still finds `LlamaForCausalLM`."""
    mro = gaudi_class.__mro__
    for candidate in mro[mro.index(GaudiAttentionMixin) + 1 :]:
        if issubclass(candidate, PreTrainedModel) and not issubclass(candidate, GaudiAttentionMixin):
            return candidate
    raise TypeError(f"{gaudi_class.__name__} mixes GaudiAttentionMixin into no transformers model class.")


def _own_copy(config: PreTrainedConfig) -> PreTrainedConfig:
    """The config a build writes into: a copy, so that no choice written there leaks into the caller's object (a stock
    model built from it). A config a Gaudi build filled in with stock's choice (nothing was chosen) builds the next
    model as it built that one: stock's name on it is no choice of the user's, which would turn the flag on ("sdpa")."""
    filled_in = _FILLED_IN_CONFIGS.get(id(config)) is config
    config = copy.deepcopy(config)
    if filled_in:
        for named in _configs_naming(config, config._attn_implementation_internal):
            named._attn_implementation_internal = None
    return config


def _is_own_class(cls: type) -> bool:
    """A Gaudi class this package defines, which stands for its stock class; a user's subclass lives elsewhere."""
    return cls.__module__.startswith("optimum.habana.")


def _configs_naming(config: PreTrainedConfig, name: str) -> list[PreTrainedConfig]:
    """The config and its sub-configs, at any depth, whose attention implementation is `name`."""
    found, pending = [], [config]
    while pending:
        current = pending.pop()
        if current._attn_implementation_internal == name:
            found.append(current)
        pending.extend(sub for key in current.sub_configs if (sub := getattr(current, key, None)) is not None)
    return found


def _share_stock_conversions(gaudi_class: type) -> None:
    """transformers looks a checkpoint's key conversions up by class name before model type (GPT-NeoX's `embed_out`
    is `GPTNeoXForCausalLM`'s): the Gaudi class gets the stock class's, through transformers' registration."""
    conversions = get_checkpoint_conversion_mapping(_stock_class(gaudi_class).__name__)
    if conversions is not None:
        register_checkpoint_conversion_mapping(gaudi_class.__name__, conversions, overwrite=True)


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
