"""Reading one JSON object from a file: the one parser of every results, cost and run file.

The outcomes are told apart so that each caller keeps its own policy (a damaged results file
ends the command naming it; a damaged run ``result.json`` is an unfinished run, resumed):

- no such file: ``None``;
- the system cannot read it (permissions, I/O error): ``UnreadableJsonFile``;
- its bytes are no JSON text (not UTF-8, empty, cut off mid-write): ``InvalidJsonFile``;
- valid JSON, but not an object (a file of another kind): ``NotAJsonObject``;
- an object without a field its kind of file always holds (``require_fields``, e.g. a run's
  ``result.json`` and ``RESULT_FIELDS``): ``IncompleteJsonObject``.

All four are ``JsonFileError`` (a ``DamchaValueError``) whose message starts with the path.
"""

from __future__ import annotations

import json
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
            path, f"holds {where or 'its top level'} as a JSON {type(obj).__name__}, expected an object"
        )
    missing = [k for k in fields if k not in obj]
    if missing:
        at = f" at {where}" if where else ""
        raise IncompleteJsonObject(path, f"lacks {', '.join(missing)}{at}")


def check_results_object(path: str | Path, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj``, a task's results file or a cost file (``kind == "cost"``) read from ``path``, if it
    holds every field the commands read (``RESULTS_*_FIELDS``, ``COST_*_FIELDS``) and a cost file's
    round times are positive finite numbers wherever it states a time ratio (a clock that could not
    time the steps writes zero rounds and no ratio: the report says n/a); ``IncompleteJsonObject``
    naming the file, the field and where it is missing otherwise (``lacks test at variants['mha']``)."""
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
    _require_at(path, obj, RESULTS_FILE_FIELDS, "")
    _require_at(path, obj["config"], RESULTS_CONFIG_FIELDS, "config")
    _require_at(path, obj["variants"], (), "variants")
    for name, variant in obj["variants"].items():
        where = f"variants[{name!r}]"
        _require_at(path, variant, RESULTS_VARIANT_FIELDS, where)
        if not isinstance(variant["runs"], list):
            raise IncompleteJsonObject(
                path, f"holds {where}['runs'] as a JSON {type(variant['runs']).__name__}, expected a list"
            )
        for i, run in enumerate(variant["runs"]):
            _require_at(path, run, RESULTS_RUN_FIELDS, f"{where}['runs'][{i}]")
            _require_at(path, run["curve"], RESULTS_CURVE_FIELDS, f"{where}['runs'][{i}]['curve']")
    return obj
