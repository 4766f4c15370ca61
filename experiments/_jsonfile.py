"""Reading one JSON object from a file: the one parser of every results, cost and run file.

The outcomes are told apart so that each caller keeps its own policy (a damaged results file
ends the command naming it; a damaged run ``result.json`` is an unfinished run, resumed):

- no such file: ``None``;
- the system cannot read it (permissions, I/O error): ``UnreadableJsonFile``;
- its bytes are no JSON text (not UTF-8, empty, cut off mid-write): ``InvalidJsonFile``;
- valid JSON, but not an object (a file of another kind): ``NotAJsonObject``;
- an object without a field its kind of file always holds (``require_fields``, e.g. a run's
  ``result.json`` and ``RESULT_FIELDS``), or, in a results or cost file, a field the commands
  read of another JSON type or with a value its writer never writes (``check_results_object``):
  ``IncompleteJsonObject``.

All four are ``JsonFileError`` (a ``DamchaValueError``) whose message starts with the path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from damcha_core import DamchaValueError

#: The fields of every finished run's ``result.json`` (``_train._result``; ``environment``, ``environments``
#: and ``head_maps`` are optional: older results lack them). A result missing one is not used.
RESULT_FIELDS = (
    "identity",
    "variant",
    "lr",
    "seed",
    "params",
    "mlp_hidden",
    "steps",
    "stop_reason",
    "lr_decays",
    "diverged",
    "best_step",
    "best_val_metric",
    "best_val_loss",
    "test_metric",
    "test_loss",
    "steps_to_threshold",
    "loss_spikes",
    "spike_steps",
    "time_per_step_s",
    "cpu_per_step_s",
    "train_time_s",
    "resumed_at_step",
    "final_params_sha256",
    "curve",
)


class JsonFileError(DamchaValueError):
    """A JSON file that cannot be used; ``str()`` is ``f"{path} {reason}"``."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


class UnreadableJsonFile(JsonFileError):
    """The system cannot read the file (``OSError``): no statement about its content."""


class InvalidJsonFile(JsonFileError):
    """The file's content is no JSON text: not UTF-8, empty, or not valid JSON (cut off mid-write?)."""


class NotAJsonObject(JsonFileError):
    """The file is valid JSON, but not an object (a file of another kind)."""


class IncompleteJsonObject(JsonFileError):
    """The file holds a JSON object that lacks a field its kind of file always holds."""


def read_json_object(path: str | Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if there is no such file; a ``JsonFileError`` subclass
    naming the file and what is wrong otherwise (see the module docstring)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no such file (NotADirectory: a parent is a file)
        return None
    except OSError as exc:
        raise UnreadableJsonFile(path, f"cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Bytes that are not UTF-8 are damaged content, not a system error; the wording is the
        # one the report has always printed for them.
        raise InvalidJsonFile(path, f"cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        what = "empty" if not text.strip() else "not valid JSON"
        raise InvalidJsonFile(path, f"is {what} ({exc}; cut off mid-write?)") from None
    if not isinstance(obj, dict):
        raise NotAJsonObject(path, f"holds a JSON {type(obj).__name__}, expected a JSON object")
    return obj


def require_fields(path: str | Path, obj: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """``obj`` (read from ``path``) if it holds every one of ``fields``; ``IncompleteJsonObject``
    naming the missing ones (``"lacks a, b"``) otherwise. The trainer and the report both check a
    run's ``result.json`` with it, so both count the same files as damaged."""
    missing = [k for k in fields if k not in obj]
    if missing:
        raise IncompleteJsonObject(Path(path), f"lacks {', '.join(missing)}")
    return obj


# What the report, the merge into --out and --from-json read from a task's results file and from a
# cost file, at each level: a file a hand edit or an older tool left without one of them ended those
# commands with a KeyError traceback (after the training, for a results file in --out). The sets are
# the fields every format of each file has held (the cost format before cost_format 2 included).
RESULTS_FILE_FIELDS = ("task", "suite", "preset", "metric", "higher_is_better", "seeds", "config", "variants")
RESULTS_CONFIG_FIELDS = ("margin", "max_steps", "thresholds")
RESULTS_VARIANT_FIELDS = ("kind", "runs", "params", "chosen_lr", "test", "steps", "lr_sweep", "divergences")
RESULTS_RUN_FIELDS = (
    "seed",
    "diverged",
    "test_metric",
    "stop_reason",
    "steps",
    "steps_to_threshold",
    "loss_spikes",
    "curve",
)
RESULTS_CURVE_FIELDS = ("step", "val_metric", "test_metric", "train_time_s")
COST_FILE_FIELDS = ("task", "batch", "cost_rounds", "cost_steps", "environment", "variants")
COST_VARIANT_FIELDS = (
    "params",
    "activation_bytes",
    "round_s_per_step",
    "time_ratio_vs_mha",
    "train_bytes_ratio_vs_mha",
    "s_per_step",
)


def _require_at(path: Path, obj: Any, fields: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        raise IncompleteJsonObject(
            path, f"holds {where or 'its top level'} as a JSON {_json_type(obj)}, expected an object"
        )
    missing = [k for k in fields if k not in obj]
    if missing:
        at = f" at {where}" if where else ""
        raise IncompleteJsonObject(path, f"lacks {', '.join(missing)}{at}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "bool", int: "int", float: "float"}.get(
        type(value), type(value).__name__
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:  # NaN and infinities included: the writer stores them (diverged runs)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v)


def _is_numbers(v: Any) -> bool:
    return isinstance(v, list) and all(_is_number(x) for x in v)


#: A field's check and what it expects, as said in the refusal.
_Rule = tuple[Callable[[Any], bool], str]

_STR: _Rule = (lambda v: isinstance(v, str), "a string")
_BOOL: _Rule = (lambda v: isinstance(v, bool), "true or false")
_INT: _Rule = (_is_int, "an int")
_NUMBER: _Rule = (_is_number, "a number")
_NUMBERS: _Rule = (_is_numbers, "a list of numbers")
_OBJECT: _Rule = (lambda v: isinstance(v, dict), "an object")
_LIST: _Rule = (lambda v: isinstance(v, list), "a list")
_RATE: _Rule = (lambda v: _is_finite(v) and v > 0, "a learning rate, a finite number > 0")
_STD: _Rule = (lambda v: v is None or _is_number(v), "a number, or null (one run)")
_CI: _Rule = (lambda v: v is None or (_is_numbers(v) and len(v) == 2), "a list of 2 numbers, or null (one run)")
_STEPS_TO: _Rule = (
    lambda v: isinstance(v, dict) and all(x is None or _is_int(x) for x in v.values()),
    "an object of threshold -> step (an int, or null if never reached)",
)

#: The JSON type of each field a command reads (``RESULTS_*_FIELDS``, and in the variants' ``test``
#: and ``steps`` summaries and ``lr_sweep`` what the tables and plots read), as ``_suite.run_suite``
#: writes it. A hand-edited or foreign file with a string for a number went through the checks and
#: ended --from-json with "incomplete (TypeError: must be real number, not str)", naming no field,
#: or exit 0 with the field unused (--no-plots).
_RESULTS_TYPES: dict[str, _Rule] = {
    "task": _STR,
    "suite": _STR,
    "preset": _STR,
    "metric": _STR,
    "higher_is_better": _BOOL,
    "seeds": _INT,
    "config": _OBJECT,
    "variants": _OBJECT,
}
_CONFIG_TYPES = {"margin": _NUMBER, "max_steps": _INT, "thresholds": _NUMBERS}
_VARIANT_TYPES = {
    "kind": _STR,
    "runs": _LIST,
    "params": _INT,
    "chosen_lr": _RATE,
    "test": _OBJECT,
    "steps": _OBJECT,
    "lr_sweep": _OBJECT,
    "divergences": _INT,
}
#: What the table reads of the runs' summaries (``_stats.describe``).
_SUMMARY_TYPES = {"test": {"mean": _NUMBER, "std": _STD, "ci": _CI}, "steps": {"mean": _NUMBER}}
#: Checked where present: the report reads the sweep with defaults (files from before a field).
_SWEEP_TYPES = {"lrs": _NUMBERS, "chosen_lr": _RATE, "runs": _LIST}
_RUN_TYPES = {
    "seed": _INT,
    "diverged": _BOOL,
    "test_metric": _NUMBER,
    "stop_reason": _STR,
    "steps": _INT,
    "steps_to_threshold": _STEPS_TO,
    "loss_spikes": _INT,
    "curve": _OBJECT,
}
_CURVE_TYPES = {
    "step": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of ints"),
    "val_metric": _NUMBERS,
    "test_metric": _NUMBERS,
    "train_time_s": _NUMBERS,
}


def _at(where: str, key: str | int) -> str:
    return f"{where}[{key!r}]" if where else str(key)


def _bad_value(path: Path, where: str, value: Any, expected: str) -> IncompleteJsonObject:
    return IncompleteJsonObject(
        path, f"holds {where}={_shown(value)} (a JSON {_json_type(value)}), expected {expected}"
    )


def _check_types(
    path: Path,
    obj: dict[str, Any],
    fields: tuple[str, ...],
    types: Mapping[str, _Rule],
    where: str,
) -> None:
    _require_at(path, obj, fields, where)
    for key, (ok, expected) in types.items():
        if key in obj and not ok(obj[key]):
            raise _bad_value(path, _at(where, key), obj[key], expected)


def _check_metrics(path: Path, results: dict[str, Any], name: str, variant: dict[str, Any]) -> None:
    """Refuse metric values the writer cannot produce; it does write NaN (and, for bits per char,
    inf) where a run diverged, so those are kept there.

    A run's ``test_metric`` is math.nan only when no evaluation had a finite validation loss, and
    such a run stops as diverged; otherwise it is the test metric at the best evaluation: an
    accuracy is then a fraction in [0, 1] (the bits per char of a loss that overflowed on the test
    set alone may be inf or NaN, so they are not bounded). A summary (``describe``) of the runs'
    values is finite exactly when every value is: a hand-edited NaN there printed "nan +- nan", exit 0.
    """
    where = f"variants[{name!r}]"
    if results["metric"] == "accuracy":
        for i, run in enumerate(variant["runs"]):
            value = run["test_metric"]
            if math.isnan(value) and run["diverged"]:
                continue
            if not 0 <= value <= 1:
                expected = "an accuracy in [0, 1]" + ("" if run["diverged"] else " (NaN only in a diverged run)")
                raise _bad_value(path, f"{where}['runs'][{i}]['test_metric']", value, expected)
    if not variant["runs"]:
        return
    for summary, field in (("test", "test_metric"), ("steps", "steps")):
        values = [run[field] for run in variant["runs"]]
        finite = all(math.isfinite(v) for v in values)
        stats = variant[summary]
        for key in _SUMMARY_TYPES[summary]:
            for i, v in enumerate(stats[key] if key == "ci" and stats[key] is not None else [stats[key]]):
                if v is None or math.isfinite(v) == finite:
                    continue
                at = f"{where}[{summary!r}][{key!r}]" + (f"[{i}]" if key == "ci" else "")
                expected = (
                    f"a finite number: every run's {field} is finite"
                    if finite
                    else f"a non-finite number, as some run's {field} is (the summary propagates NaN and inf)"
                )
                raise _bad_value(path, at, v, expected)


def check_results_object(path: str | Path, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj``, a task's results file or a cost file (``kind == "cost"``) read from ``path``, if it
    holds every field the commands read (``RESULTS_*_FIELDS``, ``COST_*_FIELDS``) and a cost file's
    round times are positive finite numbers wherever it states a time ratio (a clock that could not
    time the steps writes zero rounds and no ratio: the report says n/a); ``IncompleteJsonObject``
    naming the file, the field and where it is missing otherwise (``lacks test at variants['mha']``).
    A results file's fields must also be of the JSON type the writer gives them and its metrics
    values the writer can produce (``_check_metrics``): ``IncompleteJsonObject`` naming the field,
    the value and what was expected (``holds variants['mha']['runs'][0]['test_metric']='0.5' (a
    JSON string), expected a number``)."""
    path = Path(path)
    if obj.get("kind") == "cost":
        _require_at(path, obj, COST_FILE_FIELDS, "")
        _require_at(path, obj["variants"], (), "variants")
        for name, entry in obj["variants"].items():
            where = f"variants[{name!r}]"
            _require_at(path, entry, COST_VARIANT_FIELDS, where)
            if entry["time_ratio_vs_mha"] is None:
                continue  # a clock that could not time the steps: its zero rounds are said as n/a
            for key in ("round_s_per_step", "mha_round_s_per_step"):
                if key not in entry:  # mha_round_s_per_step: only in a file merged from several measurements
                    continue
                rounds = entry[key]
                if not isinstance(rounds, list) or not rounds:
                    raise IncompleteJsonObject(path, f"holds {where}[{key!r}]={rounds!r}, expected a list")
                for i, value in enumerate(rounds):
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                        raise IncompleteJsonObject(
                            path, f"holds {where}[{key!r}][{i}]={value!r}, expected a time > 0 in seconds"
                        )
        return obj
    _check_types(path, obj, RESULTS_FILE_FIELDS, _RESULTS_TYPES, "")
    _check_types(path, obj["config"], RESULTS_CONFIG_FIELDS, _CONFIG_TYPES, "config")
    for name, variant in obj["variants"].items():
        where = f"variants[{name!r}]"
        _check_types(path, variant, RESULTS_VARIANT_FIELDS, _VARIANT_TYPES, where)
        for summary, types in _SUMMARY_TYPES.items():
            _check_types(path, variant[summary], tuple(types), types, f"{where}[{summary!r}]")
        _check_types(path, variant["lr_sweep"], (), _SWEEP_TYPES, f"{where}['lr_sweep']")
        for i, run in enumerate(variant["runs"]):
            _check_types(path, run, RESULTS_RUN_FIELDS, _RUN_TYPES, f"{where}['runs'][{i}]")
            _check_types(path, run["curve"], RESULTS_CURVE_FIELDS, _CURVE_TYPES, f"{where}['runs'][{i}]['curve']")
        _check_metrics(path, obj, name, variant)
    return obj
