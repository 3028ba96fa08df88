"""Helpers of the run_lora_clm.py tests: a word-level tokenizer and a tiny checkpoint, the common command line, and
in-process runs that record losses, gradients and the attention calls."""

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from optimum.habana.cli.finetuning import prompts
from optimum.habana.kernels import variable_length
from optimum.habana.transformers import attention
from tests.helpers import ROOT, count_attention_paths, tiny_llama_config


SCRIPT = ROOT / "examples" / "language-modeling" / "run_lora_clm.py"
DATA_FILE = ROOT / "examples" / "language-modeling" / "data" / "instructions.jsonl"
TOLERANCE = 1e-5


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level, trained on the shipped dataset laid out in the prompt template, so every word has an id."""
    rows = [json.loads(line) for line in DATA_FILE.read_text().splitlines()]
    texts = [prompts.build_prompt(row["instruction"], row["input"]) + row["output"] for row in rows]
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    # Ids 0, 1, 2 match tiny_llama_config's pad, bos and eos.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_word_level_checkpoint(folder: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A stock tiny Llama checkpoint, as a user would pass it, with the word-level tokenizer beside it."""
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def script_args(checkpoint: Path, output_dir: Path, *extra: str) -> list[str]:
    common = "--report_to none --save_strategy no --disable_tqdm True --dataloader_pin_memory False --seed 0"
    return ["--model_name_or_path", str(checkpoint), "--output_dir", str(output_dir), *common.split(), *extra]


@dataclass
class Run:
    """What one in-process run of the script did."""

    metrics: dict
    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    gradients: list[dict[str, torch.Tensor]] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    recompute: list[bool] = field(default_factory=list)  # the kernel's recompute argument, on training calls


class Recorder(TrainerCallback):
    """Per-step training losses, evaluation losses, and the LoRA gradients just before each optimizer step."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.run.gradients.append(
            {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.run.losses.append(logs["loss"])
        if "eval_loss" in logs:
            self.run.eval_losses.append(logs["eval_loss"])


def recording_recompute(run: Run, kernel):
    def spy(*args, **kwargs):
        if torch.is_grad_enabled():
            run.recompute.append(kwargs["recompute"])
        return kernel(*args, **kwargs)

    return spy


def run_script(script, argv: list[str], profile: bool = True) -> Run:
    """main(argv), with every attention call counted by path and the kernel's recompute argument recorded; with
    `profile`, the ATen kernel counted too (a dispatch mode, under which torch.compile compiles nothing)."""
    run = Run(metrics={})
    with pytest.MonkeyPatch.context() as patch, count_attention_paths(patch, profile=profile) as counts:
        for module in (attention, variable_length):  # padded and padding-free (packed) batches
            patch.setattr(module, "fused_sdpa", recording_recompute(run, module.fused_sdpa))
        run.metrics = script.main(argv, callbacks=[Recorder(run)])
    run.counts = counts
    return run
