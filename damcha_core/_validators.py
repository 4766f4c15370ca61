"""Single-field validators and the rules of DamchaConfig's fields, written once.

Every validator takes the *display name* of the argument (the port's own name,
e.g. ``embed_dim`` in PyTorch), so its message names what the caller passed and
no message is ever rewritten afterwards. ``damcha_core._policy`` re-exports the
public ones; ``DamchaConfig`` and every port call these same functions.
"""

from __future__ import annotations

import contextvars
import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any, Literal, overload

import numpy as np

from ._errors import DamchaNotIntegerError, DamchaTypeError, DamchaValueError, describe, invalid_argument

METRICS = ("heads", "lowrank", "none")
COUPLINGS = ("tied", "separate", "query")
# What a caller may pass for `coupling`: a stored coupling, or "auto"/None (resolved at once).
COUPLING_CHOICES = (*COUPLINGS, "auto")

# The port's argument names for the DamchaConfig being built in this context
# (set by make_config, read by DamchaConfig.__post_init__). A ContextVar, not
# a global: concurrent threads and tasks each see their own value.
CONFIG_NAMES: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "damcha_config_names", default=None
)


def check_names(names: Any) -> dict[str, str]:
    """``names`` as a plain dict (``{}`` for None); a mapping of str -> str."""
    if names is None:
        return {}
    if not isinstance(names, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise DamchaTypeError(
            invalid_argument(
                "names",
                "a mapping of canonical name -> the port's argument name (str -> str) or None",
                f"names={describe(names)}",
            )
        )
    return dict(names)


def unknown_fields(unknown: list[str], fields: Any, expected: str = "DamchaConfig fields", noun: str = "field") -> str:
    """The message for keyword arguments a callee does not take: DamchaConfig fields by default,
    or ``expected`` (e.g. "the arguments from_mha takes") with ``noun`` ("keyword argument")."""
    listed = ", ".join(f"`{name}`" for name in unknown)
    plural = "s" if len(unknown) > 1 else ""
    return (
        f"Invalid argument{plural} {listed}: expected {expected}, a subset of {list(fields)}. "
        f"Received: unknown {noun}{plural} {unknown}"
    )


def display(names: Mapping[str, str] | None, canonical: str) -> str:
    """The name the caller knows for canonical argument ``canonical``."""
    return names.get(canonical, canonical) if names else canonical


# ------------------------------------------------------------------ validators


@overload
def check_int(name: str, value: Any, *, minimum: int = 1, optional: Literal[False] = False) -> int: ...
@overload
def check_int(name: str, value: Any, *, minimum: int = 1, optional: bool) -> int | None: ...
def check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> int | None:
    """An int (NumPy ints too, never a bool) >= ``minimum``; ``None`` passes when ``optional``.

    Raises:
        DamchaTypeError: not an int (or None when optional).
        DamchaValueError: below ``minimum``.
    """
    if value is None and optional:
        return None
    # One message for both failures: a user who passed 1.5 or 0 learns the whole rule at once.
    message = invalid_argument(
        name, f"an int >= {minimum}" + (" or None" if optional else ""), f"{name}={describe(value)}"
    )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        # A real number such as 1.5 or 8.0 is the right kind of thing with the wrong value for Keras
        # users (ValueError) and the wrong type for Python's (TypeError): the class is both.
        cls = (
            DamchaNotIntegerError
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            else DamchaTypeError
        )
        raise cls(message)
    if value < minimum:
        raise DamchaValueError(message)
    return int(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of the strings ``choices``.

    Raises:
        DamchaTypeError: not a string.
        DamchaValueError: a string that is not one of ``choices``.
    """
    message = invalid_argument(name, f"one of {choices}", f"{name}={describe(value)}")
    if not isinstance(value, str):
        raise DamchaTypeError(message)
    if value not in choices:
        raise DamchaValueError(message)
    return value


def check_real(name: str, value: Any) -> float:
    """A real number (int, float or NumPy scalar, never a bool), as a float.

    Raises:
        DamchaTypeError: not a real number.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise DamchaTypeError(invalid_argument(name, "a real number", f"{name}={describe(value)}"))
    return _as_float(value)


def _as_float(value: Any) -> float:
    """``float(value)``; an int beyond float's range (``10**400``) is +-inf, as the float it
    is closest to, where ``float`` raises a bare OverflowError: the callers' range rules
    (finite, in [0, 1)) then refuse it by name."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_bool(name: str, value: Any) -> bool:
    """A bool or a NumPy bool, as a Python bool.

    Raises:
        DamchaTypeError: anything else (0/1 ints included).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise DamchaTypeError(invalid_argument(name, "a bool", f"{name}={describe(value)}"))
    return bool(value)


def check_rate(name: str, value: Any) -> float:
    """A probability-like rate in [0, 1), e.g. a dropout rate.

    Raises:
        DamchaTypeError: not a real number.
        DamchaValueError: outside [0, 1) (NaN included).
    """
    rate = check_real(name, value)
    if not 0.0 <= rate < 1.0:
        raise DamchaValueError(invalid_argument(name, "a number in [0, 1)", f"{name}={describe(value)}"))
    return rate


@overload
def check_seed(name: str, value: Any, *, optional: Literal[False]) -> int: ...
@overload
def check_seed(name: str, value: Any, *, optional: bool = True) -> int | None: ...
def check_seed(name: str, value: Any, *, optional: bool = True) -> int | None:
    """A seed: an int >= 0, or ``None`` when ``optional``.

    Raises:
        DamchaTypeError: not an int (or None when optional).
        DamchaValueError: negative.
    """
    return check_int(name, value, minimum=0, optional=optional)


def check_finite_nonneg(name: str, value: Any) -> float:
    """A finite real number >= 0, e.g. a penalty coefficient.

    Raises:
        DamchaTypeError: not a real number.
        DamchaValueError: negative, NaN or infinite.
    """
    message = invalid_argument(name, "a finite number >= 0", f"{name}={describe(value)}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise DamchaTypeError(message)
    number = _as_float(value)
    if not (math.isfinite(number) and number >= 0):
        raise DamchaValueError(message)
    return number


def check_offset(name: str, value: Any) -> int:
    """A position offset (e.g. ``query_offset``): an int >= 0, never a bool.

    One class for every bad number, DamchaValueError (a float, a bool or a
    negative int alike): the JAX port, whose offset may be a traced array,
    raises this same error for the values it can inspect. What is no number
    at all (a string, None, a list) is a DamchaTypeError, as everywhere.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 0:
        message = invalid_argument(name, "an int >= 0", f"{name}={describe(value)}")
        if not isinstance(value, (numbers.Real, np.ndarray, np.generic)):
            raise DamchaTypeError(message)
        raise DamchaValueError(message)
    return int(value)


# ------------------------------------------------------------- config fields

CONFIG_FIELDS = (
    "query_dim",
    "num_heads",
    "key_dim",
    "value_dim",
    "num_kv_heads",
    "context_dim",
    "output_dim",
    "use_bias",
    "metric",
    "metric_rank",
    "coupling",
    "scale",
    "dropout",
    "value_input_dim",
)
REQUIRED_FIELDS = ("query_dim", "num_heads", "key_dim")
# Optional sizes and the field whose value they default to.
_SIZE_DEFAULTS = (
    ("value_dim", "key_dim"),
    ("num_kv_heads", "num_heads"),
    ("context_dim", "query_dim"),
    ("output_dim", "query_dim"),
    ("value_input_dim", "context_dim"),
)


def auto_coupling(
    num_heads: int, num_kv_heads: int, query_dim: int, context_dim: int, same_inputs: bool | None = None
) -> str:
    """What ``coupling="auto"`` means: "tied" when one generator can serve both
    sides (H == G, E_q == E_kv and the inputs are not known to differ), else
    "separate". The metric does not enter: with metric "none" the coupling is
    ignored, and this keeps ``replace(metric=...)`` valid and matches the value
    older versions stored by default for MHA-shaped layers."""
    tied = num_heads == num_kv_heads and query_dim == context_dim and same_inputs is not False
    return "tied" if tied else "separate"


def check_tied(
    names: Mapping[str, str] | None,
    num_heads: int | None,
    num_kv_heads: int | None,
    query_dim: int | None,
    context_dim: int | None,
) -> None:
    """The constraints of coupling "tied" (with a metric), for the sizes known."""
    n = functools.partial(display, names)
    coupling = n("coupling")
    if num_heads is not None and num_kv_heads is not None and num_kv_heads != num_heads:
        raise DamchaValueError(
            invalid_argument(
                coupling,
                f"'query' or 'separate' for GQA/MQA: {coupling}='tied' shares one cross-head map between "
                f"queries and keys, so it needs {n('num_kv_heads')} == {n('num_heads')}",
                f"{coupling}='tied', {n('num_heads')}={num_heads}, {n('num_kv_heads')}={num_kv_heads}",
            )
        )
    if query_dim is not None and context_dim is not None and context_dim != query_dim:
        raise DamchaValueError(
            invalid_argument(
                coupling,
                f"'separate' or 'query' for other context sizes: {coupling}='tied' feeds queries and keys to "
                f"one generator, so it needs {n('context_dim')} == {n('query_dim')}",
                f"{coupling}='tied', {n('query_dim')}={query_dim}, {n('context_dim')}={context_dim}",
            )
        )


_DEFAULTS = {
    "value_dim": None,
    "num_kv_heads": None,
    "context_dim": None,
    "output_dim": None,
    "use_bias": True,
    "metric": "heads",
    "metric_rank": None,
    "coupling": "auto",
    "scale": None,
    "dropout": 0.0,
    "value_input_dim": None,
}


def check_config_fields(
    fields: Mapping[str, Any],
    names: Mapping[str, str] | None = None,
    *,
    partial: bool = False,
    same_inputs: bool | None = None,
) -> dict[str, Any]:
    """Validate and normalise DamchaConfig fields; the one implementation of its rules.

    Args:
        fields: field name -> value; an absent field has its DamchaConfig
            default.
        names: canonical name -> the caller's argument name, for messages.
        partial: a lazily built layer that does not know its input sizes yet:
            an absent ``query_dim``, ``num_heads`` or ``key_dim`` is unknown
            (not an error), rules that need an unknown size are skipped, and
            only the given fields are returned.
        same_inputs: see ``resolve_coupling``.

    Returns:
        The fields, normalised: ints as int, optional sizes defaulted when
        what they default to is known, ``coupling`` resolved when the sizes
        it depends on are known (else ``"auto"``).
    """
    unknown = sorted(set(fields) - set(CONFIG_FIELDS))
    if unknown:
        raise DamchaTypeError(unknown_fields(unknown, CONFIG_FIELDS))
    n = functools.partial(display, names)
    values = {**_DEFAULTS, **fields}
    out: dict[str, Any] = {}
    for key in REQUIRED_FIELDS:
        known = key in fields or not partial
        out[key] = check_int(n(key), values.get(key)) if known else None
    for key, source in _SIZE_DEFAULTS:
        value = check_int(n(key), values[key], optional=True)
        out[key] = out[source] if value is None else value
    H, G = out["num_heads"], out["num_kv_heads"]
    if H is not None and G is not None and H % G:
        raise DamchaValueError(
            invalid_argument(
                n("num_heads"),
                f"a multiple of `{n('num_kv_heads')}` (each key/value head serves a whole group of query heads)",
                f"{n('num_heads')}={H}, {n('num_kv_heads')}={G}",
            )
        )
    out["use_bias"] = check_bool(n("use_bias"), values["use_bias"])
    metric = out["metric"] = check_choice(n("metric"), values["metric"], METRICS)
    coupling = (
        "auto" if values["coupling"] is None else check_choice(n("coupling"), values["coupling"], COUPLING_CHOICES)
    )
    rank = values["metric_rank"]
    if metric == "lowrank":
        if rank is None:
            raise DamchaValueError(
                invalid_argument(
                    n("metric_rank"),
                    f"an int >= 1 with {n('metric')}='lowrank' (it is required)",
                    f"{n('metric_rank')}=None",
                )
            )
        out["metric_rank"] = check_int(n("metric_rank"), rank)
    elif rank is not None:
        raise DamchaValueError(
            invalid_argument(
                n("metric_rank"),
                f"None with {n('metric')}={metric!r} (it is only used with {n('metric')}='lowrank')",
                f"{n('metric')}={metric!r}, {n('metric_rank')}={describe(rank)}",
            )
        )
    else:
        out["metric_rank"] = None
    E_q, E_kv = out["query_dim"], out["context_dim"]
    if coupling == "auto" and None not in (H, G, E_q, E_kv):
        coupling = auto_coupling(H, G, E_q, E_kv, same_inputs)
    elif coupling == "tied" and metric != "none":
        check_tied(names, H, G, E_q, E_kv)
    out["coupling"] = coupling
    scale = values["scale"]
    if scale is not None:
        scale = check_real(n("scale"), scale)
        if not (math.isfinite(scale) and scale > 0):
            raise DamchaValueError(invalid_argument(n("scale"), "a finite number > 0 or None", f"{n('scale')}={scale}"))
    out["scale"] = scale
    out["dropout"] = check_rate(n("dropout"), values["dropout"])
    return {k: out[k] for k in fields} if partial else out
