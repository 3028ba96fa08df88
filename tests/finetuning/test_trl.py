"""TRL's SFTTrainer on a Gaudi model: the flag in the model's generation config reaches every attention call of
training, and the losses are stock sdpa's.

SFTTrainer computes its loss with its own LM head over `model.base_model(...)`, never the causal LM's forward: the
route that used to run every call on the default path. Padded batches, padding-free batches and packing each run
3 steps on a tiny random Llama, once with the stock class (transformers' sdpa) and once with the Gaudi class.
"""

import pytest
import torch
from datasets import Dataset
from transformers import LlamaForCausalLM

from optimum.habana import GaudiLlamaForCausalLM
from tests.helpers import count_attention_paths, tiny_llama_config, train_tiny_tokenizer


trl = pytest.importorskip("trl", reason="TRL is in the tests extra: pip install 'optimum-gaudi-flash[tests]'")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Flash attention computes exact attention.",
    "Gaudi is an accelerator for deep learning training and inference.",
    "Once upon a time.",
] * 4
VARIANTS = {
    "padded": {},
    "padding_free": {"padding_free": True, "max_length": None},
    "packing": {"packing": True, "max_length": 24},
}


def train(model, tokenizer, tmp_path, variant: str) -> list[float]:
    arguments = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        bf16=False,  # TRL's default is bf16 autocast (and gradient checkpointing, kept): compare in fp32
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        **VARIANTS[variant],
    )
    trainer = trl.SFTTrainer(
        model=model, args=arguments, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer
    )
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sft_trainer_trains_through_the_fused_kernel_with_stock_losses(variant, tmp_path, monkeypatch):
    tokenizer = train_tiny_tokenizer(chat_template=False)
    torch.manual_seed(0)
    stock = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))
    ours = GaudiLlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))
    ours.load_state_dict(stock.state_dict())
    ours.generation_config.use_flash_attention = True
    expected = train(stock, tokenizer, tmp_path / "stock", variant)
    with count_attention_paths(monkeypatch, profile=False) as counts:
        losses = train(ours, tokenizer, tmp_path / "gaudi", variant)
    assert len(losses) == 3
    assert losses == pytest.approx(expected, abs=1e-5, rel=0)
    assert counts["fused"] > 0 and counts["default"] == 0
