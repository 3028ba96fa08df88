"""Which causal-LM families of the installed transformers run the Gaudi attention, decided from their code.

A family qualifies when its code proves that the Gaudi attention sees every attention call with everything it
needs to compute it exactly (`source_facts.py` reads the code):

1. it is a decoder: no attention of it takes an encoder's states, and it is no encoder-decoder or multimodal model
   (their text models are families of their own);
2. every module that computes attention looks its function up in transformers' attention interface; a module that
   computes scores itself would bypass the Gaudi attention (and its flag) silently;
3. every argument those modules pass to the function is one the Gaudi attention honours (`HONOURED_ARGUMENTS`);
4. the call's keyword arguments reach those modules: the causal LM, the decoder and each layer on the way hand
   `**kwargs` on. The flags and the batch's layout (planned once per forward, before the layers) travel there; a
   layer that drops them would leave its attention on the model's defaults, with a mask planned for the fused path.

A family that fails a rule gets one line saying which and where. Families that qualify are proven by the tests,
which run every one of them against the stock class (tests/families/).

`mask_free` says whether the decoder's 4-D masks may be replaced by the batch plan (a padded prompt's real tokens,
packed examples): only when nothing but the attention function reads them, and the decoder builds them with
transformers' mask builders from the 2-D padding mask alone.
"""

import functools
import importlib
import logging
import warnings
from dataclasses import dataclass

import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from .branches import forwards_kwargs_to
from .mask_facts import MASK_BUILDERS, builds_masks_with_transformers, forward_reads, mask_uses
from .source_facts import (
    call_keywords,
    computes_attention_itself,
    decoder_path,
    drops_generation_kwargs,
    init_names,
    interface_calls,
    interface_lookup_names_of,
    reads_config,
    submodules,
)


# The keyword arguments of an attention-interface call that the Gaudi attention computes exactly (attention.py).
HONOURED_ARGUMENTS = {
    "dropout": "attention dropout",
    "scaling": "the softmax scale",
    "is_causal": "causal or bidirectional",
    "sliding_window": "a sliding window",
    "softcap": "soft-capped logits",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "indices": "the keys an indexer selects (sparse attention)",
    "output_attentions": "attention weights",
    "position_ids": "positions",
    "cu_seq_lens_q": "packed sequences",
    "cu_seq_lens_k": "packed sequences",
    "max_length_q": "packed sequences",
    "max_length_k": "packed sequences",
    "attention_mask": "the mask",
}
# What the arguments the Gaudi attention refuses compute, for the line that says why a family does not qualify.
REFUSED_ARGUMENTS = {"block_indices": "block-sparse attention from an indexer"}
# What a call hands a module that attends to another model's states (an encoder's, an image's).
CROSS_ATTENTION_INPUTS = {"encoder_hidden_states", "key_value_states", "cross_attention_states"}
# Sub-configs of models that read more than text.
MULTIMODAL_PARTS = ("vision", "audio", "image", "speech", "video", "visual")
# The attention variants a family's code can show, and how the fused path computes each (docs/families.md).
SINKS = "attention sinks"
LATENT = "latent attention (value head size differs from the query's)"
SELECTED_KEYS = "sparse attention (the keys an indexer selects)"
POSITION_BIAS = "additive position bias"
SOFTCAP = "soft-capped logits"
CHUNKED = "chunked local attention"
ALTERNATING = "sliding window on some layers, alternating with full attention"
WINDOW = "sliding window"
HYBRID = "hybrid (attention beside linear-attention or state-space layers)"
PER_LAYER = "per-layer head counts and sizes"
PLAIN = "plain causal attention"
FUSED_PATHS = {
    PLAIN: "fused; a padded prompt causally over its real tokens, no mask built",
    SINKS: "fused: decode steps on CPU take the sinks into each row's softmax (the decode kernel, the cut context); "
    "elsewhere each sink is one more key of score `sink` and value 0 (FusedSDPA's own sink argument where the Gaudi "
    "software has it, in inference); gradients reach the sinks",
    LATENT: "fused: where the family caches the compressed latent (all but mimo_v2_flash), decode steps attend over "
    "it as it lies, kv_b_proj absorbed into the query and the output, nothing expanded; other decode steps on CPU run "
    "over the values' own width; a prompt's value is padded to the query's head size for the call only",
    SELECTED_KEYS: "fused, over the keys the indexer selected (the family's own selection, as a mask), never dense",
    POSITION_BIAS: "fused, the bias added to the mask as a float mask",
    SOFTCAP: "default path, one warning: no fused kernel applies tanh to the scores",
    CHUNKED: "fused; a prompt's chunked layers in chunks stacked in one causal call, no [q, kv] mask (on Gaudi the "
    "chunked mask)",
    ALTERNATING: "fused; a prompt's windowed layers in blocks of the window over their own and the previous block (one "
    "[W, 2W] band mask), the full ones causally over the real tokens: no [q, kv] mask (on Gaudi the window's mask)",
    WINDOW: "fused; a prompt in blocks of the window over their own and the previous block (one [W, 2W] band mask), "
    "no [q, kv] mask (on Gaudi the window's mask)",
    HYBRID: "the attention layers fused; linear-attention and state-space layers left to the family, caches as stock's",
    PER_LAYER: "fused; heads and head sizes read per call, never from a global config value",
}
# Layer kinds that mix tokens without softmax attention (hybrid models): the Gaudi attention leaves them alone.
NON_ATTENTION_LAYERS = {"linear_attention", "mamba", "conv", "recurrent", "hybrid", "mlp", "moe", "attention_free"}


@dataclass(frozen=True)
class FamilyReport:
    """What the library makes of one causal-LM model type."""

    model_type: str
    class_name: str  # transformers' causal LM class
    qualifies: bool
    reason: str = ""  # why not, in one line
    variants: tuple[str, ...] = ()  # the attention variants its code uses
    mask_free: bool = False  # the batch plan may replace the decoder's 4-D masks
    attention_classes: tuple[str, ...] = ()
    calls_per_attention: int = 1  # the most attention-function calls one attention module's forward makes

    @property
    def fused_path(self) -> str:
        """The table's "fused path" column: what runs in the fused kernel, and what takes the default path."""
        if not self.qualifies:
            return f"no: {self.reason}"
        if SOFTCAP in self.variants:
            return "default path for soft-capped layers (no fused kernel applies tanh to the scores); others fused"
        return "every attention call"


def causal_lm_model_types() -> tuple[str, ...]:
    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


@functools.cache
def judge_family(model_type: str) -> FamilyReport:
    """Decide whether `model_type` qualifies; see the module docstring. Imports the family's modeling code only.

    A model's `config.model_type` is its causal LM's config class's, which is not always a family's: a model type
    that only a family's config carries gets that family's report (`causal_lm_family`)."""
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None:
        family = causal_lm_family(model_type)
        if family is not None:
            return judge_family(family)
        return FamilyReport(model_type, "", False, "transformers maps no causal LM to this model type")
    try:
        stock = getattr(importlib.import_module("transformers"), class_name)
    except (ImportError, AttributeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return FamilyReport(model_type, class_name, False, f"its code cannot be imported here ({first_line})")
    return _judge(model_type, stock)


@functools.cache
def causal_lm_family(model_type: str) -> str | None:
    """The causal-LM model type (the family) whose models carry configs of `model_type`, or None.

    Itself where transformers maps a causal LM to it. Else the family whose causal LM is built from the config class
    of `model_type`, as its Gaudi class is (`config_class`): `Emu3ForCausalLM`, the causal LM of "emu3", takes an
    `Emu3TextConfig`, whose model type "emu3_text_model" its models and checkpoints carry. Only the families whose
    causal LM transformers loads from the config class's package are imported."""
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return model_type
    try:
        config_class = CONFIG_MAPPING[model_type]
    except (KeyError, ImportError, AttributeError):  # no config of transformers', or its code cannot be imported here
        return None
    package = config_class.__module__.rsplit(".", 2)[-2]  # transformers.models.emu3.configuration_emu3 -> emu3
    for family in causal_lm_model_types():
        if model_type_to_module_name(family).rsplit(".", 1)[-1] != package:
            continue
        try:
            stock = getattr(importlib.import_module("transformers"), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
        except (ImportError, AttributeError):
            continue
        if getattr(stock, "config_class", None) is config_class:
            return family
    return None


def _judge(model_type: str, stock: type) -> FamilyReport:
    def refuse(reason: str, **fields) -> FamilyReport:
        return FamilyReport(model_type, stock.__name__, False, reason, **fields)

    edges = _module_graph(stock)
    classes = {child for children in edges.values() for _, child in children} | {stock}
    multimodal = _multimodal_reason(model_type, stock, classes)
    if multimodal:
        return refuse(multimodal)
    # An encoder-decoder model type's causal LM is its decoder: refused where its layers attend to the encoder's
    # states, judged like any decoder where they do not (MusicGen Melody's decoder takes its conditioning as a prefix).
    encoder_decoder = _is_encoder_decoder(model_type)
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not encoder_decoder:
        return refuse("an encoder (masked-LM) model with a language-model head: the Gaudi attention serves decoders")
    attention = {cls for cls in classes if interface_calls(cls)}
    cross = _cross_attention(edges, attention) if encoder_decoder else []
    if cross:
        return refuse(f"the decoder of an encoder-decoder model: {_cross_attention_reason(*cross[0])}")
    bypassing = sorted(cls.__name__ for cls in classes - attention if computes_attention_itself(cls))
    if bypassing:
        return refuse(
            f"{', '.join(bypassing)} computes attention itself instead of through transformers' attention interface"
        )
    if not attention:
        return refuse(_no_attention_reason(model_type))
    if any(reads_config(cls, "is_decoder") for cls in classes):
        return refuse(
            "an encoder model that runs as a decoder only with is_decoder=True: the Gaudi attention serves decoders"
        )
    dropped = drops_generation_kwargs(stock)
    if dropped:
        return refuse(f"{dropped}, so the flags given to generate() cannot reach the attention")
    names = tuple(sorted(cls.__name__ for cls in attention))
    for cls in sorted(attention, key=lambda cls: cls.__name__):
        reason = _attention_call_reason(cls)
        if reason:
            return refuse(reason, attention_classes=names)
    reason = _keyword_path_reason(stock, edges, attention)
    if reason:
        return refuse(reason, attention_classes=names)
    return FamilyReport(
        model_type,
        stock.__name__,
        True,
        variants=_variants(stock, attention, classes),
        mask_free=_mask_free(stock, edges, attention),
        attention_classes=names,
        calls_per_attention=max(len(interface_calls(cls)) for cls in attention),
    )


def _multimodal_reason(model_type: str, stock: type, classes: set[type]) -> str:
    """Why the model type's causal LM is multimodal, or "": its config holds an audio or vision sub-config and a
    constructor of the causal LM's modules (`classes`) reads it. A config shared with the multimodal model (Moshi's)
    does not make a causal LM that builds only the text stack (`MoshiForCausalLM`, "only usable for text")
    multimodal."""
    config_class = CONFIG_MAPPING[model_type]
    sub_configs = getattr(config_class, "sub_configs", None) or {}
    encoder_configs = {name for name in sub_configs if any(part in name for part in MULTIMODAL_PARTS)}
    if stock.config_class is not config_class or not any(encoder_configs & init_names(cls) for cls in classes):
        return ""
    encoders = sorted(name.removesuffix("_config") for name in encoder_configs)
    text_type = getattr(sub_configs.get("text_config"), "model_type", None)
    if isinstance(text_type, str) and text_type:
        return (
            f"a multimodal model ({', '.join(encoders)} and text): its language model is the model type {text_type!r}"
        )
    return f"a multimodal model ({', '.join(encoders)} encoders inside the language model)"


def _is_encoder_decoder(model_type: str) -> bool:
    return bool(getattr(default_config(CONFIG_MAPPING[model_type]), "is_encoder_decoder", False))


def _module_graph(stock: type, depth: int = 6) -> dict[type, list[tuple[str, type]]]:
    """parent class -> [(attribute, child class)], for the submodules reachable from the causal LM's constructor."""
    edges: dict[type, list[tuple[str, type]]] = {}
    frontier = [stock]
    for _ in range(depth):
        next_frontier = []
        for parent in frontier:
            if parent in edges:
                continue
            children = [
                (attribute, child)
                for attribute, classes in submodules(parent).items()
                for child in sorted(classes, key=lambda cls: cls.__name__)
                if child.__module__.startswith("transformers.") or child.__module__ == parent.__module__
            ]
            edges[parent] = children
            next_frontier += [child for _, child in children]
        frontier = next_frontier
    return edges


def _no_attention_reason(model_type: str) -> str:
    config_class = CONFIG_MAPPING[model_type]
    sub_configs = getattr(config_class, "sub_configs", None) or {}
    text_type = getattr(getattr(default_config(config_class), "text_config", None), "model_type", None)
    if not text_type:  # a config transformers cannot build with its defaults (Gemma 4's assistant): its class says
        text_type = getattr(sub_configs.get("text_config"), "model_type", None)
    if text_type:
        return (
            f"its language model is built at run time from the model type {text_type!r}, which this reading does not "
            f"follow ({text_type!r} is judged on its own)"
        )
    if "text_config" in sub_configs:
        return "its language model is built at run time from its text config, of any model type: this reading cannot follow it"
    if hasattr(config_class, "num_attention_heads"):
        return "its attention does not go through transformers' attention interface"
    return "it has no attention layer (a state-space or recurrent model): the flag has nothing to do"


def _attention_call_reason(cls: type) -> str:
    for call in interface_calls(cls):
        unknown = sorted(call.keywords - set(HONOURED_ARGUMENTS))
        if unknown:
            what = "; ".join(f"{name} ({REFUSED_ARGUMENTS.get(name, 'unknown to it')})" for name in unknown)
            return f"{cls.__name__} passes its attention function {what}, which the Gaudi attention cannot compute"
        if not call.passes_kwargs:
            return (
                f"{cls.__name__} calls its attention function without the call's keyword arguments, so the flags "
                "cannot reach it"
            )
        if call.positional + ("attention_mask" in call.keywords) != 5:
            return f"{cls.__name__} calls its attention function with an argument list the interface does not define"
    return ""


def _cross_attention(edges: dict[type, list[tuple[str, type]]], attention: set[type]) -> list[tuple[type, str]]:
    """Each (module class, attribute) whose attention module it calls with another model's states, in the order of
    `edges`."""
    return [
        (parent, attribute)
        for parent, children in edges.items()
        for attribute in sorted({attribute for attribute, child in children if child in attention})
        if call_keywords(parent, attribute) & CROSS_ATTENTION_INPUTS
    ]


def _cross_attention_reason(parent: type, attribute: str) -> str:
    return (
        f"{parent.__name__} has cross-attention (self.{attribute} attends to another model's states), which the "
        "Gaudi attention does not serve"
    )


def _keyword_path_reason(stock: type, edges: dict[type, list[tuple[str, type]]], attention: set[type]) -> str:
    """Every module on the way from the causal LM to an attention module must hand the call's keywords on."""
    crossing = set(_cross_attention(edges, attention))
    holds_attention = set(attention)
    changed = True
    while changed:
        changed = False
        for parent, children in edges.items():
            if parent not in holds_attention and any(child in holds_attention for _, child in children):
                holds_attention.add(parent)
                changed = True
    for parent, children in edges.items():
        for attribute in sorted({attribute for attribute, child in children if child in holds_attention}):
            if (parent, attribute) in crossing:
                return _cross_attention_reason(parent, attribute)
            reaching = frozenset(child for name, child in children if name == attribute and child in holds_attention)
            passes = forwards_kwargs_to(parent, attribute, reaching)
            if passes is False:
                return (
                    f"{parent.__name__}.forward calls self.{attribute} without the call's keyword arguments, so the "
                    "flags and the batch plan cannot reach its attention"
                )
            if passes is None:
                return f"{parent.__name__}.forward does not call self.{attribute} where this check can see the call"
    return ""


def _variants(stock: type, attention: set[type], classes: set[type]) -> tuple[str, ...]:
    keywords = set()
    for cls in attention:
        for call in interface_calls(cls):
            keywords |= call.keywords
    config = default_config(stock.config_class)  # the causal LM's own config: a text config for `llama4`
    variants = []
    if keywords & {"s_aux", "sinks"}:
        variants.append(SINKS)
    if any("v_head_dim" in init_names(cls) for cls in attention):
        variants.append(LATENT)
    if "indices" in keywords:
        variants.append(SELECTED_KEYS)
    if "position_bias" in keywords:
        variants.append(POSITION_BIAS)
    if "softcap" in keywords:
        variants.append(SOFTCAP)
    layer_kinds = _layer_kinds(config)
    if "chunked_attention" in layer_kinds or getattr(config, "attention_chunk_size", None):
        variants.append(CHUNKED)
    if "sliding_attention" in layer_kinds and layer_kinds & {"full_attention", "chunked_attention"}:
        variants.append(ALTERNATING)
    elif "sliding_window" in keywords or "sliding_attention" in layer_kinds or windows_by_config(classes):
        variants.append(WINDOW)
    if layer_kinds & NON_ATTENTION_LAYERS:
        variants.append(HYBRID)
    if _is_heterogeneous(config):
        variants.append(PER_LAYER)
    return tuple(variants) or (PLAIN,)


def windows_by_config(classes: set[type]) -> bool:
    """Whether a forward of the model builds transformers' sliding-window mask: PhiMoE does so from
    `config.sliding_window` alone, with no layer kinds and no window handed to its attention."""
    return any(forward_reads(cls, "create_sliding_window_causal_mask") for cls in classes)


@functools.cache
def default_config(config_class: type) -> object:
    """The family's config with its defaults, or None where they do not make one; built without its log lines (a
    default that names a token outside its own vocabulary, say), which say nothing about the user's model."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config_class()
    except Exception:
        return None
    finally:
        logger.setLevel(level)


def _is_heterogeneous(config: object) -> bool:
    try:
        return bool(getattr(config, "is_heterogeneous", False))
    except Exception:  # a default config that cannot answer (it lacks a size its per-layer view reads)
        return False


def _layer_kinds(config: object) -> set[str]:
    kinds: set[str] = set()
    for name in ("layer_types", "layers_block_type", "block_types"):
        try:
            value = getattr(config, name, None)
        except Exception:
            value = None
        if isinstance(value, list | tuple):
            kinds |= {str(kind) for kind in value}
    return kinds


def _mask_free(stock: type, edges: dict[type, list[tuple[str, type]]], attention: set[type]) -> bool:
    """Whether only the attention function reads the decoder's 4-D masks, built by transformers from the 2-D mask."""
    decoder = _decoder_class(stock, edges)
    if decoder is None or not builds_masks_with_transformers(decoder):
        return False
    if mask_uses(decoder, allowed_calls=MASK_BUILDERS):
        return False
    for cls in attention:
        if mask_uses(cls, allowed_calls=interface_lookup_names_of(cls)):
            return False
    attention_holders = {parent for parent, children in edges.items() if any(c in attention for _, c in children)}
    for holder in attention_holders - attention:
        attributes = {attribute for attribute, child in edges[holder] if child in attention}
        if mask_uses(holder, allowed_calls=frozenset(f"self.{name}" for name in attributes)):
            return False
    return True


def _decoder_class(stock: type, edges: dict[type, list[tuple[str, type]]]) -> type | None:
    """The class of the decoder the causal LM's forward calls (`decoder_path`), or None where it calls none, or the
    path leads to no submodule of one class."""
    path = decoder_path(stock)
    decoder = stock if path else None
    for attribute in path:
        classes = {child for name, child in edges.get(decoder, []) if name == attribute}
        decoder = classes.pop() if len(classes) == 1 else None
        if decoder is None:
            return None
    return decoder


__all__ = [
    "HONOURED_ARGUMENTS",
    "FUSED_PATHS",
    "FamilyReport",
    "causal_lm_family",
    "causal_lm_model_types",
    "default_config",
    "judge_family",
    "transformers",
]
