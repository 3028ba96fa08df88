"""The generation tests of this project's run of transformers' model tests, in place of `GenerationTesterMixin`.

transformers' generation tests (`tests/generation/test_utils.py`) are not in its source distribution, so the ones
the Gaudi classes must pass as stock passes them are written here, under the names transformers gives them: left
padding changes no real position's logits, generate() from embeddings gives the tokens generate() from ids gives, a
compiled `fullgraph=True` decode step traces without a break (no Python warning or host sync inside), and greedy
tokens equal the stock class's. Each runs on the stock class too: a test that fails there proves nothing.
"""

import torch
from transformers import CompileConfig


NEW_TOKENS = 4
GREEDY = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}


def stock_class(model_class: type) -> type:
    """The transformers class a Gaudi class (or a test subclass of one) extends; a stock class itself."""
    while not model_class.__module__.startswith("transformers."):
        model_class = model_class.__bases__[-1]
    return model_class


def left_padded(input_ids: torch.Tensor, lengths: list[int]) -> dict[str, torch.Tensor]:
    """Each row keeps its last `length` tokens, left-padded with token 0."""
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, input_ids.shape[1] - length :] = 1
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


class GenerationTesterMixin:
    """Mixed into each family's test case next to transformers' `ModelTesterMixin`."""

    def _generative_model(self, model_class: type):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        torch.manual_seed(0)
        return model_class(config).eval(), inputs

    def test_left_padding_compatibility(self):
        for model_class in self.all_generative_model_classes:
            model, inputs = self._generative_model(model_class)
            input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]

            def forward(ids, mask, model=model):
                position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
                return model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits

            padding = torch.zeros(input_ids.shape[0], 32, dtype=input_ids.dtype)
            with torch.no_grad():
                unpadded = forward(input_ids, attention_mask)
                padded = forward(torch.cat([padding, input_ids], 1), torch.cat([padding, attention_mask], 1))
            torch.testing.assert_close(padded[:, 32:], unpadded, rtol=1e-5, atol=1e-5)

    def test_generate_from_inputs_embeds(self):
        for model_class in self.all_generative_model_classes:
            model, inputs = self._generative_model(model_class)
            batch = left_padded(inputs["input_ids"], [7, 4, 2])
            embeds = model.get_input_embeddings()(batch["input_ids"])
            with torch.no_grad():
                from_ids = model.generate(**batch, **GREEDY)
                from_embeds = model.generate(inputs_embeds=embeds, attention_mask=batch["attention_mask"], **GREEDY)
            self.assertTrue(torch.equal(from_ids[:, -NEW_TOKENS:], from_embeds))

    def test_generate_compile_model_forward_fullgraph(self):
        for model_class in self.all_generative_model_classes:
            model, inputs = self._generative_model(model_class)
            batch = left_padded(inputs["input_ids"], [7, 4, 2])
            # Dynamo's recompile limit counts per code object, which every family's forward shares across this
            # session's many models: a fresh start, as in a process that compiles one model.
            torch._dynamo.reset()
            with torch.no_grad():
                expected = model.generate(**batch, cache_implementation="static", **GREEDY)
                compile_config = CompileConfig(fullgraph=True, backend="eager")
                compile_config._compile_all_devices = True  # generate() compiles on CPU only when told to
                compiled = model.generate(
                    **batch, cache_implementation="static", compile_config=compile_config, **GREEDY
                )
            self.assertTrue(torch.equal(compiled, expected))

    def test_greedy_tokens_equal_the_stock_class(self):
        for model_class in self.all_generative_model_classes:
            model, inputs = self._generative_model(model_class)
            stock = stock_class(model_class)(model.config.__class__.from_dict(model.config.to_dict())).eval()
            stock.load_state_dict(model.state_dict())
            batch = left_padded(inputs["input_ids"], [7, 4, 2])
            with torch.no_grad():
                self.assertTrue(torch.equal(model.generate(**batch, **GREEDY), stock.generate(**batch, **GREEDY)))
