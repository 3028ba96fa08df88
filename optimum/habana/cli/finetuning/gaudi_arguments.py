"""Optimum-Habana's fine-tuning arguments (its `GaudiTrainingArguments` and `run_lora_clm.py` options), for
`run_lora_clm.py`, so that command lines written for it parse here.

Each argument either acts (the attention choice, throughput warm-up steps, TorchDynamo limits, the warm-up ratio,
training on the prompt) or, where it names something that exists on Gaudi only, prints one line saying what it does
on this device. None is accepted and ignored without a word.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback

from optimum.habana import hpu
from optimum.habana.transformers.context_parallel.trainer import check_world_size
from optimum.habana.transformers.modeling_utils import ATTENTION_IMPLEMENTATIONS


# `--attn_implementation` values of Optimum-Habana's fine-tuning script, and the use_flash_attention each selects
# (the library's rule, `GaudiAttentionMixin`).
FINE_TUNING_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "gaudi_fused_sdpa")


@dataclass
class GaudiTrainingArguments:
    """The Optimum-Habana options of its fine-tuning command lines."""

    _argument_group_name = "Optimum-Habana options"

    attn_implementation: str | None = field(
        default=None,
        metadata={
            "choices": list(FINE_TUNING_ATTENTION_IMPLEMENTATIONS),
            "help": "Optimum-Habana's attention switch: 'eager' the default path, 'sdpa' and 'gaudi_fused_sdpa' the "
            "fused kernel (the same as --use_flash_attention). Contradicting --use_flash_attention is an error.",
        },
    )
    train_on_inputs: bool = field(
        default=False,
        metadata={
            "help": "Include the prompt tokens of instruction data in the loss (Optimum-Habana's default is True; "
            "here the loss is on the response unless this is given)."
        },
    )
    warmup_ratio: float | None = field(
        default=None,
        metadata={"help": "Share of the steps that warm up the learning rate (transformers 5: --warmup_steps < 1)."},
    )
    throughput_warmup_steps: int = field(
        default=0,
        metadata={"help": "Steps left out of train_samples_per_second (compilation and first-step costs)."},
    )
    adjust_throughput: bool = field(
        default=False,
        metadata={"help": "Leave the time spent logging, evaluating and saving out of train_samples_per_second."},
    )
    sdp_on_bf16: bool = field(
        default=False,
        metadata={"help": "Let PyTorch's math SDPA reduce in fp16/bf16 (faster, less exact), as upstream does."},
    )
    cache_size_limit: int | None = field(
        default=None, metadata={"help": "TorchDynamo's recompilation limit per frame (torch._dynamo.config)."}
    )
    allow_unspec_int_on_nn_module: bool = field(
        default=False,
        metadata={"help": "TorchDynamo: treat integer attributes of modules as dynamic (torch._dynamo.config)."},
    )
    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Processes each training sequence is split over (DeepSpeed Ulysses' scheme: positions outside "
            "attention, heads inside it); launch replicas x N processes."
        },
    )
    # Gaudi-only switches: each prints what it does on this device.
    use_habana: bool = field(default=False, metadata={"help": "Gaudi: train on the HPU (used whenever present)."})
    use_lazy_mode: bool | None = field(
        default=None, metadata={"nargs": "?", "const": True, "help": "Gaudi: lazy execution mode."}
    )
    use_hpu_graphs_for_training: bool = field(default=False, metadata={"help": "Gaudi: HPU graphs in training."})
    use_hpu_graphs_for_inference: bool = field(default=False, metadata={"help": "Gaudi: HPU graphs in evaluation."})
    gaudi_config_name: str | None = field(default=None, metadata={"help": "Gaudi: fused optimizer/clip-norm config."})
    pipelining_fwd_bwd: bool = field(default=False, metadata={"help": "Gaudi: overlap forward and backward."})
    use_fused_rope: bool | None = field(
        default=None, metadata={"nargs": "?", "const": True, "help": "Gaudi: fused rotary embedding kernel."}
    )
    fp8: bool = field(default=False, metadata={"help": "Gaudi: fp8 training through Transformer Engine."})
    use_regional_compilation: bool = field(default=False, metadata={"help": "Compile each decoder layer apart."})
    compile_from_sec_iteration: bool = field(default=False, metadata={"help": "Start compiling at the 2nd step."})


def attention_flag_from(arguments: GaudiTrainingArguments, use_flash_attention: bool, given: bool) -> bool:
    """`use_flash_attention` after `--attn_implementation`; a contradiction with a given flag is a ValueError."""
    if arguments.attn_implementation is None:
        return use_flash_attention
    selected = bool(ATTENTION_IMPLEMENTATIONS[arguments.attn_implementation])
    if given and use_flash_attention != selected:
        raise ValueError(
            f"--attn_implementation {arguments.attn_implementation} and --use_flash_attention {use_flash_attention} "
            "contradict each other: the first selects "
            + ("the fused kernel" if selected else "the default attention")
            + ". Pass one of them."
        )
    return selected


def check_gaudi_training_arguments(arguments: GaudiTrainingArguments) -> None:
    """Values that cannot work here; each a ValueError naming the flag."""
    if arguments.context_parallel_size < 1:
        raise ValueError(f"--context_parallel_size must be at least 1, got {arguments.context_parallel_size}.")
    if arguments.throughput_warmup_steps < 0:
        raise ValueError(f"--throughput_warmup_steps must be 0 or more, got {arguments.throughput_warmup_steps}.")
    if arguments.warmup_ratio is not None and not 0 <= arguments.warmup_ratio < 1:
        raise ValueError(f"--warmup_ratio must be in [0, 1), got {arguments.warmup_ratio}.")
    if arguments.cache_size_limit is not None and arguments.cache_size_limit < 1:
        raise ValueError(f"--cache_size_limit must be at least 1, got {arguments.cache_size_limit}.")


def apply_gaudi_training_arguments(
    arguments: GaudiTrainingArguments, training_args: Any, device: torch.device, dtype: torch.dtype
) -> list[str]:
    """Do what can be done here; returns one line for each given option that does something else here."""
    if arguments.warmup_ratio is not None:
        if training_args.warmup_steps:
            raise ValueError("--warmup_ratio and --warmup_steps both set the warm-up: pass one.")
        training_args.warmup_steps = arguments.warmup_ratio  # transformers 5 reads a value below 1 as the ratio
    if arguments.sdp_on_bf16:  # PyTorch's switch, named cuda but read by its math SDPA backend on every device
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    if arguments.cache_size_limit is not None:
        torch._dynamo.config.cache_size_limit = arguments.cache_size_limit
    if arguments.allow_unspec_int_on_nn_module:
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
    on_hpu = device.type == "hpu"
    notes = []
    check_world_size(arguments.context_parallel_size, training_args.world_size, "--context_parallel_size")
    if training_args.torch_compile_backend == hpu.COMPILE_BACKEND and not on_hpu:
        training_args.torch_compile_backend = "inductor"
        notes.append(
            f"--torch_compile_backend {hpu.COMPILE_BACKEND}: Gaudi's compiler; no Gaudi here, so torch.compile uses inductor "
            f"on {device.type}."
        )
    if arguments.use_habana and not on_hpu:
        notes.append(f"--use_habana: no Gaudi device here; training runs on {device.type}.")
    if arguments.use_lazy_mode is not None:
        notes.append(
            "--use_lazy_mode: Gaudi's execution mode is chosen by the PT_HPU_LAZY_MODE environment variable when "
            "the Gaudi software loads; this option changes nothing"
            + ("." if on_hpu else f" (no Gaudi device here; training runs on {device.type}).")
        )
    for name in ("use_hpu_graphs_for_training", "use_hpu_graphs_for_inference"):
        if getattr(arguments, name):
            notes.append(f"--{name}: this script does not capture HPU graphs; the model runs eagerly.")
    if arguments.gaudi_config_name:
        notes.append(
            f"--gaudi_config_name {arguments.gaudi_config_name}: Gaudi configs choose Habana's fused optimizer and "
            "gradient clipping kernels; the Trainer's own optimizer and clipping run here, with the same results."
        )
    if arguments.pipelining_fwd_bwd:
        notes.append("--pipelining_fwd_bwd: a Gaudi lazy-mode scheduling option; no effect here.")
    if arguments.use_fused_rope is not None:
        notes.append("--use_fused_rope: transformers' rotary embedding runs here (the same math as the fused one).")
    if arguments.fp8:
        notes.append(f"--fp8: fp8 training is not supported by this script; training runs in {dtype}.")
    if arguments.use_regional_compilation or arguments.compile_from_sec_iteration:
        given = [
            f"--{name}"
            for name in ("use_regional_compilation", "compile_from_sec_iteration")
            if getattr(arguments, name)
        ]
        what = (
            "--torch_compile compiles the whole model from the first step"
            if training_args.torch_compile
            else ("nothing is compiled without --torch_compile")
        )
        notes.append(f"{' and '.join(given)}: {what}.")
    return notes


class ThroughputAfterWarmup(TrainerCallback):
    """`train_samples_per_second` as Optimum-Habana reports it: over the steps after the first `warmup_steps`, up
    to the end of the last step, and with `adjust` without the time spent logging, evaluating and saving.

    The Trainer logs, evaluates and saves right after `on_step_end`, and calls `on_log`/`on_evaluate`/`on_save`
    when each is done, so the time from a step's end to the last of those is what `adjust` leaves out.
    """

    def __init__(self, warmup_steps: int, adjust: bool = False) -> None:
        self.warmup_steps = warmup_steps
        self.adjust = adjust
        self.start: float | None = None
        self.start_step = 0
        self.last_step_end: float | None = None
        self.last_step = 0
        self.left_out = 0.0  # seconds of logging, evaluation and saving after the start

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step >= self.warmup_steps:  # no warm-up, or resumed past it
            self.start, self.start_step = time.perf_counter(), state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self.start is None and state.global_step == self.warmup_steps:
            self.start, self.start_step = now, state.global_step
        self.last_step_end, self.last_step = now, state.global_step

    def on_log(self, args, state, control, **kwargs):
        self._leave_out_since_step_end()

    def on_evaluate(self, args, state, control, **kwargs):
        self._leave_out_since_step_end()

    def on_save(self, args, state, control, **kwargs):
        self._leave_out_since_step_end()

    def _leave_out_since_step_end(self) -> None:
        if not self.adjust or self.start is None or self.last_step_end is None:
            return
        now = time.perf_counter()
        self.left_out += now - self.last_step_end
        self.last_step_end = now  # the next event of the same step counts from here

    def samples_per_second(self, samples_per_step: int) -> float | None:
        """None when training ended before the warm-up did."""
        if self.start is None or self.last_step_end is None or self.last_step <= self.start_step:
            return None
        seconds = self.last_step_end - self.start - self.left_out
        return (self.last_step - self.start_step) * samples_per_step / seconds
