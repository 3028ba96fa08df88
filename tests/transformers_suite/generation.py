"""The generation tests of this project's run of transformers' model tests, in place of `GenerationTesterMixin`.

transformers' generation tests (`tests/generation/test_utils.py`) are not in its source distribution, so the ones
the Gaudi classes must pass as stock passes them are written here, under the names transformers gives them: left
padding changes no real position's logits, generate() from embeddings gives the tokens generate() from ids gives, a
compiled `fullgraph=True` decode step traces without a break (no Python warning or host sync inside), greedy
tokens equal the stock class's, and `cache_implementation="static"` hands back transformers' `StaticCache` with
stock's layers and length, from ids, from embeddings and compiled with every output (attention weights spanning the
whole cache). Each runs on the stock class too: a test that fails there proves nothing.
"""

import torch
from transformers import CompileConfig, StaticCache
from transformers.cache_utils import StaticLayer


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

    def _assert_stock_static_cache(self, model, cache, batch_size: int, max_cache_len: int) -> None:
        """What transformers' `test_generate_with_static_cache` asserts of the cache generate() hands back: a
        `StaticCache`, a layer per decoder layer, full-attention storage of `[batch, kv heads, max_cache_len, head
        dim]`; and, beyond it, the stock class's layer kinds. generate() sizes it prompt + new tokens - 1: the last
        token is never cached."""
        config = model.config.get_text_config(decoder=True)
        self.assertIsInstance(cache, StaticCache)
        self.assertEqual(len(cache.layers), config.num_hidden_layers)
        stock = StaticCache(config=config, max_cache_len=max_cache_len)
        self.assertEqual([layer.is_sliding for layer in cache.layers], [layer.is_sliding for layer in stock.layers])
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for layer in cache.layers:
            self.assertIsInstance(layer, StaticLayer)
            if not layer.is_sliding:
                self.assertEqual(layer.max_cache_len, max_cache_len)
                self.assertEqual(tuple(layer.keys.shape), (batch_size, kv_heads, max_cache_len, head_dim))

    def test_generate_with_static_cache(self):
        for model_class in self.all_generative_model_classes:
            model, inputs = self._generative_model(model_class)
            batch = left_padded(inputs["input_ids"], [7, 4, 2])
            outputs = {}
            with torch.no_grad():
                for cache in ("static", None):
                    outputs[cache] = model.generate(
                        **batch, cache_implementation=cache, return_dict_in_generate=True, output_logits=True, **GREEDY
                    )
            batch_size, prompt = batch["input_ids"].shape
            self._assert_stock_static_cache(
                model, outputs["static"].past_key_values, batch_size, prompt + NEW_TOKENS - 1
            )
            self.assertTrue(torch.equal(outputs["static"].sequences, outputs[None].sequences))
            for static, dynamic in zip(outputs["static"].logits, outputs[None].logits, strict=True):
                torch.testing.assert_close(static, dynamic, rtol=1e-5, atol=1e-5)

    def test_generate_from_inputs_embeds_with_static_cache(self):
        for model_class in self.all_generative_model_classes:
            model, inputs = self._generative_model(model_class)
            batch = left_padded(inputs["input_ids"], [7, 4, 2])
            embeds = model.get_input_embeddings()(batch["input_ids"])
            with torch.no_grad():
                from_ids = model.generate(**batch, cache_implementation="static", **GREEDY)
                from_embeds = model.generate(
                    inputs_embeds=embeds,
                    attention_mask=batch["attention_mask"],
                    cache_implementation="static",
                    return_dict_in_generate=True,
                    **GREEDY,
                )
            self.assertTrue(torch.equal(from_ids[:, -NEW_TOKENS:], from_embeds.sequences))
            batch_size, prompt = batch["input_ids"].shape
            self._assert_stock_static_cache(model, from_embeds.past_key_values, batch_size, prompt + NEW_TOKENS - 1)

    def test_generate_compilation_all_outputs(self):
        """transformers' test of the same name: generate() compiled (a static cache) with every optional output;
        each step's attention weights span the whole static cache, as `_check_generate_outputs` asserts."""
        for model_class in self.all_generative_model_classes:
            model, inputs = self._generative_model(model_class)
            model.set_attn_implementation("eager")  # transformers' test: attention weights need it
            torch._dynamo.reset()
            compile_config = CompileConfig(backend="eager")  # the tracing, without inductor's minutes on CPU
            compile_config._compile_all_devices = True
            model.generation_config.compile_config = compile_config
            model.generation_config.cache_implementation = "static"
            batch = left_padded(inputs["input_ids"], [7, 4, 2])
            with torch.no_grad():
                output = model.generate(
                    **batch,
                    output_attentions=True,
                    output_hidden_states=True,
                    output_scores=True,
                    output_logits=True,
                    return_dict_in_generate=True,
                    **GREEDY,
                )
            self.assertTrue(hasattr(model, "_compiled_call"))
            batch_size, prompt = batch["input_ids"].shape
            config = model.config.get_text_config(decoder=True)
            self.assertEqual(output.sequences.shape, (batch_size, prompt + NEW_TOKENS))
            self.assertEqual(len(output.attentions), NEW_TOKENS)
            self._assert_stock_static_cache(model, output.past_key_values, batch_size, prompt + NEW_TOKENS - 1)
            sliding = [layer.is_sliding for layer in output.past_key_values.layers]
            for step, layers in enumerate(output.attentions):
                self.assertEqual(len(layers), config.num_hidden_layers)
                queries = prompt if step == 0 else 1
                for weights, is_sliding in zip(layers, sliding, strict=True):
                    if not is_sliding:
                        self.assertEqual(
                            tuple(weights.shape),
                            (batch_size, config.num_attention_heads, queries, prompt + NEW_TOKENS - 1),
                        )
