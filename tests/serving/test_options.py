"""Start-up options of `python -m optimum.habana.serve`: each bad one is one line on stderr and exit status 2,
before the model loads (the loader is replaced by one that fails the test)."""

import json
import socket

import pytest
import torch
from transformers.utils.import_utils import is_bitsandbytes_available

from optimum.habana.cli.serving import server
from optimum.habana.cli.serving.command import main as serve_main
from tests.helpers import free_port, save_tiny_checkpoint


def run(argv: list[str], capsys, status: int = 2) -> list[str]:
    """The command's exit status must be `status`; its stderr lines are returned."""
    with pytest.raises(SystemExit) as exit_info:
        serve_main(argv)
    assert exit_info.value.code == status
    return capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(server, "GaudiModelManager", refuse)


@pytest.fixture(scope="module")
def damaged_checkpoint(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("damaged"))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


CASES = {
    "port-out-of-range": (["--port", "70000"], ["--port 70000", "65535"]),
    "port-not-a-number": (["--port", "abc"], ["--port", "integer"]),
    "unknown-option": (["--no-such-option"], ["--no-such-option"]),
    "log-level": (["--log-level", "bogus"], ["--log-level 'bogus'", "debug, info, warning"]),
    "device-not-a-device": (["--device", "gpu0"], ["--device 'gpu0'", "cuda:N"]),
    "block-size": (["--continuous-batching", "--cb-block-size", "-16"], ["--cb-block-size -16", "at least 4"]),
    "num-blocks": (["--continuous-batching", "--cb-num-blocks", "0"], ["--cb-num-blocks 0", "positive"]),
    "cb-option-without-cb": (["--cb-num-blocks", "64"], ["--cb-num-blocks", "--continuous-batching"]),
    "missing-folder": (["/no/such/model/folder"], ["'/no/such/model/folder' does not exist"]),
    "host": (["--host", "999.1.1.1"], ["--host '999.1.1.1'", "not an address"]),
    "chat-template-kwargs-not-json": (["--chat-template-kwargs", "{bad"], ["--chat-template-kwargs", "not JSON"]),
    "chat-template-kwargs-not-object": (["--chat-template-kwargs", "[1]"], ["--chat-template-kwargs", "object"]),
    "chat-template-kwargs-handler-key": (
        ["--chat-template-kwargs", '{"tokenize": false, "enable_thinking": true}'],
        ["--chat-template-kwargs holds tokenize", "sets itself"],
    ),
    "api-key-empty": (["--api-key", ""], ["--api-key", "an empty one"]),
    "api-key-with-a-space": (["--api-key", "two words"], ["--api-key", "printable ASCII without spaces"]),
    "dtype": (["--dtype", "float99"], ["--dtype 'float99'", "bfloat16"]),
    "quantization-method": (["--quantization", "gptq"], ["--quantization 'gptq'", "bnb-4bit"]),
    "attention": (["--attn-implementation", "flash_attention_2"], ["--attn-implementation 'flash_attention_2'"]),
    "max-body-bytes": (["--max-body-bytes", "0"], ["--max-body-bytes 0", "positive number of bytes"]),
    "compile-with-continuous-batching": (["--compile", "--continuous-batching"], ["--compile", "does not compile"]),
    "compile-on-cpu": (["--compile", "--device", "cpu"], ["--compile: on cpu", "compiles nothing"]),
}


@pytest.mark.parametrize("argv, words", CASES.values(), ids=CASES.keys())
def test_a_bad_option_is_one_line_and_exit_2_before_the_model_loads(argv, words, capsys, no_loading):
    lines = run(argv, capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("optimum.habana.serve: ")
    for word in words:
        assert word in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_refused(capsys, no_loading):
    (line,) = run(["--device", "cuda:0"], capsys)
    assert "--device cuda:0" in line and "no cuda device" in line and "cpu" in line


@pytest.mark.skipif(is_bitsandbytes_available(), reason="bitsandbytes is installed")
def test_bnb_quantization_without_bitsandbytes_is_refused(capsys, no_loading):
    (line,) = run(["--quantization", "bnb-4bit"], capsys)
    assert "--quantization bnb-4bit" in line and "pip install bitsandbytes" in line


def test_a_port_in_use_is_refused(capsys, no_loading):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        (line,) = run(["--host", "127.0.0.1", "--port", str(taken.getsockname()[1])], capsys)
    assert "is in use on 127.0.0.1" in line


def test_a_damaged_checkpoint_is_refused_before_loading(damaged_checkpoint, capsys, no_loading):
    (line,) = run([str(damaged_checkpoint), "--port", str(free_port())], capsys)
    assert "model.safetensors is truncated" in line and "damaged" in line


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path, capsys, no_loading):
    (line,) = run([str(tmp_path), "--port", str(free_port())], capsys)
    assert "has no config.json" in line


def test_a_model_that_fails_to_load_is_one_line(tmp_path, capsys):
    """What the checks cannot see (weights of other shapes than the config says) fails as the model loads: exit
    status 2 and one line of ours (transformers prints its loading report before it)."""
    folder = save_tiny_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 32}))
    lines = run([str(folder), "--port", str(free_port())], capsys)
    assert lines[-1].startswith(f"optimum.habana.serve: {folder} could not be loaded: RuntimeError: ")
    assert "Traceback" not in "\n".join(lines)


def test_continuous_batching_of_a_family_the_engine_refuses_is_one_line_before_it_says_served(tmp_path, capsys):
    from tests.generation.support import latent_checkpoint

    lines = run([str(latent_checkpoint(tmp_path)), "--continuous-batching", "--port", str(free_port())], capsys)
    assert "cannot run in transformers' continuous batching: its latent attention" in lines[-1]
    assert lines[-1].endswith("Serve it without --continuous-batching.")
    assert not any(line.startswith("Serving ") for line in lines) and "Traceback" not in "\n".join(lines)


def test_an_empty_api_key_variable_is_refused(monkeypatch, capsys, no_loading):
    """click reads an empty variable as unset: the server would have started open without a word."""
    monkeypatch.setenv("OPTIMUM_HABANA_API_KEY", "")
    (line,) = run(["--port", str(free_port())], capsys)
    assert line.startswith("optimum.habana.serve: OPTIMUM_HABANA_API_KEY is set but empty")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_options"))


def test_a_cache_that_cannot_be_built_ends_start_up_in_one_line_before_the_port_opens(checkpoint, capsys):
    port = free_port()
    argv = [str(checkpoint), "--port", str(port), "--continuous-batching", "--cb-num-blocks", "100000000000"]
    lines = run(argv, capsys)
    assert lines[-1].startswith(
        "optimum.habana.serve: The continuous-batching engine could not start: its paged KV cache could not be "
        "built (MemoryError: "
    )
    assert "Lower --cb-num-blocks or --cb-block-size" in lines[-1] and "Traceback" not in "\n".join(lines)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


def test_ctrl_c_while_the_model_loads_is_one_line(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "GaudiModelManager", interrupted)
    (line,) = run(["--port", str(free_port())], capsys, status=130)
    assert line == "optimum.habana.serve: interrupted before serving (Ctrl-C); nothing was started."
