"""`--peft_type` (Optimum-Habana's adapter methods through PEFT) on every family: the adapter trains, the flag
reaches every attention call under it, and the flag changes nothing in the loss or the gradients (fp32)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from peft.tuners.adaption_prompt.layer import AdaptedAttention
from transformers import Trainer, TrainingArguments

from optimum.habana.cli.adapters import apply_peft_adapter
from optimum.habana.cli.finetuning import peft_methods
from optimum.habana.cli.finetuning.arguments import LoraArguments
from optimum.habana.cli.finetuning.errors import FineTuningError
from optimum.habana.cli.finetuning.peft_methods import PeftArguments
from tests.helpers import FAMILIES, SOFT_CAPPED, build_pair, count_attention_paths


# Adapter weights that start at zero (the adapter adds nothing yet), made non-zero so the forward depends on them.
ZERO_INITIALIZED = ("lora_E", "vera_lambda_b")


def adapted(model_type: str, peft_type: str, **peft_options):
    model, _ = build_pair(model_type)
    arguments = PeftArguments(peft_type=peft_type, **peft_options)
    config = peft_methods.peft_config(arguments, LoraArguments(lora_dropout=0.0), model)  # no dropout: comparable
    model = peft_methods.add_adapter(model, config, peft_type).train()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(part in name for part in ZERO_INITIALIZED):
                parameter.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    return model


def loss_and_gradients(model, use_flash_attention: bool, monkeypatch):
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    with count_attention_paths(monkeypatch, profile=False) as counts:
        loss = model(input_ids=ids, labels=ids, use_flash_attention=use_flash_attention).loss
        loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), gradients, dict(counts)  # a copy: a later count wraps this one


def check_flag_is_exact_and_fused(model, model_type: str, monkeypatch) -> None:
    loss, gradients, counts = loss_and_gradients(model, False, monkeypatch)
    flash_loss, flash_gradients, flash_counts = loss_and_gradients(model, True, monkeypatch)
    assert gradients, "the adapter got no gradient"
    assert set(flash_gradients) == set(gradients)
    torch.testing.assert_close(flash_loss, loss, rtol=1e-5, atol=1e-5)
    for name, gradient in gradients.items():
        torch.testing.assert_close(flash_gradients[name], gradient, rtol=1e-4, atol=1e-5, msg=name)
    layers = model.get_base_model().config.num_hidden_layers
    assert counts.get("fused", 0) == 0 and counts["default"] == layers
    if model_type in SOFT_CAPPED:  # soft-capped logits: the default path, as documented
        assert flash_counts["default"] == layers
    else:
        assert flash_counts["fused"] == layers and flash_counts.get("default", 0) == 0


# Every method wraps every family (default targets found, the flags kept: `add_adapter` checks them); the forward
# and backward with and without the flag run on four geometries per method: standard (Llama), fused qkv and
# MLP (Phi3), mixture of experts (Qwen2-MoE), soft-capped with extra norms (Gemma 2). LoRA runs on every family in
# tests/test_packing.py.
METHODS = ("ia3", "adalora", "vera", "ln_tuning")
GEOMETRIES = ("llama", "phi3", "qwen2_moe", "gemma2")


@pytest.mark.parametrize("peft_type", METHODS)
def test_every_method_wraps_every_family(peft_type):
    for model_type in FAMILIES:
        model = adapted(model_type, peft_type)
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        assert trainable, f"{model_type}: nothing to train"


@pytest.mark.parametrize("peft_type", METHODS)
@pytest.mark.parametrize("model_type", GEOMETRIES)
def test_every_method_trains_with_the_flag_exact(model_type, peft_type, monkeypatch):
    model = adapted(model_type, peft_type)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.requires_grad is False for n, p in model.named_parameters() if n not in trainable)
    check_flag_is_exact_and_fused(model, model_type, monkeypatch)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_llama_adapter_keeps_the_flag_on_the_adapted_attention(model_type, monkeypatch):
    model = adapted(model_type, "llama-adapter", adapter_layers=2, adapter_len=3)
    adapted_layers = [module for module in model.modules() if isinstance(module, AdaptedAttention)]
    assert len(adapted_layers) == 2
    # Its gate starts at zero (the adapter adds nothing yet); open it so the gradients reach the prompt tokens.
    with torch.no_grad():
        for layer in adapted_layers:
            layer.adaption_gate.fill_(0.5)
    check_flag_is_exact_and_fused(model, model_type, monkeypatch)


def test_default_targets_are_read_from_the_model():
    phi3, _ = build_pair("phi3")  # PEFT has no defaults for Phi3: fused qkv_proj
    targets, feedforward = peft_methods.default_targets("ia3", phi3)
    assert targets == ["qkv_proj", "down_proj"] and feedforward == ["down_proj"]
    starcoder2, _ = build_pair("starcoder2")  # its MLP ends in c_proj
    assert peft_methods.default_targets("ia3", starcoder2) == (["k_proj", "v_proj", "c_proj"], ["c_proj"])
    gemma2, _ = build_pair("gemma2")
    norms = peft_methods.default_targets("ln_tuning", gemma2)[0]
    assert {"input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm", "norm"} <= set(norms)
    mixtral, _ = build_pair("mixtral")  # experts are fused parameters, no MLP linear layer: IA3 scales k and v
    assert peft_methods.default_targets("ia3", mixtral) == (["k_proj", "v_proj"], [])


@pytest.mark.parametrize(
    ("model_type", "options", "words"),
    [
        (
            "qwen2",
            {},
            "--peft_type llama-adapter: PEFT's adaption prompt supports llama and mistral models only, and "
            "this model is a qwen2. Choose another --peft_type: lora, ia3, adalora, vera, ln_tuning.",
        ),
        ("llama", {"adapter_layers": 30}, "--adapter_layers 30: the model has 2 decoder layers; pass 2 or less."),
    ],
)
def test_llama_adapter_where_peft_cannot_is_refused_before_loading(model_type, options, words):
    _, stock = build_pair(model_type)
    arguments = PeftArguments(peft_type="llama-adapter", **options)
    with pytest.raises(FineTuningError) as error:
        peft_methods.check_model_supports(arguments, stock.config)
    assert str(error.value) == words


@pytest.mark.parametrize(
    ("peft", "lora", "words"),
    [
        ({"peft_type": "ia3", "adalora_init_r": 6}, {}, "--peft_type ia3 does not use --adalora_init_r (adalora)"),
        ({"peft_type": "lora", "vera_target_modules": ["q_proj"]}, {}, "does not use --vera_target_modules (vera)"),
        ({"peft_type": "adalora"}, {"lora_rank": 16}, "--peft_type adalora does not use --lora_rank (lora)"),
        ({"peft_type": "ia3"}, {"lora_target_modules": ["q_proj"]}, "--lora_target_modules (lora or adalora)"),
        ({"peft_type": "adalora", "adalora_orth_reg_weight": 0.0}, {}, "--adalora_orth_reg_weight must be above 0"),
        ({"peft_type": "llama-adapter", "adapter_len": 0}, {}, "--adapter_len must be at least 1, got 0."),
        ({"peft_type": "lora"}, {"lora_dropout": 1.0}, "--lora_dropout must be in [0, 1), got 1.0."),
    ],
)
def test_options_of_another_method_and_bad_values_are_refused(peft, lora, words):
    with pytest.raises(FineTuningError, match=None) as error:
        peft_methods.check_peft_arguments(PeftArguments(**peft), LoraArguments(**lora))
    assert words in str(error.value)


def test_misspelt_targets_are_named_with_what_the_method_can_adapt():
    model, _ = build_pair("llama")
    config = peft_methods.peft_config(
        PeftArguments("ln_tuning", ln_target_modules=["input_norm"]), LoraArguments(), model
    )
    with pytest.raises(FineTuningError) as error:
        peft_methods.add_adapter(model, config, "ln_tuning")
    assert str(error.value) == (
        "--ln_target_modules: GaudiLlamaForCausalLM has no module named 'input_norm'. Its layers that --peft_type "
        "ln_tuning can adapt: input_layernorm norm post_attention_layernorm."
    )


def test_ia3_feedforward_modules_must_be_targets():
    model, _ = build_pair("llama")
    arguments = PeftArguments("ia3", ia3_target_modules=["k_proj"], feedforward_modules=["down_proj"])
    with pytest.raises(FineTuningError, match="--feedforward_modules down_proj: every feed-forward module must"):
        peft_methods.peft_config(arguments, LoraArguments(), model)


class TokenDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        ids = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def train_adalora(tmp_path, callbacks, max_steps=8):
    model = adapted(
        "llama", "adalora", adalora_init_r=6, adalora_target_r=2, adalora_tinit=1, adalora_tfinal=1, adalora_delta_t=1
    )
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=100,
    )
    Trainer(model=model, args=arguments, train_dataset=TokenDataset(), callbacks=callbacks).train()
    return model.base_model


def test_adalora_ranks_are_pruned_only_with_its_schedule(tmp_path):
    pruned = train_adalora(tmp_path / "with", [peft_methods.AdaLoraSchedule()])
    config = pruned.peft_config["default"]
    assert config.total_step == 8  # the Trainer's step count, not the placeholder
    ranks = {name: sum(map(bool, mask)) for name, mask in (config.rank_pattern or {}).items()}
    assert ranks, "update_and_allocate never ran"
    assert sum(ranks.values()) <= 2 * len(ranks) < 6 * len(ranks)  # down to the target budget from init_r
    untouched = train_adalora(tmp_path / "without", [])
    assert untouched.peft_config["default"].rank_pattern is None  # what transformers' Trainer alone does


def test_adalora_schedule_longer_than_the_run_is_a_clear_error(tmp_path):
    with pytest.raises(FineTuningError, match="--adalora_tinit 1 and --adalora_tfinal 1 leave no step to prune"):
        train_adalora(tmp_path, [peft_methods.AdaLoraSchedule()], max_steps=2)


def test_llama_adapter_loads_for_generation_unmerged(tmp_path):
    trained = adapted("llama", "llama-adapter", adapter_layers=2, adapter_len=3)
    with torch.no_grad():
        for module in trained.modules():
            if isinstance(module, AdaptedAttention):
                module.adaption_gate.fill_(0.5)
    trained.save_pretrained(tmp_path)
    base, _ = build_pair("llama")
    expected = copy.deepcopy(base)
    loaded = apply_peft_adapter(base, str(tmp_path))
    assert not isinstance(loaded, PeftModel) and type(loaded).__name__ == "GaudiLlamaForCausalLM"
    assert sum(isinstance(module, AdaptedAttention) for module in loaded.modules()) == 2
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = PeftModel.from_pretrained(expected, str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, reference(input_ids=ids).logits)
        assert not torch.allclose(loaded(input_ids=ids).logits, build_pair("llama")[0](input_ids=ids).logits)


def test_adalora_schedule_finds_the_model_under_a_distributed_wrapper():
    model = adapted("llama", "adalora")
    wrapped = SimpleNamespace(module=model)
    assert peft_methods.adalora_model(wrapped) is model.base_model
