"""OPTIMUM_HABANA_CPU_DECODE_KERNEL is read right after each script parses its command line: a value that is neither
on nor off is one line naming the variable and the values it takes, exit 2, before any model loads (it was a
traceback at the first decode step, after the model had loaded)."""

import pytest
from transformers import AutoModelForCausalLM

from optimum.habana.kernels import cpu_decode
from tests.helpers import load_script


SCRIPTS = {
    "examples/text-generation/run_generation.py": ["--use_flash_attention"],
    "examples/text-generation/run_lm_eval.py": ["--tasks", "flash_mc", "-o", "results.json"],
    "examples/language-modeling/run_lora_clm.py": ["--output_dir", "out", "--do_train"],
    "examples/text-generation/benchmark_long_context_decode.py": [],
    "examples/text-generation/benchmark_flash_attention.py": [],
    "examples/text-generation/benchmark_compiled_decode.py": [],
    "examples/text-generation/benchmark_continuous_batching.py": [],
    "examples/language-modeling/benchmark_packed_step.py": [],
    "examples/language-modeling/benchmark_training.py": [],
    "examples/text-generation/attention_fidelity.py": [],
    "optimum.habana.serve": [],
}


# Every script with one bad value; run_generation.py with the others too (the check is the same function).
CASES = [(script, "maybe") for script in SCRIPTS] + [
    ("examples/text-generation/run_generation.py", v) for v in ("2", "")
]


@pytest.mark.parametrize(("script", "value"), CASES)
def test_a_bad_switch_value_is_one_line_before_any_model_loads(script, value, monkeypatch, capsys, tmp_path):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    monkeypatch.setenv(cpu_decode.ENV_VAR, value)
    cpu_decode._switch.cache_clear()
    if script == "optimum.habana.serve":
        from optimum.habana.cli.serving.command import main
    else:
        main = load_script(script).main
    with pytest.raises(SystemExit) as exit_info:
        main(SCRIPTS[script])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{cpu_decode.ENV_VAR}={value!r} is neither on nor off" in lines[0], lines
    assert "set it to 0 (or false, off, no)" in lines[0] and "1 (or true, on, yes; the default)" in lines[0]
