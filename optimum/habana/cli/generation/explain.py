"""`run_generation.py --explain`: what a command line does on this device, said before anything runs.

It reads the model's config and tokenizer (a .gguf's metadata, never its tensors), builds the model on the meta
device (no memory, no weights) to read each attention layer's scale, window and soft-capping, tokenizes the prompts
to know the padding, and prints for the prompt's forward and for the decode steps which path every attention call
takes, with the kernel's arguments, the KV cache layout, whether each phase runs as one graph when the command
captures graphs (`explain_graphs`), and the effect of every flag here. The decisions mirror
`optimum.habana.transformers.attention` and transformers' mask skipping; tests run the same command lines and
compare this account with the kernel calls that happen.
"""

import dataclasses
import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from optimum.habana.cli.adapters import check_adapter_folder, check_adapter_matches
from optimum.habana.kernels.cpu_decode import decode_kernel_expected
from optimum.habana.kernels.dispatch import kernel_name, kernel_path
from optimum.habana.kernels.latent import absorbs
from optimum.habana.transformers.attention_flags import AttentionFlags
from optimum.habana.transformers.batch_layout import local_layers_run_planned, padding_mask_is_all_it_needs
from optimum.habana.transformers.cache import bucketed_length
from optimum.habana.transformers.continuous_batching import check_engine_serves
from optimum.habana.transformers.families.lookups import attention_modules_of, call_window
from optimum.habana.transformers.latent_attention import receives_compressed_latent
from optimum.habana.transformers.models import family_problem, gaudi_model_class
from optimum.habana.utils.gguf_parsing import parsed_once
from optimum.habana.utils.model_loading import (
    ModelResolutionError,
    check_gguf_file,
    converted_gguf_checkpoint,
    default_gguf_path,
    resolve_model,
)

from .arguments import ExecutionArguments, ScriptArguments, WorkloadArguments, flag_notes, resolve_execution
from .continuous_batching import ENGINE_REFUSAL_REMEDY, batch_size_note, request_prompts
from .explain_engine import SINKS_VARIANT, engine_call_accounts
from .explain_graphs import graph_accounts
from .generation_config import kv_cache_layout
from .prompts import check_sequence_length, prompt_pool, prompts_for_batch, render_prompts, tokenize_prompts


@dataclass(frozen=True)
class LayerGroup:
    """Attention layers that take the same decisions: same window, soft-capping, scale and variant."""

    indices: tuple[int, ...]
    sliding_window: int | None
    softcap: float | None
    scaling: float
    variant: str = ""  # what the layer's attention does besides plain attention: sinks, latent heads, chunks, ...
    chunk: int | None = None  # a chunked layer's chunk size
    geometry: tuple[int, int, int, int, bool] = (1, 1, 1, 1, False)  # heads, kv heads, q/k and v head sizes, sinks
    latent: tuple[int, int] | None = None  # a compressed cache's latent and rotary key sizes (latent_attention.py)

    @property
    def label(self) -> str:
        return f"layers {format_indices(self.indices)}" + (f" ({self.variant})" if self.variant else "")


@dataclass(frozen=True)
class Phase:
    name: str  # "prefill" or "decode"
    q_len: int
    kv_lengths: tuple[int, int]  # first and last key length of the phase
    padded: bool
    from_empty_cache: bool = False  # the whole sequence each call: no cache, or the prompt's forward


def explain(arguments: ScriptArguments) -> str:
    """The account printed by --explain; a ValueError names a bad input, as a real run would."""
    device, dtype = resolve_execution(arguments)
    workload = arguments.workload
    config, tokenizer, description = read_config_and_tokenizer(arguments.model.model_name_or_path)
    model_class = gaudi_class_of(config.model_type, description)
    model = meta_model(model_class, config)
    adapter = arguments.model.peft_model
    if adapter:  # the checks of a real run, against the model built on the meta device
        adapter_config = check_adapter_folder(adapter, "--peft_model")
        check_adapter_matches(adapter, model, "--peft_model")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    engine = arguments.execution.continuous_batching
    if engine:
        check_engine_serves(model, remedy=ENGINE_REFUSAL_REMEDY)
    # The engine serves every prompt of the pool as its own request (cycled up to --batch_size); generate() a batch.
    pool = prompt_pool(workload)
    prompts = request_prompts(pool, workload.batch_size) if engine else prompts_for_batch(pool, workload.batch_size)
    inputs, _ = tokenize_prompts(
        tokenizer, render_prompts(tokenizer, prompts, workload.chat), workload.max_input_tokens, workload.chat
    )
    input_length = inputs["input_ids"].shape[1]
    max_positions = getattr(config, "max_position_embeddings", None)
    check_sequence_length(input_length, workload.max_new_tokens, max_positions, fixed=workload.max_input_tokens > 0)
    padded = bool((inputs["attention_mask"] == 0).any())
    layout = kv_cache_layout(arguments, device)
    max_cache_len = input_length + workload.max_new_tokens
    flags = arguments.attention.attention_flags()
    groups = attention_layer_groups(model)
    rows = max(workload.num_beams, 1) * workload.batch_size

    lines = [
        f"Explain (nothing runs; config and tokenizer only): {description}",
        f"Model: {model_class.__name__}, {sum(len(group.indices) for group in groups)} attention layers, "
        f"max positions {max_positions}",
        f"Device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}",
        f"Prompt: {rows} row(s) of {input_length} tokens, "
        + ("padded on the left" if padded else "no padding")
        + f"; up to {workload.max_new_tokens} new tokens",
        f"KV cache: {layout.describe(max_cache_len)}",
    ]
    if engine:
        lines[-2:] = [
            f"Requests: {len(prompts)} prompt(s) of up to {input_length} tokens, each its own request in "
            f"transformers' continuous batching; up to {workload.max_new_tokens} new tokens each",
            "KV cache: the engine's paged cache (pages shared by every request; no padding)",
        ]
        if note := batch_size_note(len(pool), workload.batch_size):
            lines.append(note)
    if adapter:
        kept = adapter_config["peft_type"] == "ADAPTION_PROMPT"  # cannot be merged into weights
        lines.append(
            f"Adapter: {adapter} ({adapter_config['peft_type']}, fits the model), "
            + (
                "kept in its attention layers (an adaption prompt cannot be merged): each layer's attention call "
                "below is followed by the adapter's small attention over its prompt tokens"
                if kept
                else "merged into the weights before generating: the attention calls are the base model's"
            )
        )
    lines += ["", "Attention calls:"]
    # A padded prompt's plan (batch_layout): every layer full attention, or, off Gaudi, windows and chunks too.
    prompt_plan = padding_mask_is_all_it_needs(config) or (device.type != "hpu" and local_layers_run_planned(config))
    if engine:
        # The engine's eager decode steps on CPU read the paged cache on the decode kernel (kernels/cpu_decode.py).
        paged_kernel = device.type == "cpu" and not arguments.execution.torch_compile and decode_kernel_expected(dtype)
        max_batch_tokens = arguments.execution.cb_max_batch_tokens
        lines += engine_call_accounts(
            flags, groups, config, device, kernel_name(device), paged_kernel, max_batch_tokens
        )
    kernel = functools.partial(
        kernel_account, device=device, dtype=dtype, rows=rows, compiled=arguments.execution.torch_compile
    )
    for phase in (
        [] if engine else phases(layout.kind, input_length, workload.max_new_tokens, padded, max_cache_len, layout)
    ):
        lines.append(
            f"  {phase.name} (q={phase.q_len}, kv={format_range(phase.kv_lengths)}"
            f"{', padded rows' if phase.padded else ''}):"
        )
        for group in groups:
            account = call_account(flags, group, phase, device, prompt_plan, kernel)
            lines.append(f"    {group.label}: {account}")
    if others := other_layer_kinds(config):
        lines.append(f"  other layers: {', '.join(others)}: no softmax attention, the flag leaves them to the model")
    lines += ["", "Graphs:"]
    lines += [f"  {line}" for line in graph_accounts(arguments, config, inputs, device)]
    lines += ["", "Flags:"]
    lines += [f"  {line}" for line in flag_accounts(arguments, device, layout.kind)]
    notes = flag_notes(arguments, device, dtype, pool_size=len(pool))
    if notes:
        lines += ["", "Notes (printed by a real run too):"]
        lines += [f"  {note}" for note in notes]
    return "\n".join(lines)


def read_config_and_tokenizer(model_name_or_path: str | None):
    """Config, tokenizer and a description, without loading or converting weights (a .gguf: its conversion's files
    when the cache holds one, else its metadata)."""
    gguf = default_gguf_path() if model_name_or_path is None else Path(model_name_or_path).expanduser()
    if gguf.suffix.lower() == ".gguf" and gguf.is_file() and (converted := converted_gguf_checkpoint(gguf)):
        description = f"{gguf.name} (converted earlier, cached at {converted})"
        return AutoConfig.from_pretrained(converted), AutoTokenizer.from_pretrained(converted), description
    if gguf.suffix.lower() == ".gguf" and gguf.is_file():
        check_gguf_file(gguf)  # a damaged file or another architecture is refused in the words of a real run
        try:
            with parsed_once():  # the config and the tokenizer from one parse of the file (4 s each for SmolLM2)
                config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, KeyError, IndexError, OSError, struct.error) as error:
            detail = (str(error).strip().splitlines() or [""])[0]
            raise ModelResolutionError(
                f"The GGUF file {str(gguf)!r} cannot be read ({type(error).__name__}: {detail}); it is damaged or "
                "truncated, or not a GGUF model file."
            ) from None
        return config, tokenizer, f"{gguf.name} (GGUF metadata)"
    resolved = resolve_model(model_name_or_path)
    config = AutoConfig.from_pretrained(resolved.path)
    gaudi_class_of(config.model_type, resolved.description)  # before the tokenizer, as a real run checks it
    return config, AutoTokenizer.from_pretrained(resolved.path), resolved.description


def gaudi_class_of(model_type: str, description: str) -> type:
    """The model's Gaudi class; a family without one is refused in a real run's words."""
    problem = family_problem(model_type)
    if problem is not None:
        raise ModelResolutionError(f"{description} is a {model_type!r} model, which has no Gaudi class: {problem}.")
    return gaudi_model_class(model_type)


def meta_model(model_class: type, config) -> torch.nn.Module:
    """The model's modules and shapes, with no memory and no weights."""
    with torch.device("meta"):
        return model_class(config)


def attention_layer_groups(model: torch.nn.Module) -> list[LayerGroup]:
    """Each attention layer's window, soft-capping, scale and variant, read from the model built on the meta device
    (the modules of the family's attention classes, `FamilyReport.attention_classes`)."""
    by_settings: dict[tuple, list[int]] = {}
    for index, module in enumerate(attention_modules_of(model)):
        settings = (
            call_window(module, model.config),
            getattr(module, "attn_logit_softcapping", None),
            float(module.scaling),
            layer_variant(module, model.config),
            layer_chunk(module, model.config),
            layer_geometry(module, model.config),
            (module.kv_lora_rank, module.qk_rope_head_dim) if receives_compressed_latent(module) else None,
        )
        by_settings.setdefault(settings, []).append(index)
    return [LayerGroup(tuple(indices), *settings) for settings, indices in by_settings.items()]


def layer_geometry(module: torch.nn.Module, config) -> tuple[int, int, int, int, bool]:
    """The shapes one layer hands the kernel: query heads, key/value heads, query/key and value head sizes, and
    whether it has sinks (read off the module as transformers' attention classes name them)."""
    layer_config = getattr(module, "config", None) or config
    heads = getattr(module, "num_heads", None) or layer_config.num_attention_heads
    groups = getattr(module, "num_key_value_groups", None)
    kv_heads = heads // groups if isinstance(groups, int) and groups else None
    kv_heads = kv_heads or getattr(layer_config, "num_key_value_heads", None) or heads  # GPT-2 names none: one a head
    head_dim = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
    head_dim = head_dim or layer_config.hidden_size // layer_config.num_attention_heads
    value_dim = getattr(module, "v_head_dim", None) or head_dim
    return heads, kv_heads, head_dim, value_dim, isinstance(getattr(module, "sinks", None), torch.Tensor)


def kernel_account(
    group: LayerGroup,
    phase: Phase,
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    *,
    masked: bool,
    compiled: bool,
) -> str:
    """The kernel a call of this group and phase reaches and the transforms before it, as `fused_sdpa` decides them
    (`kernel_path`), on stand-ins of the call's shapes that hold one value each (no memory, nothing runs)."""
    heads, kv_heads, head_dim, value_dim, has_sinks = group.geometry
    q_len, kv_len = phase.q_len, phase.kv_lengths[1]

    def stand_in(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros(shape[-1], device=device, dtype=dtype).expand(*shape)

    mask = stand_in(rows, 1, q_len, kv_len, dtype=torch.bool) if masked else None
    path = kernel_path(
        stand_in(rows, heads, q_len, head_dim), stand_in(rows, kv_heads, kv_len, head_dim),
        stand_in(rows, kv_heads, kv_len, value_dim), mask, is_causal=mask is None and q_len > 1, dropout_p=0.0,
        sinks=torch.zeros(heads, device=device, dtype=dtype) if has_sinks else None,
    )  # fmt: skip
    if compiled and path.kernel == "split_context":  # a compiled graph's call is never cut (the thread count)
        path = path._replace(kernel="pytorch_fused", splits=1)
    return path.describe(device)


def layer_chunk(module: torch.nn.Module, config) -> int | None:
    layer_types = getattr(config, "layer_types", None) or ()
    layer_index = getattr(module, "layer_idx", None)
    chunked = (
        isinstance(layer_index, int)
        and layer_index < len(layer_types)
        and layer_types[layer_index] == "chunked_attention"
    )
    return config.attention_chunk_size if chunked else None


def layer_variant(module: torch.nn.Module, config) -> str:
    """What one attention layer does besides plain attention, in the words of the fused path's account."""
    parts = []
    layer_types = getattr(config, "layer_types", None) or ()
    layer_index = getattr(module, "layer_idx", None)
    kind = layer_types[layer_index] if isinstance(layer_index, int) and layer_index < len(layer_types) else None
    if kind == "chunked_attention":
        parts.append(f"chunked local attention, chunks of {config.attention_chunk_size} tokens")
    if isinstance(window := call_window(module, config), int):
        parts.append(f"sliding window of {window} tokens")
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        parts.append(SINKS_VARIANT)
    key_size, value_size = getattr(module, "qk_head_dim", None), getattr(module, "v_head_dim", None)
    if isinstance(key_size, int) and isinstance(value_size, int) and key_size != value_size:
        parts.append(f"latent attention: query/key heads of {key_size}, value heads of {value_size}")
    if getattr(module, "indexer", None) is not None:
        parts.append(f"sparse: the indexer's {getattr(config, 'index_topk', '?')} keys per query, as a mask")
    if getattr(config, "is_heterogeneous", False):
        heads = getattr(module, "num_heads", None) or getattr(
            getattr(module, "config", None), "num_attention_heads", "?"
        )
        parts.append(f"this layer's geometry: {heads} heads of {getattr(module, 'head_dim', '?')}")
    return "; ".join(parts)


def other_layer_kinds(config) -> list[str]:
    """A hybrid's layers that are no softmax attention, counted by kind."""
    kinds = [
        kind for kind in getattr(config, "layer_types", None) or () if "attention" not in kind or "linear" in kind
    ]
    return [f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds)]


def phases(
    cache_kind: str, input_length: int, max_new_tokens: int, padded: bool, max_cache_len: int, layout
) -> list[Phase]:
    """The prompt's forward and the decode steps, with the key lengths the attention sees."""
    if cache_kind in ("dynamic", "none"):
        prefill_kv = (input_length, input_length)
    elif cache_kind == "bucketed":
        bucket = layout.bucket_size
        prefill_kv = (bucketed_length(input_length, bucket, max_cache_len),) * 2
    else:
        prefill_kv = (max_cache_len, max_cache_len)
    result = [Phase("prefill", input_length, prefill_kv, padded, from_empty_cache=True)]
    if max_new_tokens > 1:
        first, last = input_length + 1, input_length + max_new_tokens - 1
        if cache_kind == "none":
            result.append(Phase("decode, whole sequence each step", first, (first, last), padded, True))
            return result
        if cache_kind == "dynamic":
            decode_kv = (first, last)
        elif cache_kind == "bucketed":
            decode_kv = (
                bucketed_length(first, layout.bucket_size, max_cache_len),
                bucketed_length(last, layout.bucket_size, max_cache_len),
            )
        else:
            decode_kv = (max_cache_len, max_cache_len)
        result.append(Phase("decode", 1, decode_kv, padded))
    return result


def mask_is_skipped(group: LayerGroup, phase: Phase) -> bool:
    """transformers passes no mask when causality alone is exact (masking_utils._ignore_causal_mask_sdpa)."""
    if phase.padded:
        return False
    if group.sliding_window is not None and phase.kv_lengths[1] >= group.sliding_window:
        return False
    if phase.name != "prefill" and phase.from_empty_cache:
        return True  # each step reads the whole sequence: as many keys as queries
    return phase.q_len == 1 or phase.kv_lengths == (phase.q_len, phase.q_len)


def absorbed_phase(group: LayerGroup, q_len: int) -> bool:
    """Whether a latent attention layer's call of `q_len` query rows absorbs its up-projection (`kernels.latent`)."""
    (latent_size, rope), (_, _, head_dim, value_dim, _) = group.latent, group.geometry
    return absorbs(q_len, latent_size, rope, head_dim - rope, value_dim)


def call_account(
    flags: AttentionFlags,
    group: LayerGroup,
    phase: Phase,
    device: torch.device,
    model_mask_free: bool,
    kernel: Callable[..., str],
) -> str:
    """The path of this group's calls in this phase, and the arguments the kernel gets (`kernel`: `kernel_account`
    with the run's device, dtype and rows, which names the kernel and the transforms before it)."""
    is_prefill = phase.q_len > 1
    mask_skipped = mask_is_skipped(group, phase)
    mask = "None" if mask_skipped else f"boolean [rows, 1, {phase.q_len}, kv]"
    if not flags.use_flash_attention or group.softcap is not None:
        softmax = "model dtype" if flags.attn_softmax_bf16 else "float32"
        why = ""
        if flags.use_flash_attention:
            why = f" (soft-capped logits, softcap={group.softcap}: no fused kernel computes them; one warning)"
        causal = ", causal" if mask_skipped and is_prefill else ""
        return f"default path{why}: matmul-softmax, softmax in {softmax}, mask {mask}{causal}, scale {group.scaling:g}"
    # The decoder plans a padded prompt from an empty cache once (batch_layout): without a mask where no layer needs
    # more than the padding and the device's kernel does not read the mask, whatever the cache (generate() keeps the
    # 2-D mask for it); with the causal-mask mode also elsewhere, where its 2-D mask reaches the decoder (a dynamic
    # cache; a static one gets 4-D masks from generate()).
    no_cache_step = phase.name != "prefill"  # without a KV cache every step is a prefill from empty
    dynamic_prefill = (
        is_prefill and phase.from_empty_cache and (no_cache_step or phase.kv_lengths == (phase.q_len, phase.q_len))
    )
    mask_free = (
        phase.padded
        and is_prefill
        and phase.from_empty_cache
        and model_mask_free
        and not (device.type == "hpu" and not flags.flash_attention_causal_mask)
    )
    planned = mask_free or (dynamic_prefill and flags.flash_attention_causal_mask)
    window = group.sliding_window if group.sliding_window is not None and phase.q_len > group.sliding_window else None
    chunk = group.chunk if group.chunk is not None and phase.q_len > group.chunk else None
    # Off Gaudi a planned prompt's local layer runs in windows or chunks (kernels/local_attention.py); on Gaudi, and
    # where the plan kept transformers' mask, the mask keeps the window.
    runs_local = (
        (window or chunk) and is_prefill and phase.from_empty_cache and model_mask_free and device.type != "hpu"
    )
    window_kept = planned and window is not None and not runs_local
    if window_kept:
        planned = False
    prompt_companions = is_prefill and (flags.flash_attention_recompute or flags.flash_attention_fast_softmax)
    if (
        group.latent is not None
        and not (planned or window or prompt_companions)
        and absorbed_phase(group, phase.q_len)
    ):
        return (
            f"over the compressed cache (kv_b_proj absorbed into the query and the output; kernels/latent.py): "
            f"attn_mask={mask}, is_causal={mask_skipped and is_prefill}, scale={group.scaling:g}"
        )
    masked = False  # whether the kernel reads a mask: the last case below, where the phase keeps one
    if runs_local and window:
        arguments = (
            f"attn_mask=None within a window of {window}: the first {window} queries causally, then blocks of "
            f"{window} queries over their own and the previous block (one [{window}, {2 * window}] band mask)"
        )
    elif runs_local:
        arguments = f"attn_mask=None, is_causal=True within each chunk of {chunk} (the chunks stacked in one call)"
    elif planned and device.type == "hpu" and phase.padded:
        arguments = "attn_mask=None, is_causal=True, valid lengths per row"
    elif planned and phase.padded:
        arguments = (
            "attn_mask=None, is_causal=True over each row's real tokens (rows permuted so that they come first)"
        )
    elif planned or (mask_skipped and is_prefill):
        arguments = "attn_mask=None, is_causal=True"
    else:
        arguments = f"attn_mask={mask}" + (" (additive)" if device.type == "hpu" else "") + ", is_causal=False"
        masked = not mask_skipped
    if mask_free or runs_local:
        arguments += " (no padding mask is built)" if not runs_local else " (no [q, kv] mask is built)"
    softmax_mode = "fast" if flags.flash_attention_fast_softmax and is_prefill else "None"
    recompute = flags.flash_attention_recompute and is_prefill
    account = (
        f"fused kernel, {kernel(group, phase, masked=masked)}: {arguments}, scale={group.scaling:g}, "
        f"softmax_mode={softmax_mode}, "
        f"recompute={recompute}"
    )
    if window_kept:
        account += f" (sliding window {group.sliding_window} < prompt: the mask keeps it; one warning)"
    if softmax_mode == "fast" and device.type != "hpu":
        account += " (no fast softmax here: one warning, exact softmax)"
    return account


def flag_accounts(arguments: ScriptArguments, device: torch.device, cache_kind: str) -> list[str]:
    """Every flag of the attention, workload and execution groups: its value, given or default, and its effect."""
    effects = {
        "use_flash_attention": "fused kernel for every attention call"
        if arguments.attention.use_flash_attention
        else "default matmul-softmax attention",
        "use_kv_cache": f"KV cache: {cache_kind}",
        "static_shapes": "static KV cache" if cache_kind in ("static", "bucketed") else "dynamic KV cache",
        "torch_compile": "prompt and decode step compiled (static cache)"
        if arguments.execution.torch_compile
        else "eager",
        "ignore_eos": "no stop at the end-of-sequence token (eos_token_id=[])"
        if arguments.workload.ignore_eos
        else "each sequence stops at its end-of-sequence token",
        "max_input_tokens": "prompts padded/truncated to this length"
        if arguments.workload.max_input_tokens > 0
        else "prompts as they are (padded to the longest)",
    }
    groups = [
        (AttentionFlags, arguments.attention),
        (WorkloadArguments, arguments.workload),
        (ExecutionArguments, arguments.execution),
    ]
    skip = {"prompt", "device", "chat", "temperature", "top_p", "top_k", "do_sample", "num_beams", "seed"}
    lines = []
    for dataclass_type, values in groups:
        for field in dataclasses.fields(dataclass_type):
            if field.name in skip:
                continue
            value = getattr(values, field.name)
            origin = "default" if value == field.default else "given"
            effect = effects.get(field.name, "")
            lines.append(f"--{field.name} = {value} ({origin}){': ' + effect if effect else ''}")
    return lines


def format_range(bounds: tuple[int, int]) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}..{bounds[1]}"


def format_indices(indices: tuple[int, ...]) -> str:
    if list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])
    return ",".join(str(index) for index in indices)
