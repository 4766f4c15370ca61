"""damcha_experiments: does DAMCHA learn better? Models, baselines, resumable runs, statistics and reports.

Run ``damcha experiment TASK --preset P`` (tasks: crosshead, charlm, listops,
digits; presets: smoke, default, full, large) and ``damcha experiment report
DIR``; see docs/experiments.md. PyTorch (and matplotlib) are imported on first
use of the models, training loop or plots, never by ``import
damcha_experiments`` alone, so the data generators, presets and statistics
work without them.
"""

from __future__ import annotations

from typing import Any

from ._data import (
    Corpus,
    Dataset,
    ImageSplit,
    crosshead_answer,
    digits_split,
    listops_eval,
    listops_parse,
    listops_tokens,
    make_crosshead,
    make_listops,
    stdlib_corpus,
)
from ._stats import (
    describe,
    holm,
    mcnemar_exact,
    median_interval,
    paired_difference,
    sign_flip_test,
    t_cdf,
    t_quantile,
)
from ._tasks import PRESETS, TASK_NAMES, TaskConfig, task_config
from ._variants import ABLATION, HEADLINE, SUITES, VARIANTS, Variant

__all__ = [
    "ABLATION",
    "Corpus",
    "Dataset",
    "DigitsViT",
    "HEADLINE",
    "ImageSplit",
    "PRESETS",
    "SUITES",
    "TASK_NAMES",
    "TalkingHeadsAttention",
    "TaskConfig",
    "TinyTransformer",
    "VARIANTS",
    "Variant",
    "as_variant",
    "attention_factory",
    "build_report",
    "crosshead_answer",
    "describe",
    "digits_split",
    "holm",
    "listops_eval",
    "listops_parse",
    "listops_tokens",
    "make_crosshead",
    "make_listops",
    "mcnemar_exact",
    "measure_cost",
    "median_interval",
    "paired_difference",
    "run_experiment",
    "run_suite",
    "sign_flip_test",
    "stdlib_corpus",
    "t_cdf",
    "t_quantile",
    "task_config",
    "train_run",
    "write_results",
]

# name -> module that defines it; these pull in PyTorch (and matplotlib), so on demand.
_LAZY = {
    "DigitsViT": "._models",
    "TinyTransformer": "._models",
    "attention_factory": "._models",
    "as_variant": "._models",
    "TalkingHeadsAttention": "._talking_heads",
    "train_run": "._train",
    "run_suite": "._suite",
    "run_experiment": "._suite",
    "measure_cost": "._cost",
    "write_results": "._report",
    "build_report": "._report",
}


# Old names kept one release (they warn): the first version's default variants and task table.
_DEPRECATED = {"DEFAULT_VARIANTS": "HEADLINE", "TASKS": "TASK_NAMES"}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        import warnings

        warnings.warn(
            f"damcha_experiments.{name} is deprecated; use {_DEPRECATED[name]} (and task_config for a task's settings)",
            DeprecationWarning,
            stacklevel=2,
        )
        return HEADLINE if name == "DEFAULT_VARIANTS" else {t: task_config(t) for t in TASK_NAMES}
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
