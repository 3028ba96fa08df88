"""run_generation.py on bad input: every bad argument, model, adapter or file is one line and exit status 2, no
traceback, before anything generates."""

import pytest
import torch

from tests.generation.support import bad_model_inputs, finish, start_script


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a one-line message and exit code 2, no traceback


BAD_INPUTS = {
    "missing model path": (["--model_name_or_path", "/no/such/model"], "does not exist"),
    "unknown device": (["--device", "tpu"], "invalid choice: 'tpu'"),
    "hpu not present": (["--device", "hpu"], "no Gaudi device found"),
    "batch size 0": (["--batch_size", "0"], "--batch_size must be at least 1"),
    "max new tokens 0": (["--max_new_tokens", "0"], "--max_new_tokens must be at least 1"),
    "beams 0": (["--num_beams", "0"], "--num_beams must be at least 1"),
    "iterations 0": (["--n_iterations", "0"], "--n_iterations must be at least 1"),
    "bucket internal without bucket size": (["--bucket_internal"], "add --bucket_size N"),
    "static shapes without kv cache": (
        ["--use_kv_cache", "False", "--static_shapes"],
        "--static_shapes shape(s) the KV cache, and --use_kv_cache False turns it off",
    ),
    "buckets without kv cache": (["--use_kv_cache", "False", "--bucket_size", "8"], "--bucket_size shape(s)"),
    "attention batch split 0": (["--attn_batch_split", "0"], "--attn_batch_split must be at least 1"),
    "two prompt sources": (["--prompt", "Hi", "--book_source"], "--prompt and --book_source both give the prompt"),
    "missing prompt file": (["--prompt_file", "/no/such/file.txt"], "--prompt_file '/no/such/file.txt': no such file"),
    "hpu graphs with compile": (["--use_hpu_graphs", "--torch_compile"], "choose one"),
    "compile backend without compile": (
        ["--torch_compile_backend", "eager"],
        "--torch_compile_backend eager picks torch.compile's backend: add --torch_compile.",
    ),
    "unknown compile backend": (
        ["--torch_compile", "--torch_compile_backend", "inductr"],
        "--torch_compile_backend inductr is not a torch.compile backend; choose one of: ",
    ),
    "empty prompt": (["--prompt", "Hello", "  "], "--prompt number 2 is empty"),
    "recompute without flash": (
        ["--flash_attention_recompute"],
        "`flash_attention_recompute` requires `use_flash_attention`",
    ),
    "causal mask without flash": (
        ["--flash_attention_causal_mask"],
        "`flash_attention_causal_mask` requires `use_flash_attention`",
    ),
    "fast softmax without flash": (
        ["--flash_attention_fast_softmax", "True"],
        "`flash_attention_fast_softmax` requires `use_flash_attention`",
    ),
    "temperature without sampling": (["--temperature", "0.7"], "--temperature only applies to sampling"),
    "temperature nan": (["--do_sample", "--temperature", "nan"], "--temperature must be a finite number, got nan"),
    "top_p inf": (["--do_sample", "--top_p", "inf"], "--top_p must be a finite number, got inf"),
    "negative seed": (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    "seed too large": (["--seed", str(2**32)], "--seed must be in [0, 4294967295]"),
    # Checked before tokenizing: padding every prompt to 1e8 tokens would take minutes and gigabytes.
    "max input tokens beyond positions": (["--max_input_tokens", "100000000"], "--max_input_tokens (100000000)"),
    "not a boolean": (["--use_flash_attention", "maybe"], "argument --use_flash_attention"),
    "unknown argument": (["--use_flash_attentoin"], "unrecognized arguments: --use_flash_attentoin"),
}
if not torch.cuda.is_available():
    BAD_INPUTS["cuda not present"] = (["--device", "cuda"], "no CUDA device found")


@pytest.mark.parametrize("argv, message", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_arguments_are_usage_errors(script, tiny_checkpoint, argv, message, capsys):
    full_argv = ["--model_name_or_path", str(tiny_checkpoint), *argv]
    with pytest.raises(SystemExit) as exit_info:
        script.main(full_argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert message in stderr
    assert "Traceback" not in stderr


def test_bad_models_are_usage_errors(script, tiny_checkpoint, tmp_path, capsys):
    for name, (argv, message) in bad_model_inputs(tiny_checkpoint, tmp_path).items():
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        stderr = capsys.readouterr().err
        assert exit_info.value.code == 2, name
        assert message in stderr, (name, stderr)
        assert "Traceback" not in stderr, name


def test_bad_input_from_the_command_line_has_no_traceback(cache_dir):
    """One of the errors above through a real process (each costs seconds of imports; the messages are the in-process
    tests'): exit code 2, the message as the last line, no traceback."""
    returncode, stdout, stderr = finish(start_script(["--model_name_or_path", "/no/such/model"], cache_dir))
    assert returncode == 2
    assert "does not exist" in stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("run_generation.py: error: ")
