"""`run_generation.py --explain`: what a command line does on this device, said before anything runs.

It reads the model's config and tokenizer (a .gguf's metadata, never its tensors), builds the model on the meta
device (no memory, no weights) to read each attention layer's scale, window and soft-capping, tokenizes the prompts
to know the padding, and prints for the prompt's forward and for the decode steps which path every attention call
takes, with the kernel's arguments, the KV cache layout, whether each phase runs as one graph when the command
captures graphs (`graphs.py`), and the effect of every flag here. The decisions mirror
`optimum.habana.transformers.attention` and transformers' mask skipping; tests run the same command lines and
compare this account with the kernel calls that happen.
"""

import dataclasses
import functools
import struct
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from optimum.habana.cli.adapters import check_adapter_folder, check_adapter_matches
from optimum.habana.kernels.cpu_decode import decode_kernel_expected
from optimum.habana.kernels.dispatch import kernel_name
from optimum.habana.transformers.attention_flags import AttentionFlags
from optimum.habana.transformers.batch_layout import (
    generation_masks_are_the_familys,
    local_layers_run_planned,
    padding_mask_is_all_it_needs,
)
from optimum.habana.transformers.continuous_batching import check_engine_serves
from optimum.habana.transformers.families.lookups import attention_with_its_own_mask
from optimum.habana.transformers.models import family_problem, gaudi_model_class
from optimum.habana.utils.gguf_reading import parsed_once
from optimum.habana.utils.model_loading import (
    ModelResolutionError,
    check_gguf_file,
    converted_gguf_checkpoint,
    default_gguf_path,
    resolve_model,
)

from ..arguments import ExecutionArguments, ScriptArguments, WorkloadArguments, flag_notes, resolve_execution
from ..continuous_batching import ENGINE_REFUSAL_REMEDY, batch_size_note, request_prompts
from ..generation_config import check_static_cache, kv_cache_layout
from ..prompts import check_sequence_length, prompt_pool, prompts_for_batch, render_prompts, tokenize_prompts
from .calls import Phase, call_account, format_range, kernel_account, phases
from .engine import engine_call_accounts
from .graphs import graph_accounts
from .keys import group_lengths, run_cache
from .layers import LayerGroup, attention_layer_groups, other_layer_kinds


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
    if not engine:
        check_static_cache(arguments, layout, config, device)
    max_cache_len = input_length + workload.max_new_tokens
    flags = arguments.attention.attention_flags()
    groups = attention_layer_groups(model)
    rows = max(workload.num_beams, 1) * workload.batch_size
    cache, cache_words = run_cache(layout, config, max_cache_len, device, arguments.execution.torch_compile)

    lines = [
        f"Explain (nothing runs; config and tokenizer only): {description}",
        f"Model: {model_class.__name__}, {sum(len(group.indices) for group in groups)} attention layers, "
        f"max positions {max_positions}",
        f"Device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}",
        f"Prompt: {rows} row(s) of {input_length} tokens, "
        + ("padded on the left" if padded else "no padding")
        + f"; up to {workload.max_new_tokens} new tokens",
        f"KV cache: {cache_words}",
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
    masks_from_config = generation_masks_are_the_familys(config)
    causal_mask_plans = attention_with_its_own_mask(config.model_type) is None
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
    lengths = group_lengths(None if engine else cache, groups, rows, input_length, workload.max_new_tokens)
    for phase in [] if engine else phases(layout.kind, input_length, workload.max_new_tokens, padded):
        # Each group's own key lengths (windows keep theirs); said once in the phase's line where they agree.
        per_group = [
            dataclasses.replace(phase, kv_lengths=known.get(phase.name.split(",")[0], phase.kv_lengths))
            for known in lengths
        ]
        same = len({group_phase.kv_lengths for group_phase in per_group}) <= 1
        kv = f", kv={format_range(per_group[0].kv_lengths)}" if same and per_group else ""
        lines.append(f"  {phase.name} (q={phase.q_len}{kv}{', padded rows' if phase.padded else ''}):")
        for group, group_phase in zip(groups, per_group, strict=True):
            account = call_account(
                flags, group, group_phase, device, prompt_plan, kernel, masks_from_config, causal_mask_plans
            )
            keys = "" if same else f"kv={format_range(group_phase.kv_lengths)}: "
            lines.append(f"    {group.label}: {keys}{account}")
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


__all__ = ["LayerGroup", "Phase", "attention_layer_groups", "explain", "meta_model"]
