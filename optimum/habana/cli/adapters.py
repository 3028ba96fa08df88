"""PEFT adapter folders: checked before PEFT or the Trainer loads them, and merged into a model for generation.

PEFT answers a junk `adapter_config.json`, a folder without weights or an adapter of another base model with a
traceback from deep inside (a JSON error, "Repo id must be in the form", a size mismatch). These checks name the
folder, the file and what is wrong instead. `check_adapter_folder` reads files only, so it runs before the model
loads; `check_adapter_matches` compares the saved weight shapes with the model.
"""

import json
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, PeftType
from peft.utils import get_peft_model_state_dict
from safetensors import SafetensorError, safe_open


ADAPTER_CONFIG_NAME = "adapter_config.json"


ADAPTER_WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")


# Key prefix of the saved weights: the PEFT wrapper's path to the base model.
_SAVED_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter folder that cannot be used; the message names the folder, the file and the problem."""


def check_adapter_folder(folder: str | Path, flag: str) -> dict[str, Any]:
    """The parsed adapter config, once the folder has a readable config and a readable weights file."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise AdapterError(f"{flag} {str(folder)!r} is not a folder; pass the folder an adapter was saved to.")
    config_path = path / ADAPTER_CONFIG_NAME
    if not config_path.is_file():
        raise AdapterError(f"{flag} {str(folder)!r} has no {ADAPTER_CONFIG_NAME}, so it holds no PEFT adapter.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{config_path} is not valid JSON ({error}); save the adapter again.") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} holds a JSON {type(config).__name__}, not an adapter config object.")
    peft_type = config.get("peft_type")
    if peft_type not in {member.value for member in PeftType}:
        raise AdapterError(
            f"{config_path} has no known peft_type (got {peft_type!r}); it is not a PEFT adapter config."
        )
    if peft_type == PeftType.LORA.value and not (isinstance(config.get("r"), int) and config["r"] >= 1):
        raise AdapterError(f"{config_path}: the LoRA rank r must be a positive integer, got {config.get('r')!r}.")
    adapter_weight_shapes(path, flag)  # readable weights
    return config


def adapter_weight_shapes(folder: Path, flag: str) -> dict[str, tuple[int, ...]]:
    """Name and shape of every saved adapter tensor, read from the file header where it has one."""
    for name in ADAPTER_WEIGHTS_NAMES:
        path = folder / name
        if path.is_file():
            break
    else:
        raise AdapterError(
            f"{flag} {str(folder)!r} has an {ADAPTER_CONFIG_NAME} but no weights ({' or '.join(ADAPTER_WEIGHTS_NAMES)}): "
            "the adapter was not saved completely; save it again."
        )
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as weights:
                return {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}  # noqa: SIM118
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {key: tuple(value.shape) for key, value in state.items()}
    except (SafetensorError, OSError, RuntimeError, AttributeError, EOFError) as error:
        raise AdapterError(
            f"{path} cannot be read ({error}); it is damaged or truncated: save the adapter again."
        ) from None


def check_adapter_matches(folder: str | Path, model: torch.nn.Module, flag: str) -> None:
    """The saved weights fit `model`: a PeftModel with the same LoRA setup, or the base model it will wrap."""
    path = Path(folder).expanduser()
    saved = adapter_weight_shapes(path, flag)
    problems = []
    if isinstance(model, PeftModel):
        expected = {key: tuple(value.shape) for key, value in get_peft_model_state_dict(model).items()}
        problems += [
            f"{key} is {list(saved[key])}, the model's {list(shape)}"
            for key, shape in expected.items()
            if key in saved and saved[key] != shape
        ]
        problems += [f"{key} is missing" for key in expected if key not in saved]
        problems += [f"{key} has no place in the model" for key in saved if key not in expected]
    else:
        problems += _base_model_problems(saved, model)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        config = check_adapter_folder(path, flag)
        raise AdapterError(
            f"{flag} {str(folder)!r} does not fit this model: {problems[0]}{more}. The adapter was trained on "
            f"another base model (its config names {config.get('base_model_name_or_path')!r}) or with another "
            "--lora_rank or --lora_target_modules."
        )


def _base_model_problems(saved: dict[str, tuple[int, ...]], model: torch.nn.Module) -> list[str]:
    """LoRA A/B shapes against the in/out features of the linear layers they adapt."""
    problems = []
    modules = dict(model.named_modules())
    for key, shape in saved.items():
        for part, feature_index, feature in ((".lora_A.", 1, "in_features"), (".lora_B.", 0, "out_features")):
            if part not in key:
                continue
            module_name = key.removeprefix(_SAVED_PREFIX).split(part)[0]
            module = modules.get(module_name)
            if module is None:
                problems.append(f"{key} adapts {module_name}, which this model does not have")
            elif hasattr(module, feature) and getattr(module, feature) != shape[feature_index]:
                problems.append(f"{key} is {list(shape)}, but {module_name} has {feature}={getattr(module, feature)}")
    return problems


def apply_peft_adapter(model: Any, adapter_dir: str) -> Any:
    """Merge a PEFT adapter into the model: the result is the same model class, with no PEFT wrapper at run time.

    An adaption prompt (llama-adapter) cannot be merged into weights: its adapted attention layers stay inside the
    model, which is returned unwrapped all the same. The folder and its fit to the model are checked first
    (AdapterError names the file and the problem): PEFT's own errors for a junk config or mismatched shapes are
    tracebacks from deep inside it.
    """
    from peft import PeftModel, PeftType  # imported here: only this option needs it

    config = check_adapter_folder(adapter_dir, "--peft_model")
    check_adapter_matches(adapter_dir, model, "--peft_model")
    peft_model = PeftModel.from_pretrained(model, str(Path(adapter_dir).expanduser()))
    if config["peft_type"] == PeftType.ADAPTION_PROMPT.value:
        return peft_model.get_base_model()
    return peft_model.merge_and_unload()
