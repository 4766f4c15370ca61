"""Keras MultiHeadAttention's arguments as ``DamchaAttention`` takes them: the
constructor's arguments, the call flags, and the rules on input shapes.

Every rule that is not MHA-specific is damcha_core's shared argument policy,
called with Keras's argument names (``KERAS_NAMES``); what is here is MHA's own
reading (``output_shape``, ``attention_axes``, truthy call flags, rank > 3
inputs) and the checks that run once the feature sizes are known.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

import damcha_core as dc
import keras
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe
from keras import ops

from . import _functional as F
from . import _masks
from ._cache import FLOAT_DTYPES, static_shape
from ._functional import dtype_name
from ._generator import MetricGenerator

# Keras's names for the canonical arguments (damcha_core's shared policy messages).
KERAS_NAMES = {"output_dim": "output_shape", "context": "key", "value": "value", "mask": "attention_mask"}


# ------------------------------------------------------------ construction


def check_args(
    *, metric_l2: Any, seed: Any, sliding_window: Any, use_gate: Any, flash_attention: Any, **fields: Any
) -> dict[str, Any]:
    """The constructor's arguments, validated and normalised."""
    # The shared argument policy applies every rule that does not need the
    # feature sizes now, so a bad argument fails at construction, not at the
    # first call; the coupling is resolved at build.
    args = dc.check_layer_args(names=KERAS_NAMES, **fields)
    args["metric_l2"] = dc.check_finite_nonneg("metric_l2", metric_l2)
    args["seed"] = dc.check_seed("seed", seed)
    args["sliding_window"] = dc.check_int("sliding_window", sliding_window, optional=True)
    args["use_gate"] = dc.check_bool("use_gate", use_gate)
    if flash_attention is not None:
        dc.check_bool("flash_attention", flash_attention)
    return args


def check_generator_arg(given: Any, metric: str, coupling: str) -> Any:
    """The rules of ``metric_generator`` that need no feature size (the
    shared policy's: types, metric "none", the sides of an explicit
    coupling), now as in the other ports; the fit of each generator, and
    the sides of an automatic coupling, are checked at build."""
    dc.check_generator_arg(given, metric=metric, coupling=coupling, generator_type=MetricGenerator, names=KERAS_NAMES)
    return dict(given) if isinstance(given, Mapping) else given


def check_output_shape(output_shape: Any) -> tuple[int, ...] | None:
    """MHA's ``output_shape``: None (the query's feature size), an int, or a
    tuple/list of ints; falsy values mean None, as in MHA."""
    if output_shape is None or (isinstance(output_shape, (tuple, list)) and not output_shape):
        return None
    dims = output_shape if isinstance(output_shape, (tuple, list)) else (output_shape,)
    try:
        return tuple(dc.check_int("output_shape", s) for s in dims)
    except dc.DamchaError as err:
        # The core's rule and class (8.0: DamchaNotIntegerError, "8": DamchaTypeError, 0: DamchaValueError),
        # worded for the whole argument as Keras words it (its own tests match "Invalid `output_shape`").
        raise type(err)(
            "Invalid `output_shape`: expected an int >= 1, a tuple of ints >= 1 or None. "
            f"Received: output_shape={describe(output_shape)}"
        ) from None


def check_attention_axes(axes: Any) -> tuple[int, ...] | None:
    if axes is None:
        return None
    axes = (axes,) if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool) else axes
    if (
        not isinstance(axes, (tuple, list))
        or not axes
        or not all(isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_)) for a in axes)
    ):
        raise DamchaTypeError(
            dc.invalid_argument(
                "attention_axes", "an int, a non-empty list/tuple of ints, or None", f"attention_axes={describe(axes)}"
            )
        )
    return tuple(int(a) for a in axes)


# -------------------------------------------------------------------- call


# What a flag may be beside the Python/NumPy bools and ints, in the refusals.
_FLAG_EXPECTED = (
    "a bool (or an int / a concrete scalar tensor or array of a bool or integer dtype, read as truthy), "
    "known when the layer is called"
)


def _flag_scalar(value: Any) -> bool:
    """Whether ``value`` is a scalar tensor or array of a bool or integer dtype.

    The dtype is read, not only the shape: NumPy float scalars (np.float64 is a
    float subclass with a shape and a dtype) and 0-d float/str arrays would
    otherwise be read as truthy (np.float64(0.5): dropout on) where the Python
    float 0.5 is refused. The dtype is static, so this holds for traced values too."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return False
    try:
        shape, dtype = tuple(value.shape), keras.backend.standardize_dtype(value.dtype)
    except Exception:  # noqa: BLE001 - unknown rank, or a dtype Keras has no name for (str, object): not a flag
        return False
    return shape == () and (dtype == "bool" or dtype.startswith(("int", "uint")))


def _refuse_flag(name: str, value: Any, expected: str) -> DamchaTypeError:
    return DamchaTypeError(dc.invalid_argument(name, expected, f"{name}={describe(value)}"))


def flag(name: str, value: Any) -> bool:
    """A truthy call flag as Keras takes it: a Python or NumPy bool or int, or a
    concrete scalar tensor or array of a bool or integer dtype (Keras turns NumPy
    scalars into tensors before ``call``)."""
    if isinstance(value, (bool, int, np.bool_, np.integer)):
        return bool(value)
    if _flag_scalar(value):
        try:
            return bool(np.asarray(ops.convert_to_numpy(value)))
        except Exception:  # noqa: BLE001 - traced (each backend raises its own error type): the layer's structure cannot depend on it
            pass
    raise _refuse_flag(name, value, _FLAG_EXPECTED)


def training_flag(value: Any) -> Any:
    """``training`` as Keras passes it (None: not given and no outer layer's,
    else what the caller gave; fit/evaluate/predict give Python bools), read
    by the rule of the other call flags, except that a traced scalar of a bool
    or integer dtype is passed on as it is: Keras MHA takes one under
    tf.function when it has no dropout, so this layer does too. A string ("no"
    is truthy), a float (Python or NumPy, or a float tensor or array) or a
    non-scalar is refused instead of switching dropout on."""
    if value is None or isinstance(value, bool):  # what Keras itself passes: no other test on the hot path
        return value
    if isinstance(value, (int, np.bool_, np.integer)):
        return bool(value)
    if _flag_scalar(value):
        try:
            return bool(np.asarray(ops.convert_to_numpy(value)))
        except Exception:  # noqa: BLE001 - traced (each backend raises its own error type): passed on, see above
            return value
    raise _refuse_flag("training", value, f"None or {_FLAG_EXPECTED}")


# The call flags' positions in ``call`` (the attention layer's, the blocks').
ATTENTION_FLAGS = {"return_attention_scores": 7, "training": 8, "use_causal_mask": 9}
BLOCK_FLAGS = {"training": 3}


def check_numpy_flags(positions: Mapping[str, int], args: tuple, kwargs: Mapping[str, Any]) -> None:
    """The call flags given as NumPy scalars or arrays, checked before Keras's
    ``__call__`` turns them into tensors: the message then shows the value as
    given (np.float64(0.5) as 0.5, as the Python float is shown, not as the
    float32 tensor it becomes), and a str or object array gets this refusal
    rather than the backend's conversion error. ``call`` checks every flag
    again (tensors, Python values)."""
    for name, position in positions.items():
        value = kwargs[name] if name in kwargs else args[position] if position < len(args) else None
        if isinstance(value, (np.generic, np.ndarray)):
            if name == "training":
                training_flag(value)
            else:
                flag(name, value)


# ------------------------------------------------------------------ shapes


def resolve_axes(attention_axes: tuple[int, ...] | None, rank: int) -> tuple[int, ...]:
    """Attention axes as positive input axes in [1, rank - 2] (MHA's reading of negatives)."""
    if attention_axes is None:
        return tuple(range(1, rank - 1))
    axes = tuple(a if a >= 0 else rank + a for a in attention_axes)
    if any(not 1 <= a <= rank - 2 for a in axes) or len(set(axes)) != len(axes):
        raise DamchaValueError(
            dc.invalid_argument(
                "attention_axes",
                f"distinct axes of the inputs other than batch (0) and features (-1): in [1, {rank - 2}] or "
                f"[{1 - rank}, -2] for rank-{rank} inputs",
                f"attention_axes={attention_axes}",
            )
        )
    return tuple(sorted(axes))


def check_build_shapes(
    attention_axes: tuple[int, ...] | None, query_shape: tuple, value_shape: tuple, key_shape: tuple | None
) -> None:
    """MHA's rules on the shapes alone (``build`` and ``compute_output_shape``)."""
    query_shape, value_shape = tuple(query_shape), tuple(value_shape)
    key_shape = value_shape if key_shape is None else tuple(key_shape)
    # The batch axis too where both are known (Keras's MHA compares only the
    # others: on JAX and torch a key of batch 1 then broadcasts silently).
    batches_differ = None not in (value_shape[:1] + key_shape[:1]) and value_shape[:1] != key_shape[:1]
    if tuple(value_shape[1:-1]) != tuple(key_shape[1:-1]) or batches_differ:
        raise DamchaValueError(
            dc.invalid_argument(
                "key",
                "the shape of `value` but for the last (feature) axis (all other dims must be equal)",
                f"key.shape={key_shape}, value.shape={value_shape}",
            )
        )
    if len(query_shape) < 3:
        raise DamchaValueError(
            dc.invalid_argument("query", "rank >= 3, (batch, length, features)", f"query.shape={query_shape}")
        )
    if len(value_shape) != len(query_shape):
        raise DamchaValueError(
            dc.invalid_argument("value", "the rank of `query`", f"query.shape={query_shape}, value.shape={value_shape}")
        )
    for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
        if shape[-1] is None:
            raise DamchaValueError(
                dc.invalid_argument(name, "a known feature size (last axis)", f"{name}.shape={shape}")
            )
    rank = len(query_shape)
    batch_axes = F.Layout(rank, resolve_axes(attention_axes, rank)).batch_axes
    for a in (0, *batch_axes):
        if query_shape[a] is not None and value_shape[a] is not None and query_shape[a] != value_shape[a]:
            raise DamchaValueError(
                dc.invalid_argument(
                    "value",
                    f"the sizes of `query` on the batch and non-attended axes {(0, *batch_axes)} (they must be equal)",
                    f"query.shape={query_shape}, value.shape={value_shape}",
                )
            )


def check_inputs(
    config: DamchaConfig,
    layout: F.Layout,
    query: Any,
    value: Any,
    key: Any,
    masks: dict[str, Any],
    kv_len: int | None = None,
) -> None:
    """A call's inputs and masks against the built layer: dtypes, ranks,
    feature sizes, batch and non-attended axes, the shared shape rules, and
    the masks' shapes (with a cache, the key masks span its ``kv_len`` slots)."""
    for name, x in (("query", query), ("value", value), ("key", key)):
        if x is not None and dtype_name(x) not in FLOAT_DTYPES:
            raise dc.float_dtype_error(name, x)
    _masks.check_dtypes(masks)
    qs, vs = static_shape(query), static_shape(value)
    ks = vs if key is None else static_shape(key)
    if len(vs) != len(ks) or any(a is not None and b is not None and a != b for a, b in zip(vs[:-1], ks[:-1])):
        raise DamchaValueError(
            dc.invalid_argument(
                "key",
                "the shape of `value` but for the last (feature) axis (all other dims must be equal)",
                f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}",
            )
        )
    E_kv, E_v = dc.config_sizes(config)[:2]
    rank = layout.rank
    # The layer's own argument names (value, key), not damcha_core's (context).
    if key is None and E_kv != E_v:
        raise DamchaValueError(
            dc.invalid_argument(
                "key",
                f"a tensor: the layer was built with keys of {E_kv} features and values of {E_v}",
                f"key=None, value.shape={tuple(value.shape)}",
            )
        )
    for name, shape, features in (("query", qs, config.query_dim), ("value", vs, E_v), ("key", ks, E_kv)):
        if len(shape) != rank:
            raise DamchaValueError(
                dc.invalid_argument(
                    name,
                    f"rank {rank}, the rank the layer was built with{' (batch, length, features)' if rank == 3 else ''}",
                    f"{name}.shape={shape}",
                )
            )
        if shape[-1] is not None and shape[-1] != features:  # None: traced (e.g. torch ONNX export)
            raise DamchaValueError(
                dc.invalid_argument(
                    name, f"{features} features, the size the layer was built with", f"{name}.shape={shape}"
                )
            )
    for a in (0, *layout.batch_axes):
        if qs[a] is not None and vs[a] is not None and qs[a] != vs[a]:
            what = "batch size" if a == 0 else f"size on the non-attended axis {a}"
            raise DamchaValueError(
                dc.invalid_argument(
                    "value",
                    f"the {what} of `query` (they must be equal)",
                    f"query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}",
                )
            )
    # Unknown (symbolic) dims take the value the other tensors imply, so only
    # real contradictions are reported by the shared shape rules.
    B = next((s for s in (qs[0], vs[0]) if s is not None), 1)
    N, M = _size([qs[a] for a in layout.attention_axes]), _size([vs[a] for a in layout.attention_axes])
    n_, m_ = 1 if N is None else N, 1 if M is None else M
    # Without `key` the keys are `value`'s tokens: a refusal of no keys names it.
    names = KERAS_NAMES if key is not None else {**KERAS_NAMES, "context": "value"}
    dc.check_shapes(config, (B, n_, config.query_dim), (B, m_, E_kv), value_shape=(B, m_, E_v), names=names)
    if kv_len is not None:
        M = kv_len  # with a cache, masks span its L slots
    _masks.check_shapes(masks, layout, config.num_heads, query, value, N, M, kv_len)


def input_signature(query: Any, value: Any, key: Any, masks: dict[str, Any], kv_len: int | None) -> tuple | None:
    """What ``check_inputs`` reads of a call, as a hashable key: each tensor's
    shape and dtype (None for an absent one) and ``kv_len``; None when a dim
    is not a plain int (symbolic: no key, the call is checked as it is).

    ``check_inputs`` depends on nothing else once the layer is built, so a
    layer checks a signature once: a decoding loop's steps (one shape) are
    checked at the first step, not re-validated at every token."""
    parts: list[Any] = [kv_len]
    for x in (query, value, key, *masks.values()):
        if x is None:
            parts.append(None)
            continue
        shape = tuple(getattr(x, "shape", (None,)))
        if not all(type(d) is int for d in shape):
            return None
        parts.append((shape, x.dtype))
    return tuple(parts)


def _size(dims: list[int | None]) -> int | None:
    """The number of positions over ``dims``; None if one is unknown."""
    known = [s for s in dims if s is not None]
    return math.prod(known) if len(known) == len(dims) else None
