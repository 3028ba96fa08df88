#!/usr/bin/env python
"""Generate text with a causal LM and measure it, with the fused attention kernel (--use_flash_attention) or not.

    python examples/text-generation/run_generation.py                        # embedded SmolLM2-135M-Instruct
    python examples/text-generation/run_generation.py --use_flash_attention  # the same through the fused kernel
    python examples/text-generation/run_generation.py --chat --prompt "What is the capital of France?"

It prints the generated texts, then throughput, latencies, memory, load and compile times; --output_dir also
writes them to results.json (with Optimum-Habana's top-level keys). --explain says what a command line does on
this device without running it. `--help` lists every argument; docs/run_generation.md explains them.
The reusable pieces live in `optimum.habana.cli.generation`.
"""

import logging
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from optimum.habana.cli.adapters import apply_peft_adapter, check_adapter_folder
from optimum.habana.cli.common import check_output_dir, exit_on_interrupt_or_oom, prepare_output_dir
from optimum.habana.cli.compile_backend import compile_failure
from optimum.habana.cli.generation import continuous_batching, multi_process
from optimum.habana.cli.generation.arguments import (
    RESULTS_FILENAME,
    ScriptArguments,
    build_parser,
    flag_notes,
    parse_arguments,
    resolve_execution,
    usage_error,
)
from optimum.habana.cli.generation.capture import capture, compile_backend, describe_compilation, is_captured
from optimum.habana.cli.generation.continuous_batching import tokenize_requests
from optimum.habana.cli.generation.explain import explain
from optimum.habana.cli.generation.generation_config import (
    KVCacheSupply,
    build_generation_config,
    check_static_cache,
    kv_cache_layout,
)
from optimum.habana.cli.generation.prompts import (
    check_sequence_length,
    prompt_pool,
    prompts_for_batch,
    render_prompts,
    tokenize_prompts,
)
from optimum.habana.cli.generation.report import (
    decode_new_tokens,
    format_header,
    format_stats,
    format_texts,
    results_document,
    write_results,
)
from optimum.habana.cli.generation.timing import benchmark, summarize_runs
from optimum.habana.transformers.continuous_batching import check_engine_serves
from optimum.habana.utils.devices import memory_stats, model_size_bytes, reset_peak_memory, total_memory
from optimum.habana.utils.distributed import launch_environment
from optimum.habana.utils.graph_capture import CompileCounter
from optimum.habana.utils.model_loading import ModelResolutionError


def kept_results(arguments: ScriptArguments, results: dict) -> Path:
    """results.json written; one that another run put in the folder since it was checked is kept, and said so."""
    output = arguments.output
    path = write_results(output.output_dir, results, overwrite=output.overwrite_output_dir)
    if path.name != RESULTS_FILENAME:
        kept = Path(output.output_dir) / RESULTS_FILENAME
        print(
            f"run_generation.py: note: {kept} appeared during the run (another run's?) and is kept.", file=sys.stderr
        )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    launch = launch_environment()  # torchrun's RANK, WORLD_SIZE...: one process without a launcher
    multi_process.silence_other_ranks(launch)
    parser = build_parser()
    arguments = parse_arguments(parser, argv)
    workload, execution = arguments.workload, arguments.execution
    show_library_progress()
    if arguments.output.explain:
        try:
            if arguments.output.output_dir:  # refused as a real run refuses it; nothing created
                check_output_dir(
                    arguments.output.output_dir,
                    overwrite=arguments.output.overwrite_output_dir,
                    resuming=False,
                    can_resume=False,
                )
            print(explain(arguments))
        except (ModelResolutionError, ValueError) as error:
            usage_error(parser, str(error))
        return 0

    # Everything that can still be a bad input (device, model, adapter, prompts) is checked before generating.
    try:
        multi_process.validate_parallel_arguments(arguments.parallel, launch)
        if execution.continuous_batching and launch.is_distributed:
            raise ValueError("--continuous_batching runs in one process here: launch it without torchrun.")
        # Checked now: a folder that cannot be written would lose the results. Only rank 0 writes there.
        if arguments.output.output_dir and launch.is_main:
            prepare_output_dir(
                arguments.output.output_dir,
                overwrite=arguments.output.overwrite_output_dir,
                resuming=False,
                can_resume=False,
            )
        if arguments.model.peft_model:  # the adapter's files, before the model loads; its fit to the model after
            check_adapter_folder(arguments.model.peft_model, "--peft_model")
        device, dtype = resolve_execution(arguments)
        pool = prompt_pool(workload)
        notes = flag_notes(arguments, device, dtype, pool_size=len(pool))
        if execution.continuous_batching:
            notes += filter(None, [continuous_batching.batch_size_note(len(pool), workload.batch_size)])
        for note in notes:
            print(f"Note: {note}", file=sys.stderr)
        run = multi_process.start(arguments.parallel, device, launch)
        device = run.device
        loaded = multi_process.load_model(arguments.model.model_name_or_path, dtype=dtype, run=run)
        model, tokenizer = loaded.model, loaded.tokenizer
        load_seconds = loaded.load_seconds
        max_positions = getattr(model.config, "max_position_embeddings", None)
        if workload.max_input_tokens > 0:  # before tokenizing: padding to a huge length would take minutes
            check_sequence_length(workload.max_input_tokens, workload.max_new_tokens, max_positions, fixed=True)
        if execution.continuous_batching:
            check_engine_serves(model, remedy=continuous_batching.ENGINE_REFUSAL_REMEDY)
        else:
            check_static_cache(arguments, kv_cache_layout(arguments, device), model.config, device)
        if arguments.model.peft_model:
            start = time.perf_counter()
            model = apply_peft_adapter(model, arguments.model.peft_model)
            load_seconds += time.perf_counter() - start
        if execution.continuous_batching:  # every prompt a request, --batch_size of them per engine step at most
            prompts = continuous_batching.request_prompts(pool, workload.batch_size)
        else:
            prompts = prompts_for_batch(pool, workload.batch_size)
        texts = render_prompts(tokenizer, prompts, workload.chat)
        inputs, prompt_lengths = tokenize_prompts(tokenizer, texts, workload.max_input_tokens, workload.chat)
        input_length = inputs["input_ids"].shape[1]
        check_sequence_length(
            input_length, workload.max_new_tokens, max_positions, fixed=workload.max_input_tokens > 0
        )
    except (ModelResolutionError, ValueError) as error:
        usage_error(parser, str(error))

    print(format_header(loaded.resolved.description, device, dtype, arguments), flush=True)
    print(multi_process.format_run(run), flush=True)
    if workload.max_input_tokens > 0 and max(prompt_lengths) > workload.max_input_tokens:
        print(f"Note: prompts longer than {workload.max_input_tokens} tokens keep their last tokens.", file=sys.stderr)
    if is_captured(execution, device) and execution.warmup == 0:
        print("Note: with --warmup 0 the compilation is part of the first measured run.", file=sys.stderr)
    model = capture(model, execution, device)
    if execution.sdp_on_bf16:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    if arguments.attention.attn_softmax_bf16 and arguments.attention.use_flash_attention:
        warnings.filterwarnings("ignore", message="attn_softmax_bf16 with use_flash_attention")  # noted above
    generation_config = build_generation_config(model.generation_config, arguments, tokenizer.pad_token_id, device)
    if execution.continuous_batching:
        requests = tokenize_requests(tokenizer, texts, workload.max_input_tokens)
        return generate_continuously(arguments, parser, model, tokenizer, requests, prompts, generation_config, device)
    cache_supply = KVCacheSupply(
        kv_cache_layout(arguments, device), model.config, max_cache_len=input_length + workload.max_new_tokens
    )
    if execution.torch_compile:
        cache_supply.allow_one_graph_per_bucket()
    inputs = inputs.to(device)

    reset_peak_memory(device)  # the peak below is that of generation, not of loading
    out_of_memory = (
        f"out of {device.type} memory generating batch {workload.batch_size} x {input_length} prompt + "
        f"{workload.max_new_tokens} new tokens. Lower --batch_size, --max_input_tokens or --max_new_tokens, or add "
        "--use_flash_attention (O(N) attention memory). No results were written."
    )
    backend = compile_backend(execution, device) if execution.torch_compile else None
    try:
        with (
            exit_on_interrupt_or_oom(
                parser.prog,
                on_interrupt=lambda: "no results were written.",
                on_out_of_memory=lambda error: out_of_memory,
            ),
            CompileCounter() as compilation,
        ):
            result = benchmark(
                model,
                inputs,
                generation_config,
                device=device,
                seed=workload.seed,
                warmup=execution.warmup,
                n_iterations=execution.n_iterations,
                cache_supply=cache_supply,
            )
    except torch._dynamo.exc.BackendCompilerFailed as error:  # a backend that compiled the check's function only
        usage_error(
            parser,
            f"torch.compile ({backend}) failed on the model: {compile_failure(error)}. No results were written.",
        )
    memory = memory_stats(device)
    model_size = model_size_bytes(model)
    if execution.torch_compile:
        print(describe_compilation(compilation.report, backend, workload.num_beams), file=sys.stderr, flush=True)

    outputs = decode_new_tokens(tokenizer, result.output, input_length)
    # Graphs compiled (torch.compile's count), or HPU graphs recorded on Gaudi: only then did the warm-up compile.
    compiled = compilation.report.graphs > 0 if execution.torch_compile else is_captured(execution, device)
    stats = {
        **summarize_runs(result.runs, workload.batch_size),
        "input_tokens": input_length,
        "memory_allocated_bytes": memory["allocated"],
        "max_memory_allocated_bytes": memory["max_allocated"],
        "total_memory_bytes": total_memory(device),
        "kv_cache": kv_cache_layout(arguments, device).describe(cache_supply.max_cache_len),
        "kv_cache_allocations": cache_supply.allocations,
        "model_size_bytes": model_size,
        "num_parameters": model.num_parameters(),
        "model_load_seconds": load_seconds,
        "gguf_converted": loaded.resolved.converted,
        "warmup_seconds": result.warmup_seconds,
        "compile_seconds": result.warmup_seconds if compiled and execution.warmup > 0 else None,
        "compiled_graphs": compilation.report.graphs if execution.torch_compile else None,
        "graph_breaks": compilation.report.graph_breaks if execution.torch_compile else None,
        **multi_process.rank_stats(run, memory, model_size),
    }
    print(format_texts(prompts, outputs))
    print(format_stats(stats, device), flush=True)
    if run.strategy != "none":
        print(multi_process.format_rank_stats(stats), flush=True)

    if arguments.output.output_dir and run.is_main:
        real_lengths = inputs["attention_mask"].sum(dim=1).tolist()
        full_texts = tokenizer.batch_decode(result.output.cpu(), skip_special_tokens=True)
        results = results_document(
            arguments,
            stats,
            prompts,
            full_texts,
            [
                {"prompt": prompt, "output": output, "prompt_tokens": full, "input_tokens": real}
                for prompt, output, full, real in zip(prompts, outputs, prompt_lengths, real_lengths, strict=True)
            ],
            device=device,
            generation_config=generation_config,
            dtype=str(dtype).removeprefix("torch."),
            model={
                "model_name_or_path": arguments.model.model_name_or_path,
                "source": loaded.resolved.source,
                "description": loaded.resolved.description,
                "path": str(loaded.resolved.path),
                "peft_model": arguments.model.peft_model,
                "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
            },
        )
        print(f"Results written to {kept_results(arguments, results)}")
    multi_process.finish(run)
    return 0


def generate_continuously(arguments, parser, model, tokenizer, requests, prompts, generation_config, device) -> int:
    """--continuous_batching: every prompt a request of one `generate_batch`, timed per request."""
    workload, execution = arguments.workload, arguments.execution
    engine = continuous_batching.engine_config(
        [len(ids) for ids in requests],
        workload.max_new_tokens,
        execution.cb_max_batch_tokens,
        seed=workload.seed,
        max_requests=workload.batch_size,
    )
    reset_peak_memory(device)
    with exit_on_interrupt_or_oom(
        parser.prog,
        on_interrupt=lambda: "no results were written.",
        on_out_of_memory=lambda error: (
            "out of memory in continuous batching: lower --batch_size or "
            "--cb_max_batch_tokens. No results were written."
        ),
    ):
        for _ in range(execution.warmup):
            continuous_batching.run_batch(model, requests, generation_config, engine, device)
        runs = [
            continuous_batching.run_batch(model, requests, generation_config, engine, device)
            for _ in range(execution.n_iterations)
        ]
    memory = memory_stats(device)
    stats = {
        **continuous_batching.summarize_batches(runs),
        "max_memory_allocated_bytes": memory["max_allocated"],
        "paged_cache": {
            "page_size": engine.page_size,
            "num_blocks": engine.num_blocks,
            "max_batch_tokens": engine.max_batch_tokens,
            "max_requests_per_batch": engine.max_requests_per_batch,
        },
    }
    outputs = tokenizer.batch_decode(runs[-1].generated, skip_special_tokens=True)
    print(format_texts(prompts, outputs))
    print(continuous_batching.format_request_table(stats), flush=True)
    if arguments.output.output_dir:
        results = results_document(
            arguments,
            stats,
            prompts,
            [prompt + output for prompt, output in zip(prompts, outputs, strict=True)],
            [{"prompt": prompt, "output": output} for prompt, output in zip(prompts, outputs, strict=True)],
            device=device,
            generation_config=generation_config,
        )
        print(f"Results written to {kept_results(arguments, results)}")
    failed = [request for run in runs for request in run.requests if request.error is not None]
    if failed:  # the others' results are printed and kept above; the run did not do all it was asked
        first = failed[0]
        print(
            f"{parser.prog}: error: {len(failed)} of {sum(len(run.requests) for run in runs)} requests failed "
            f"(request {first.request_id}: {first.error}).",
            file=sys.stderr,
        )
        return 1
    return 0


def show_library_progress() -> None:
    """Show the library's progress messages (e.g. the one-time GGUF conversion) on stderr, once per process."""
    logger = logging.getLogger("optimum.habana")
    if not logger.handlers:
        handler = CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a message comes, not the one it was when `main` first ran: a caller
    that redirects stderr between two runs in one process (a notebook, a test) never gets a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # StreamHandler.__init__ assigns it; the property above always answers


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("run_generation.py: interrupted: no results were written.", file=sys.stderr)
        sys.exit(130)
