"""damcha_experiments: does DAMCHA learn better? Models, baselines and reproducible comparisons.

Run ``damcha experiment TASK`` (tasks: crosshead, charlm, listops). PyTorch is
imported on first use of the models, never by ``import damcha_experiments``
alone, so the data generators work without it.
"""

from __future__ import annotations

from typing import Any

from ._data import (
    Corpus,
    Dataset,
    crosshead_answer,
    listops_eval,
    listops_parse,
    listops_tokens,
    make_crosshead,
    make_listops,
    stdlib_corpus,
)

__all__ = [
    "Corpus",
    "DEFAULT_VARIANTS",
    "Dataset",
    "TASKS",
    "TalkingHeadsAttention",
    "TinyTransformer",
    "VARIANTS",
    "attention_factory",
    "crosshead_answer",
    "listops_eval",
    "listops_parse",
    "listops_tokens",
    "make_crosshead",
    "make_listops",
    "run_experiment",
    "stdlib_corpus",
    "write_results",
]

# name -> module that defines it; these pull in PyTorch (and matplotlib), so on demand.
_LAZY = {
    "DEFAULT_VARIANTS": "._train",
    "TASKS": "._train",
    "run_experiment": "._train",
    "VARIANTS": "._models",
    "TinyTransformer": "._models",
    "attention_factory": "._models",
    "TalkingHeadsAttention": "._talking_heads",
    "write_results": "._report",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
