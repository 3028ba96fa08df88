"""transformers serve's start-up options, checked before the model loads: one sentence per bad option.

transformers takes them as given and fails late: `--port 70000` and `--host 999.1.1.1` after the model loaded,
`--log-level bogus` and invalid `--chat-template-kwargs` as tracebacks, `--device cuda:0` without CUDA and
`--quantization bnb-4bit` without bitsandbytes deep inside `from_pretrained`, `--cb-block-size -16` at every
request (the server starts and answers `/health`), a missing model folder as "Repo id must be in the form ...".
"""

import errno
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from optimum.habana import hpu
from optimum.habana.cli.common import json_object
from optimum.habana.utils.model_loading import ModelResolutionError, resolve_model

from .fields import TEMPLATE_PARAMETERS


class ServeOptionError(ValueError):
    """A start-up option that cannot work; its message names the option and what to give instead."""


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
QUANTIZATIONS = ("bnb-4bit", "bnb-8bit")
DEVICE_FORMS = "auto, cpu, cuda, cuda:N, N (a CUDA index), hpu, hpu:N, xpu, xpu:N or mps"
MIN_PAGE_SIZE = 4  # transformers' paged cache refuses smaller pages


def check_serve_options(options: Mapping[str, Any]) -> None:
    """Every start-up option `GaudiServe` passes on (the attention options have their own check)."""
    check_model(options.get("force_model"))
    check_device(str(options.get("device", "auto")))
    check_dtype(options.get("dtype"))
    check_quantization(options.get("quantization"))
    check_continuous_batching(options)
    check_compile(options)
    level = str(options.get("log_level", "warning"))
    if level.lower() not in LOG_LEVELS:
        raise ServeOptionError(f"--log-level {level!r} is not a level: take one of {', '.join(LOG_LEVELS)}.")
    chat_template_kwargs(options.get("chat_template_kwargs"))
    decision = options.get("decision_config")
    if decision is not None and not Path(decision).is_file():
        raise ServeOptionError(f"--decision-config {decision!r} is not a file: give the path of a JSON file.")
    seed = options.get("default_seed")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise ServeOptionError(f"--default-seed {seed} is not a 64-bit integer.")
    check_address(str(options.get("host", "localhost")), int(options.get("port", 8000)))


def check_model(model: str | None) -> None:
    """A local folder must be a whole checkpoint; a path that does not exist is said to be one (not a bad repo id).

    A hub repo id is left to the loading, which reads the hub cache (or the hub).
    """
    if model is None:
        return
    local = Path(model).expanduser()
    if local.is_file():
        raise ServeOptionError(f"MODEL {model!r} is a file: give a checkpoint folder (save_pretrained's) or a hub id.")
    looks_like_path = model.startswith((".", "~", "/")) or model.count("/") > 1 or "\\" in model
    if local.is_dir() or looks_like_path:
        try:
            resolve_model(model)  # a folder: its config.json and whole weight files; a path: that it exists
        except ModelResolutionError as error:
            raise ServeOptionError(f"MODEL: {str(error).split(' Pass a local')[0]}") from None


def check_device(device: str) -> None:
    match = re.fullmatch(r"(cuda|hpu|xpu)(?::(\d+))?|(\d+)|auto|cpu|mps", device)
    if match is None:
        raise ServeOptionError(f"--device {device!r} is not a device: take {DEVICE_FORMS}.")
    kind, index = (match.group(1), match.group(2)) if match.group(1) else ("cuda", match.group(3))
    if device in ("auto", "cpu"):
        return
    if device == "mps":
        if not torch.backends.mps.is_available():
            raise ServeOptionError("--device mps: this machine has no Apple GPU (torch.backends.mps.is_available()).")
        return
    counts = {
        "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "hpu": hpu.hpu_device_count() if hpu.is_hpu_available() else 0,
        "xpu": torch.xpu.device_count() if hasattr(torch, "xpu") and torch.xpu.is_available() else 0,
    }
    count = counts[kind]
    if count == 0:
        others = [name for name, number in counts.items() if number] + ["cpu"]
        raise ServeOptionError(f"--device {device}: this machine has no {kind} device; take {' or '.join(others)}.")
    if index is not None and int(index) >= count:
        raise ServeOptionError(
            f"--device {device}: this machine has {count} {kind} device(s), numbered 0 to {count - 1}."
        )


def check_dtype(dtype: str | None) -> None:
    if dtype in (None, "auto") or isinstance(getattr(torch, str(dtype), None), torch.dtype):
        return
    raise ServeOptionError(f"--dtype {dtype!r} is not a torch dtype: take auto, bfloat16, float16 or float32.")


def check_quantization(quantization: str | None) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ServeOptionError(f"--quantization {quantization!r} is not a method: take {' or '.join(QUANTIZATIONS)}.")
    from transformers.utils.import_utils import is_bitsandbytes_available

    if not is_bitsandbytes_available():
        raise ServeOptionError(
            f"--quantization {quantization} needs bitsandbytes, which is not installed: pip install bitsandbytes, "
            "or leave --quantization out."
        )


def check_continuous_batching(options: Mapping[str, Any]) -> None:
    given = {name: value for name in CB_LIMITS if (value := options.get(name)) is not None}
    if given and not options.get("continuous_batching"):
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise ServeOptionError(f"{flags} only apply with --continuous-batching: add it or leave them out.")
    for name, value in given.items():
        low, high, words = CB_LIMITS[name]
        if isinstance(value, bool) or not low <= value <= high:
            raise ServeOptionError(f"--{name.replace('_', '-')} {value} is out of range: {words}.")


# Where transformers' generate() compiles the decode step of a static cache (`_valid_auto_compile_criteria`).
COMPILING_DEVICES = ("cuda", "xpu", "neuron", "tpu")


def check_compile(options: Mapping[str, Any]) -> None:
    """`--compile` (transformers' option) gives every sequential request a static KV cache, whose decode step
    generate() compiles on some devices only; continuous batching does not compile with it."""
    if not options.get("compile"):
        return
    if options.get("continuous_batching"):
        raise ServeOptionError(
            "--compile gives the sequential path a static KV cache that generate() compiles; transformers' "
            "continuous-batching engine does not compile with it: leave one of them out."
        )
    device = str(options.get("device", "auto"))
    if device != "auto":  # else known once the model is on its device
        check_compile_device("cuda" if device.isdigit() else device.split(":")[0])


def check_compile_device(device: str) -> None:
    if device not in COMPILING_DEVICES:
        raise ServeOptionError(
            f"--compile: on {device} transformers' generate() compiles nothing (it compiles the decode step on "
            f"{', '.join(COMPILING_DEVICES)}): leave --compile out."
        )


CB_LIMITS = {
    "cb_block_size": (MIN_PAGE_SIZE, 2**20, f"tokens per cache block, at least {MIN_PAGE_SIZE}"),
    "cb_num_blocks": (1, 2**40, "a positive number of cache blocks"),
    "cb_max_batch_tokens": (1, 2**40, "a positive number of tokens"),
    "cb_max_memory_percent": (1e-6, 1.0, "a fraction of the free memory, above 0 up to 1"),
}


def chat_template_kwargs(text: str | None) -> dict[str, Any]:
    """`--chat-template-kwargs` as a dict: a JSON object, else a ServeOptionError naming it."""
    if not text:
        return {}
    try:
        variables = json_object(text, "--chat-template-kwargs")
    except ValueError as error:
        raise ServeOptionError(str(error)) from None
    taken = sorted(TEMPLATE_PARAMETERS & set(variables))
    if taken:
        raise ServeOptionError(
            f"--chat-template-kwargs holds {', '.join(taken)}, which the server sets itself: give only the chat "
            'template\'s variables (e.g. {"enable_thinking": true}).'
        )
    return variables


def check_api_key(key: str | None) -> None:
    """`--api-key`: what a client can send in an HTTP header (printable ASCII, no spaces), and not empty."""
    if key is None:
        return
    if not key or not all(33 <= ord(character) <= 126 for character in key):
        raise ServeOptionError(
            "--api-key must be printable ASCII without spaces (it travels as `Authorization: Bearer <key>`), "
            f"got {'an empty one' if not key else 'other characters'}."
        )


def check_address(host: str, port: int) -> None:
    """The address uvicorn will listen on: a valid port, a host of this machine, and free (checked by binding)."""
    if not 0 <= port <= 65535:
        raise ServeOptionError(f"--port {port} is not a TCP port: take one from 1 to 65535 (0: any free one).")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        raise ServeOptionError(f"--host {host!r} is not an address or a known host name ({error}).") from None
    bound = 0
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio binds for uvicorn
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
                bound += 1
            except OSError as error:
                if error.errno == errno.EADDRNOTAVAIL:  # asyncio skips an address family the machine lacks
                    continue
                if error.errno == errno.EADDRINUSE:
                    raise ServeOptionError(
                        f"--port {port} is in use on {host}: stop what listens there or take another port."
                    ) from None
                if error.errno == errno.EACCES:
                    raise ServeOptionError(
                        f"--port {port} needs privileges on this machine: take one above 1023."
                    ) from None
                raise ServeOptionError(
                    f"--host {host} --port {port} cannot be listened on: {error.strerror}."
                ) from None
    if not bound:
        raise ServeOptionError(f"--host {host} is not an address of this machine.")
