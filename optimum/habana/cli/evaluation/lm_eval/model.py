"""A Gaudi causal LM as an lm-evaluation-harness model, for `examples/text-generation/run_lm_eval.py`.

`GaudiEvalLM` is lm-eval's `HFLM` around an already loaded Gaudi model: HFLM keeps what it does well (tokenizing,
batching and sorting requests, rolling windows, chat templates, stop sequences) and this class owns the two places
where the model runs. Every forward of a loglikelihood or rolling-loglikelihood batch and every generate() of a
generate_until batch gets the attention flags explicitly, off included, so a checkpoint's own generation config
never decides them. With buckets, each batch is padded to the smallest bucket that fits (a longer batch makes its
own length a new bucket), so a compiled model or an HPU graph sees a few shapes instead of one per batch.
"""

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from optimum.habana.cli.generation.arguments import SAMPLING_ARGUMENTS
from optimum.habana.cli.generation.generation_config import CacheLayout, KVCacheSupply, compile_config_for
from optimum.habana.transformers.generation import GaudiGenerationConfig


# Optimum-Habana's run_lm_eval.py default buckets, used with --static_shapes when --buckets is not given.
DEFAULT_BUCKETS = (16, 32, 64, 128, 189, 284, 384)


# lm-eval's own default for the tokens a generate_until request may produce when its task does not say.
LM_EVAL_MAX_GEN_TOKS = 256


class Buckets:
    """Sequence lengths a batch is padded to: the smallest that fits, or the batch's own length as a new one.

    None passes `limit`, the model's length: a learned position table ends there (GPT-2's lookup failed past it),
    and buckets beyond it give way to the limit itself. `boundaries` are lengths a batch is never padded across (a
    longrope embedding switches its frequencies past its original length, for every real token): each becomes a
    bucket too.
    """

    def __init__(self, sizes: Iterable[int], limit: int | None = None, boundaries: Iterable[int] = ()) -> None:
        sizes = set(sizes)
        self.dropped = sorted(size for size in sizes if limit is not None and size > limit)
        kept = sizes.difference(self.dropped) | ({limit} if self.dropped else set())
        self.sizes = sorted(kept | {boundary for boundary in boundaries if kept and boundary < max(kept)})

    def fit(self, length: int) -> int:
        index = bisect.bisect_left(self.sizes, length)
        if index == len(self.sizes):
            self.sizes.append(length)
            return length
        return self.sizes[index]


@dataclass(frozen=True)
class EvalOptions:
    """What run_lm_eval.py's flags decide about how the model runs."""

    attention: dict[str, bool]  # the five attention flags, each given explicitly
    buckets: tuple[int, ...] = ()  # empty: every batch keeps its own length
    cache_layout: CacheLayout = CacheLayout("dynamic")  # generate_until's KV cache
    compile_backend: str | None = None  # torch.compile's backend; None: nothing is compiled
    max_gen_toks: int = LM_EVAL_MAX_GEN_TOKS  # default for generate_until requests whose task sets none


class GaudiEvalLM(HFLM):
    """HFLM whose forwards and generate() calls carry the attention flags; see the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        options: EvalOptions,
        *,
        batch_size: int = 1,
        max_length: int | None = None,
        model_info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, max_length=max_length
        )
        self.options = options
        self.buckets = None
        if options.buckets:
            self.buckets = Buckets(options.buckets, self.max_length, rope_boundaries(model.config))
        self._model_info = dict(model_info or {})
        # torch.compile(model) returns a wrapper sharing the model's weights; generate() compiles through its config.
        self._forward = (
            model if options.compile_backend is None else torch.compile(model, backend=options.compile_backend)
        )
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @property
    def max_gen_toks(self) -> int:
        return self.options.max_gen_toks

    def _model_call(
        self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of a right-padded batch: padded on the right to its bucket, which causality keeps invisible."""
        if attn_mask is not None or labels is not None:
            raise ValueError("GaudiEvalLM runs causal LMs only; encoder-decoder requests cannot reach it.")
        length = inps.shape[1]
        if self.buckets is not None:
            inps = F.pad(inps, (0, self.buckets.fit(length) - length), value=self._pad_id)
        with torch.no_grad():
            logits = self._forward(input_ids=inps, use_cache=False, **self.options.attention).logits
        # float32 log-probabilities whatever the model's dtype, as Optimum-Habana's adapter does.
        return logits[:, :length].float()

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ) -> torch.Tensor:
        """generate() for a left-padded batch; with buckets it is left-padded further, and the output trimmed back,
        so HFLM finds the new tokens where it expects them."""
        if context.shape[1] == 0:  # stock HFLM fails inside generate(); with buckets it would continue from padding
            raise ValueError(
                "generate_until requests with empty prompts: their task's doc_to_text gives no text to continue."
            )
        attention_mask = generation_kwargs.pop("attention_mask", None)
        if attention_mask is None:
            attention_mask = torch.ones_like(context)
        extra = 0
        if self.buckets is not None:
            extra = self.buckets.fit(context.shape[1]) - context.shape[1]
            context = F.pad(context, (extra, 0), value=self._pad_id)
            attention_mask = F.pad(attention_mask, (extra, 0), value=0)
            max_length += extra
        kwargs = sampling_kwargs(generation_kwargs)
        stopping_criteria = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], context.shape[0])
        supply = KVCacheSupply(self.options.cache_layout, self.model.config, max_cache_len=max_length)
        cache = supply()
        cache_argument = {} if cache is None else {"past_key_values": cache}
        with torch.no_grad():
            output = self.model.generate(
                input_ids=context,
                attention_mask=attention_mask,
                max_length=max_length,
                stopping_criteria=stopping_criteria,
                generation_config=self.generation_config(),
                **cache_argument,
                **kwargs,
            )
        return output[:, extra:]

    def generation_config(self) -> GaudiGenerationConfig:
        """The model's generation config with the attention flags, the cache layout and, with --torch_compile,
        the compile config; lm-eval's per-request settings are passed to generate() on top of it."""
        values = self.model.generation_config.to_dict()
        for name in ("compile_config", "max_new_tokens", "max_length", *SAMPLING_ARGUMENTS):
            values.pop(name, None)
        layout = self.options.cache_layout
        values.update(pad_token_id=self._pad_id, use_cache=layout.kind != "none", **self.options.attention)
        if layout.kind == "static" and not layout.reused:
            values["cache_implementation"] = "static"
        config = GaudiGenerationConfig.from_dict(values)
        if self.options.compile_backend is not None:
            config.compile_config = compile_config_for(self.device, self.options.compile_backend)
        return config

    def warm_up(self) -> int:
        """One forward per bucket, largest first, so compilation (or HPU graph capture) happens before the timed
        evaluation; returns the number of forwards."""
        if self.buckets is None:
            return 0
        for size in reversed(self.buckets.sizes):
            self._model_call(torch.full((self.batch_size, size), self._pad_id, dtype=torch.long, device=self.device))
        return len(self.buckets.sizes)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records under `config`, without its hub lookups (the model is already loaded)."""
        return {
            "model_num_parameters": self.model.num_parameters(),
            "model_dtype": str(self.model.dtype),
            **self._model_info,
        }


def rope_boundaries(config: Any) -> tuple[int, ...]:
    """The length past which a longrope embedding (Phi-3's) switches to its long factors, for every position."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return ()
    original = rope.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return (original,) if original else ()


def sampling_kwargs(generation_kwargs: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's request settings for generate(): greedy unless the task asks for sampling.

    lm-eval writes temperature 0.0 for greedy requests; transformers rejects a zero temperature when sampling and
    warns about sampling settings in greedy search, so greedy requests lose them.
    """
    kwargs = dict(generation_kwargs)
    do_sample = kwargs.get("do_sample")
    if kwargs.get("temperature", 0.0) == 0.0 and not do_sample:
        kwargs["do_sample"] = False
    if not kwargs.get("do_sample"):
        for name in SAMPLING_ARGUMENTS:
            kwargs[name] = None
    return kwargs
