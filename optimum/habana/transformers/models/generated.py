"""The Gaudi classes made from transformers' own, and their home.

Each made class is named `Gaudi<StockClass>` and lives here, as an attribute of this module, so that pickle and
`copy.deepcopy` find it by name like any class written in a file: a name asked for before its class was made makes
it (PEP 562's module `__getattr__`), provided its family qualifies.
"""

import functools
from typing import Any

import transformers

from ..families.qualification import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from ..families.reports import family_report
from ..modeling_utils import GaudiAttentionMixin
from .modeling_causal_lm import GAUDI_CAUSAL_LM_CLASSES


@functools.cache
def gaudi_class_of(stock: type) -> type[GaudiAttentionMixin]:
    """`stock` with the mixin in front; a written class where one exists (model types that reuse its class)."""
    for written in GAUDI_CAUSAL_LM_CLASSES.values():
        if written.__bases__[-1] is stock:
            return written
    name = f"Gaudi{stock.__name__}"
    made = type(
        name,
        (GaudiAttentionMixin, stock),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"`{stock.__name__}` with the Gaudi attention and its flags, made from transformers' class.",
        },
    )
    globals()[name] = made
    return made


def __getattr__(name: str) -> Any:
    stock_name = name.removeprefix("Gaudi")
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if name != stock_name and class_name == stock_name and family_report(model_type).qualifies:
            return gaudi_class_of(getattr(transformers, stock_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
