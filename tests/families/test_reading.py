"""The reading of a family's code that qualification rests on (`families/source_facts.py`, `branches.py`), on small
classes written here: what reaches the attention call decides, not every call of the same attribute, and a dict of
mask arguments counts as handed on only where a mask builder or the attention receives it."""

import ast
import dataclasses
import gc
import importlib
import inspect
import weakref
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from optimum.habana import gaudi_model_class
from optimum.habana.transformers.continuous_batching import check_engine_serves
from optimum.habana.transformers.families import source_facts
from optimum.habana.transformers.families.branches import forwards_kwargs_to
from optimum.habana.transformers.families.cache_facts import computes_with_cached_states, writes_cache_at_own_index
from optimum.habana.transformers.families.lookups import family_runs_mask_free
from optimum.habana.transformers.families.mask_facts import MASK_BUILDERS, mask_uses
from optimum.habana.transformers.families.qualification import causal_lm_model_types, judge_family
from optimum.habana.transformers.families.source_facts import decoder_path
from optimum.habana.transformers.models import family_problem


def create_causal_mask(**kwargs):
    return None


def create_recurrent_attention_mask(arguments):
    return None


class Attention(nn.Module):
    def forward(self, hidden_states, **kwargs):
        return hidden_states, None


class MLP(nn.Module):
    def forward(self, hidden_states):
        return hidden_states


MIXERS = {"attention": Attention, "mlp": MLP}


class LayerUsingItsOutput(nn.Module):
    """`output, _ = self.self_attn(...)`: later method calls of `output` are no calls of the attention."""

    def __init__(self):
        super().__init__()
        self.self_attn = Attention()

    def forward(self, hidden_states, **kwargs):
        output, _ = self.self_attn(hidden_states.float(), **kwargs)
        return output.unsqueeze(-2).squeeze(-2)


class LayerCallingAttentionBare(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()

    def forward(self, hidden_states, **kwargs):
        output, _ = self.self_attn(hidden_states)
        return output


class Block(nn.Module):
    """A hybrid block: one attribute built by its kind, the attention's branch with the keywords, the MLP's without."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.mixer = MIXERS[self.kind]()

    def forward(self, hidden_states, **kwargs):
        if self.kind == "attention":
            hidden_states, _ = self.mixer(hidden_states, **kwargs)
        else:
            hidden_states = self.mixer(hidden_states)
        return hidden_states


class BlockCallingAttentionBare(Block):
    def forward(self, hidden_states, **kwargs):
        if self.kind != "mlp":
            hidden_states, _ = self.mixer(hidden_states)
        else:
            hidden_states = self.mixer(hidden_states, **kwargs)
        return hidden_states


def test_a_call_result_bound_to_a_name_is_not_the_module():
    assert forwards_kwargs_to(LayerUsingItsOutput, "self_attn") is True
    assert forwards_kwargs_to(LayerCallingAttentionBare, "self_attn") is False


def test_only_the_branches_that_reach_the_attention_decide():
    assert forwards_kwargs_to(Block, "mixer", frozenset({Attention})) is True
    assert forwards_kwargs_to(Block, "mixer", frozenset({MLP})) is False
    assert forwards_kwargs_to(Block, "mixer") is False  # any class: every call counts
    assert forwards_kwargs_to(BlockCallingAttentionBare, "mixer", frozenset({Attention})) is False


class MaskThroughBuilder(nn.Module):
    def forward(self, attention_mask=None):
        mask_kwargs = {"attention_mask": attention_mask, "cache": None}
        return create_causal_mask(**mask_kwargs)


class MaskThroughOtherFunction(nn.Module):
    def forward(self, attention_mask=None):
        return create_recurrent_attention_mask({"attention_mask": attention_mask})


class MaskDictGivenElsewhere(nn.Module):
    def forward(self, attention_mask=None):
        arguments = {"attention_mask": attention_mask}
        create_causal_mask(config=None)
        return create_recurrent_attention_mask(arguments)


def test_a_dict_of_mask_arguments_is_handed_on_only_where_a_mask_builder_receives_it():
    assert mask_uses(MaskThroughBuilder, MASK_BUILDERS) == ()
    assert mask_uses(MaskThroughOtherFunction, MASK_BUILDERS) == ("attention_mask",)
    assert mask_uses(MaskDictGivenElsewhere, MASK_BUILDERS) == ("attention_mask",)


ALL_ATTENTION_FUNCTIONS = {}
shared = {}


class CachedAttention(nn.Module):
    def forward(self, key_states, value_states, past_key_values=None, cycle_offset=0):
        return past_key_values.update(key_states, value_states, self.layer_idx)


class RecurrentAttention(nn.Module):
    def forward(self, key_states, value_states, past_key_values=None, cycle_offset=0):
        return past_key_values.update(key_states, value_states, self.layer_idx + cycle_offset)


class RepeatingAttention(nn.Module):
    def forward(self, key_states, value_states, past_key_values=None):
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        shared[0] = key_states, value_states  # stored as they are: not computed with
        key_states = key_states.repeat(1, 2, 1, 1)
        attention_interface = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return attention_interface(self, key_states, value_states, key_states.shape[2])


def test_a_cache_written_at_an_offset_from_the_modules_index_is_seen():
    assert writes_cache_at_own_index(CachedAttention)
    assert not writes_cache_at_own_index(RecurrentAttention)


def test_keys_or_values_computed_with_after_the_cache_update_are_seen():
    assert computes_with_cached_states(RepeatingAttention) == ("key_states",)
    assert computes_with_cached_states(CachedAttention) == ()


@pytest.mark.parametrize("model_type", ["jetmoe", "doge", "hrm_text"])
def test_families_the_engine_cannot_serve_are_refused_before_any_request(model_type):
    from tests.families.support import family_pair

    ours, _ = family_pair(model_type)
    with pytest.raises(ValueError, match="cannot run in transformers' continuous batching: its attention"):
        check_engine_serves(ours)


@pytest.mark.parametrize(
    ("model_type", "path"),
    [("llama", ("model",)), ("opt", ("model", "decoder")), ("llama4_text", ("model",))],  # Llama 4's prefix differs
)
def test_the_decoder_is_the_module_the_causal_lm_calls(model_type, path):
    from optimum.habana import gaudi_model_class

    stock = next(cls for cls in gaudi_model_class(model_type).__mro__ if cls.__module__.startswith("transformers."))
    assert decoder_path(stock) == path


class Decoder(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return create_causal_mask(attention_mask=attention_mask)


class CausalLMUnderAnotherPrefix(nn.Module):
    """Llama 4's causal LM: its base-model prefix names the multimodal model's attribute, its decoder is `model`."""

    base_model_prefix = "language_model"

    def __init__(self):
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(4, 4)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return self.lm_head(hidden_states)


def test_the_decoder_is_the_module_handed_the_attention_mask_whatever_the_prefix_says():
    assert decoder_path(CausalLMUnderAnotherPrefix) == ("model",)


@pytest.mark.parametrize("model_type", ["llama4_text", "llama4"])
def test_llama4_runs_mask_free(model_type):
    """Only its attention reads the masks its decoder builds: a reading that looked the decoder up under the base
    model's prefix ("language_model", the multimodal model's attribute) found none and said otherwise."""
    assert judge_family(model_type).mask_free


@pytest.mark.parametrize("model_type", ["deepseek_v4", "nemotron_h", "inkling2_text", "opt"])
def test_families_refused_by_the_old_reading_qualify(model_type):
    """Refused as "calls the attention without the call's keyword arguments" by a reading that counted method calls
    on an attention call's result (and an MLP branch's call) as calls of the attention."""
    report = judge_family(model_type)
    assert report.qualifies, report.reason


@pytest.mark.parametrize(
    "model_type, attention",
    [("zamba2", ("Zamba2Attention",)), ("moshi", ("MoshiAttention",))],
    ids=["layers built by a method, a block handed in", "a text-only causal LM of a multimodal config"],
)
def test_families_the_reading_did_not_follow_qualify(model_type, attention):
    """Zamba 2 builds its layers in `self.get_layers()` and hands each hybrid layer its shared attention block (its
    constructor's annotated parameter): the reading found no attention and said it bypassed the interface. Moshi's
    causal LM shares its config (and its audio sub-config) with the audio model and builds only the text stack: it was
    read as multimodal. Both run fused with stock's logits (test_every_family)."""
    report = judge_family(model_type)
    assert report.qualifies, report.reason
    assert report.attention_classes == attention


def test_a_drafter_built_from_any_text_config_is_not_called_a_state_space_model():
    """Gemma 4's assistant builds its language model from its text config at run time (AutoModel), which the reading
    cannot follow: it was said to have no attention layer."""
    reason = judge_family("gemma4_assistant").reason
    assert (
        reason
        == "its language model is built at run time from its text config, of any model type: this reading cannot follow it"
    )


def test_emu3s_config_model_type_reads_as_emu3():
    """Emu3's causal LM is built from an `Emu3TextConfig`, whose model type 'emu3_text_model' is no key of
    transformers' causal-LM mapping: a model's `config.model_type` and a saved checkpoint's carry it, and every run-time
    question is asked with it. Read as no causal LM, it planned no padded prompt mask-free, refused context parallelism
    ("reads the attention mask outside its attention") and had no Gaudi class for a stock checkpoint."""
    assert gaudi_model_class("emu3").config_class.model_type == "emu3_text_model"
    assert judge_family("emu3_text_model") == judge_family("emu3")
    assert family_runs_mask_free("emu3_text_model")
    assert family_problem("emu3_text_model") is None
    assert gaudi_model_class("emu3_text_model") is gaudi_model_class("emu3")


@pytest.mark.parametrize("model_type", ["clip", "no_such_model"])
def test_a_model_type_of_no_causal_lm_still_reads_as_none(model_type):
    assert judge_family(model_type).reason == "transformers maps no causal LM to this model type"


def without_model_type(report) -> dict:
    return {name: value for name, value in dataclasses.asdict(report).items() if name != "model_type"}


@pytest.mark.families
def test_every_familys_config_model_type_reads_as_its_family():
    """Every causal-LM family of the installed transformers whose causal LM's config class has another model type
    (transformers 5.23: dots3_note, emu3, gpt-sw3, internlm3, iquestcoder, llama4, mllama, musicgen, musicgen_melody,
    qwen3_5, qwen3_5_moe, qwen4_exp): that model type, the one its models' configs carry, gets the family's report."""
    differing = {}
    for model_type in causal_lm_model_types():
        report = judge_family(model_type)
        try:
            config_type = getattr(transformers, report.class_name).config_class.model_type
        except (ImportError, AttributeError):
            continue  # its code cannot be imported here: the report says so
        if config_type != model_type:
            differing[model_type] = config_type
            assert without_model_type(judge_family(config_type)) == without_model_type(report), model_type
            assert family_runs_mask_free(config_type) == report.mask_free, model_type
    assert differing["emu3"] == "emu3_text_model" and differing["llama4"] == "llama4_text"


OTHER_FAMILIES = ("mistral", "qwen2", "gemma", "phi3", "olmo2", "starcoder2", "qwen3", "granite")


def test_the_syntax_of_files_and_classes_read_long_ago_is_released():
    """Every full garbage collection walks every object alive: the syntax trees of all families judged (about a
    million objects with the family table) made each of transformers' engine's collections take 0.4 s."""
    llama = transformers.LlamaForCausalLM
    tree = weakref.ref(source_facts._tree(inspect.getsourcefile(llama)))
    node = weakref.ref(source_facts.class_node(llama))
    modules = [importlib.import_module(f"transformers.models.{name}.modeling_{name}") for name in OTHER_FAMILIES]
    for module in modules[: source_facts.SYNTAX_KEPT_FILES]:
        source_facts._tree(module.__file__)
    classes = [value for module in modules for value in vars(module).values() if isinstance(value, type)]
    defined_there = list(dict.fromkeys(cls for cls in classes if cls.__module__ in {m.__name__ for m in modules}))
    assert len(defined_there) >= source_facts.SYNTAX_KEPT_CLASSES
    for cls in defined_there[: source_facts.SYNTAX_KEPT_CLASSES]:
        source_facts.class_node(cls)
    gc.collect()
    assert tree() is None and node() is None


TRICKY_SOURCE = '''"""A module docstring that shows a class at the start of a line:
class Shown(Base):
    pass
"""
import dataclasses


class Base:
    def forward(self):
        return 1


class Shown(Base):
    """A docstring whose lines
start in the first column."""

    def forward(self):
        return 2


@dataclasses.dataclass
class Decorated(
    Base,
):
    value: int = 0
    # a comment
# a comment in the first column

    def forward(self):
        return (
            3
)
'''


def _full_file_class(cls: type) -> ast.ClassDef:
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text(encoding="utf-8"))
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "deepseek_v3", "qwen3_next", "tricky"])
def test_a_class_read_from_its_own_lines_is_the_class_the_whole_file_gives(family, tmp_path, monkeypatch):
    """Only a class's own lines are parsed (a whole modeling file costs ~40 ms), and only where they are certain:
    a class line in a string, a docstring or bracket reaching the first column, decorators, all read as in the file."""
    if family == "tricky":
        (tmp_path / "tricky_module.py").write_text(TRICKY_SOURCE)
        monkeypatch.syspath_prepend(str(tmp_path))
        module = importlib.import_module("tricky_module")
    else:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    classes = [
        value for value in vars(module).values() if isinstance(value, type) and value.__module__ == module.__name__
    ]
    assert len(classes) >= 3
    for cls in classes:
        expected = ast.dump(_full_file_class(cls), include_attributes=True)
        assert ast.dump(source_facts.class_node(cls), include_attributes=True) == expected, cls.__name__


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("bart", "the decoder of an encoder-decoder model: BartDecoderLayer has cross-attention (self.encoder_attn "),
        ("whisper", "the decoder of an encoder-decoder model: WhisperDecoderLayer has cross-attention"),
        ("mvp", "MvpAttention computes attention itself"),  # its own scores, whatever the config says
    ],
)
def test_an_encoder_decoder_model_types_decoder_is_refused_for_what_its_code_does(model_type, reason):
    """Not for the config's `is_encoder_decoder`: the decoder's own layers decide (MusicGen Melody's has no
    cross-attention, and is read on like any decoder, below)."""
    assert judge_family(model_type).reason.startswith(reason)


class DropsGenerationKwargs(transformers.LlamaForCausalLM):
    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **kwargs):
        return {"input_ids": input_ids[:, -1:], "past_key_values": past_key_values}


class HandsGenerationKwargsOn(transformers.LlamaForCausalLM):
    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return super().prepare_inputs_for_generation(input_ids, **kwargs)


class NamesEveryInput(transformers.LlamaForCausalLM):
    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **model_kwargs):
        return {"input_ids": input_ids, "past_key_values": past_key_values, **model_kwargs}


def test_a_prepare_inputs_for_generation_that_names_its_inputs_only_is_read_as_dropping_the_flags():
    assert source_facts.drops_generation_kwargs(DropsGenerationKwargs) == (
        "DropsGenerationKwargs.prepare_inputs_for_generation hands each step only the inputs it names (its **kwargs "
        "go nowhere)"
    )
    assert source_facts.drops_generation_kwargs(HandsGenerationKwargsOn) is None
    assert source_facts.drops_generation_kwargs(NamesEveryInput) is None
    assert source_facts.drops_generation_kwargs(transformers.LlamaForCausalLM) is None  # GenerationMixin's own
    report = judge_family("musicgen_melody")
    assert not report.qualifies and report.reason == (
        "MusicgenMelodyForCausalLM.prepare_inputs_for_generation hands each step only the inputs it names (its "
        "**kwargs go nowhere), so the flags given to generate() cannot reach the attention"
    )


def test_the_flags_do_not_reach_musicgen_melodys_steps_through_generate(monkeypatch):
    """What the refusal above reads, run: the mixin put in front of MusicGen Melody's decoder by hand (whose forward
    takes no `logits_to_keep`, which the mixin's forward hands on only to a forward that takes it), the flag given to
    forward takes the fused path with stock's logits; given to generate(), which would drop it on the way to every
    step (the steps ran the default path, stock's logits to the bit, before generate() said so), it is an error that
    names the method. On the model's own generation config it reaches every step."""
    from optimum.habana.transformers.modeling_utils import GaudiAttentionMixin
    from tests.families.tiny_configs import tiny_family_config
    from tests.helpers import count_attention_paths

    stock = transformers.MusicgenMelodyForCausalLM
    by_hand = type("ByHandMusicgenMelody", (GaudiAttentionMixin, stock), {})
    sizes = {"num_codebooks": 1, "decoder_start_token_id": 1}  # one codebook: a row of input ids is a sequence
    model = by_hand(tiny_family_config("musicgen_melody", stock.config_class, **sizes)).eval()
    reference = stock(tiny_family_config("musicgen_melody", stock.config_class, attn_implementation="eager", **sizes))
    reference.load_state_dict(model.state_dict())
    ids = torch.arange(3, 21).view(2, 9)
    with count_attention_paths(monkeypatch, profile=False) as counts, torch.no_grad():
        logits = model(input_ids=ids, use_flash_attention=True).logits
    assert counts["fused"] > 0
    assert (logits - reference.eval()(input_ids=ids).logits).abs().max() <= 1e-5
    steps = {"input_ids": ids, "max_new_tokens": 3, "do_sample": False}
    with pytest.raises(ValueError, match=r"^MusicgenMelodyForCausalLM\.prepare_inputs_for_generation hands each step"):
        model.generate(**steps, use_flash_attention=True)
    model.generation_config.use_flash_attention = True
    with count_attention_paths(monkeypatch, profile=False) as counts:
        model.generate(**steps)
    assert counts["fused"] > 0 and counts["default"] == 0
