#!/usr/bin/env python
"""Evaluate a causal LM with lm-evaluation-harness, with the fused attention kernel (--use_flash_attention) or not.

    python examples/text-generation/run_lm_eval.py -o flash.json --tasks essay_perplexity flash_mc --use_flash_attention
    python examples/text-generation/run_lm_eval.py -o default.json --tasks essay_perplexity flash_mc

Both shipped tasks run offline on the embedded SmolLM2-135M-Instruct; in fp32 the two runs give the same scores.
Optimum-Habana's command line (-o, --tasks, -L, -f, --buckets, ...) and every run_generation.py model, attention
and device flag are accepted; the output file holds lm-eval's results plus `args` and `duration`, as upstream.
`--help` lists every argument; docs/lm_eval.md explains them. The reusable pieces live in
`optimum.habana.cli.evaluation.lm_eval` (arguments, model, harness).
"""

import sys
import time
import warnings
from collections.abc import Sequence

import torch

from optimum.habana import hpu
from optimum.habana.cli.adapters import apply_peft_adapter, check_adapter_folder
from optimum.habana.cli.common import exit_on_interrupt_or_oom, missing_extra
from optimum.habana.cli.generation import multi_process
from optimum.habana.cli.generation.arguments import resolve_execution, usage_error
from optimum.habana.cli.generation.capture import compile_backend
from optimum.habana.cli.generation.explain import explain
from optimum.habana.cli.generation.generation_config import kv_cache_layout
from optimum.habana.cli.generation.report import format_bytes
from optimum.habana.utils.devices import memory_stats, reset_peak_memory
from optimum.habana.utils.distributed import launch_environment
from optimum.habana.utils.model_loading import ModelResolutionError


try:  # lm-evaluation-harness: the `eval` extra
    from lm_eval import evaluator

    from optimum.habana.cli.evaluation.lm_eval.arguments import (
        build_parser,
        check_output_file,
        evaluation_buckets,
        evaluation_notes,
        merged_gen_kwargs,
        parse_arguments,
        parse_metadata,
    )
    from optimum.habana.cli.evaluation.lm_eval.harness import (
        TaskDataError,
        check_task_data,
        configure_lm_eval_logging,
        select_tasks,
        summary_tables,
        write_results,
    )
    from optimum.habana.cli.evaluation.lm_eval.model import LM_EVAL_MAX_GEN_TOKS, EvalOptions, GaudiEvalLM
    from optimum.habana.cli.evaluation.lm_eval.prompt_checks import (
        chat_template_flag,
        check_chat_template,
        check_num_fewshot,
        check_num_fewshot_fits,
        fewshot_pools,
    )
except ImportError as error:
    sys.exit(missing_extra("run_lm_eval.py", error, "lm_eval", "lm-evaluation-harness", "eval"))


def main(argv: Sequence[str] | None = None) -> int:
    launch = launch_environment()  # torchrun's RANK, WORLD_SIZE...: one process without a launcher
    multi_process.silence_other_ranks(launch)
    parser = build_parser()
    arguments, given = parse_arguments(parser, argv)
    script, evaluation = arguments.script, arguments.evaluation
    execution = script.execution
    configure_lm_eval_logging()
    if script.output.explain:
        try:
            print(explain(script))
        except (ModelResolutionError, ValueError) as error:
            usage_error(parser, str(error))
        print(
            "Note: --explain: the account above is of run_generation.py's prompts; the tasks' requests take the same "
            "paths, padded on the right (log-likelihoods) or on the left (generate_until)."
        )
        return 0

    # Everything that can still be a bad input (device, tasks and their data, model, adapter) is checked first.
    try:
        multi_process.validate_parallel_arguments(script.parallel, launch)
        output_path = check_output_file(evaluation.output_file, evaluation.overwrite)
        if script.model.peft_model:  # the adapter's files, before the model loads; its fit to the model after
            check_adapter_folder(script.model.peft_model, "--peft_model")
        device, dtype = resolve_execution(script)
        selection = select_tasks(evaluation.tasks, evaluation.include_path)
        pools = fewshot_pools(check_task_data(selection))
        for note in [
            *evaluation_notes(arguments, given, device, dtype),
            *check_num_fewshot(evaluation.num_fewshot, pools),
        ]:
            print(f"Note: {note}", file=sys.stderr)
        run = multi_process.start(script.parallel, device, launch)
        device = run.device
        loaded = multi_process.load_model(script.model.model_name_or_path, dtype=dtype, run=run)
        model = loaded.model
        if chat_flag := chat_template_flag(evaluation.apply_chat_template, script.workload.chat):
            check_chat_template(loaded.tokenizer, evaluation.apply_chat_template or True, chat_flag)
        if script.model.peft_model:
            model = apply_peft_adapter(model, script.model.peft_model)
    except (ModelResolutionError, ValueError) as error:
        usage_error(parser, str(error))
    except TaskDataError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")

    if execution.use_hpu_graphs and device.type == "hpu":
        model = hpu.wrap_in_hpu_graph(
            model, prompt_in_graph=not execution.limit_hpu_graphs, max_graphs=evaluation.max_graphs
        )
    if execution.sdp_on_bf16:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    if script.attention.attn_softmax_bf16 and script.attention.use_flash_attention:
        warnings.filterwarnings("ignore", message="attn_softmax_bf16 with use_flash_attention")  # noted above
    options = EvalOptions(
        attention=script.attention.attention_flags().as_dict(),
        buckets=evaluation_buckets(arguments, device),
        cache_layout=kv_cache_layout(script, device),
        compile_backend=compile_backend(execution, device) if execution.torch_compile else None,
        max_gen_toks=script.workload.max_new_tokens if "max_new_tokens" in given else LM_EVAL_MAX_GEN_TOKS,
    )
    lm = GaudiEvalLM(
        model,
        loaded.tokenizer,
        options,
        batch_size=script.workload.batch_size,
        max_length=script.workload.max_input_tokens if script.workload.max_input_tokens > 0 else None,
        model_info={"model_source": loaded.resolved.description, "peft_model": script.model.peft_model},
    )
    if lm.buckets is not None and lm.buckets.dropped:
        longer = " ".join(map(str, lm.buckets.dropped))
        print(
            f"{parser.prog}: note: buckets {longer} exceed the max length {lm.max_length}: batches pad to it at most."
        )
    try:
        check_num_fewshot_fits(evaluation.num_fewshot, pools, lm.max_length)
    except ValueError as error:
        usage_error(parser, str(error))
    print(
        header(loaded.resolved.description, device, dtype, script.attention.use_flash_attention, lm, selection.names)
    )

    reset_peak_memory(device)
    out_of_memory = (
        f"out of {device.type} memory evaluating batches of {script.workload.batch_size} (up to {lm.max_length} "
        "tokens). Lower --batch_size or --max_input_tokens, or add --use_flash_attention (O(N) attention memory). "
        "No results were written."
    )
    with exit_on_interrupt_or_oom(
        parser.prog, on_interrupt=lambda: "no results were written.", on_out_of_memory=lambda error: out_of_memory
    ):
        if execution.warmup > 0 and lm.warm_up():
            print(f"Warm-up: one forward per bucket ({len(lm.buckets.sizes)} buckets).", flush=True)
        start = time.perf_counter()
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=selection.names,
            task_manager=selection.manager,
            num_fewshot=evaluation.num_fewshot,
            limit=evaluation.limit,
            log_samples=evaluation.log_samples,
            gen_kwargs=merged_gen_kwargs(arguments, given),
            apply_chat_template=evaluation.apply_chat_template or script.workload.chat,
            system_instruction=evaluation.system_instruction,
            fewshot_as_multiturn=evaluation.fewshot_as_multiturn,
            confirm_run_unsafe_code=evaluation.confirm_run_unsafe_code,
            metadata=parse_metadata(evaluation.metadata) or None,
            torch_random_seed=script.workload.seed if "seed" in given else 1234,  # lm-eval's default
        )
        duration = time.perf_counter() - start

    if results is not None and run.is_main:  # lm-eval returns the results on its main process only
        results["args"] = arguments.as_dict()
        results["duration"] = duration
        print(summary_tables(results))
        memory = memory_stats(device)
        resident = " (peak resident memory of the process)" if device.type == "cpu" else ""
        print(f"Duration: {duration:.1f} s; peak memory: {format_bytes(memory['max_allocated'])}{resident}")
        path = write_results(output_path, results, evaluation.overwrite)
        if path != output_path:
            kept = f"{output_path} appeared during the run (another evaluation?) and is kept"
            print(f"{parser.prog}: note: {kept}.", file=sys.stderr)
        print(f"Results written to {path}")
        if evaluation.show_config:
            print(path.read_text(encoding="utf-8"))
    multi_process.finish(run)
    return 0


def header(
    description: str, device: torch.device, dtype: torch.dtype, flash: bool, lm: GaudiEvalLM, tasks: Sequence[str]
) -> str:
    """What is evaluated, where, and how the requests are batched."""
    attention = "fused kernel (--use_flash_attention)" if flash else "default (matmul-softmax)"
    buckets = " ".join(map(str, lm.buckets.sizes)) if lm.buckets else "off"
    return "\n".join(
        [
            f"Model: {description}",
            f"Device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}, attention: {attention}",
            f"Tasks: {', '.join(tasks)}; batch size {lm.batch_size}, max length {lm.max_length}, buckets: {buckets}",
        ]
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("run_lm_eval.py: interrupted: no results were written.", file=sys.stderr)
        sys.exit(130)
