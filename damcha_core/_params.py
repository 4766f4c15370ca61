"""Canonical parameters: initialisation and validation.

Initialisers (every backend draws from the same distributions; the values
differ per framework RNG, the reference's are fixed by ``seed``):

=====================================  =========================================
parameter                              distribution
=====================================  =========================================
query/key/value ``.kernel`` (E,S,d)    Glorot uniform, fan_in=E, fan_out=S*d
output ``.kernel`` (H,d_v,E_o)         Glorot uniform, fan_in=H*d_v, fan_out=E_o
every projection ``.bias``             zeros
``metric.SIDE.gate`` (S,)              zeros: a fresh layer is exactly MHA
heads ``metric.SIDE.kernel`` (E,S,S)   normal, std 1/sqrt(E*S)
heads ``metric.SIDE.bias`` (S,S)       zeros
lowrank ``metric.SIDE.kernel`` (E,r)   normal, std 1/sqrt(E)
lowrank ``metric.SIDE.bias`` (r,)      zeros
lowrank ``metric.SIDE.u`` (S,d,r)      normal, std 1/sqrt(r)
lowrank ``metric.SIDE.v`` (S,d,r)      normal, std 1/sqrt(S*d)
=====================================  =========================================

The metric rows are ``damcha_core.METRIC_STRUCTURES`` (damcha_core._metrics),
the one table every port reads. The generator kernels are random, not zero, because gate = 0 *and* kernel = 0
would be a saddle: neither would receive a gradient. The stds make phi(t)·W
entries O(1/sqrt(S)) so that Delta(t) y has the scale of y once the gate opens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._config import DamchaConfig
from ._errors import DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._metrics import structure
from ._policy import check_config
from ._validators import check_seed


def is_real_float(dtype: Any) -> bool:
    """Whether ``dtype`` is a real floating dtype: float16/32/64 or bfloat16, a
    NumPy dtype or a framework's (``torch.float32``, ``jnp.bfloat16``). Not
    in ``__all__``; the conformance runner judges the ports' outputs with it."""
    # TensorFlow's DType names its NumPy type (np.dtype(tf.float32) raises, and its
    # text is "<dtype: 'float32'>"): a float32 tf.Tensor was refused as not a float.
    dtype = getattr(dtype, "as_numpy_dtype", dtype)
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # a framework dtype NumPy does not know, e.g. torch.float32
        return str(dtype).rsplit(".", 1)[-1] in ("float16", "float32", "float64", "bfloat16", "half", "float", "double")
    # ml_dtypes' bfloat16 is not an np.floating subtype, but it is a real float.
    return bool(np.issubdtype(dtype, np.floating)) or dtype.name == "bfloat16"


def check_no_config_kwargs(kwargs: Mapping[str, Any], from_config: Iterable[str]) -> None:
    """Refuse a ``from_canonical``/``load`` keyword that the config already sets (``key_dim=2``:
    Python's bare "got multiple values" TypeError, or "unexpected keyword")."""
    clash = sorted(set(kwargs) & set(from_config))
    if clash:
        raise DamchaTypeError(
            invalid_argument(
                clash[0],
                "no keyword the config sets (the params' config fixes it; change the config instead)",
                ", ".join(f"{k}={describe(kwargs[k])}" for k in clash),
            )
        )


def detached(params: Any) -> Any:
    """``params`` with each framework tensor that tracks gradients detached (a mapping is read once;
    anything else is returned as it is): what a load or a save copies is the values, and torch's
    port loads such tensors (under ``no_grad``), so every port's ``load_canonical`` does."""
    if not isinstance(params, Mapping):
        return params
    return {
        name: value.detach()
        if getattr(value, "requires_grad", False) and callable(getattr(value, "detach", None))
        else value
        for name, value in params.items()
    }


def as_numpy(value: Any, argument: str) -> np.ndarray:
    """``np.asarray(value)``, with a clear error for tensors NumPy cannot read.

    A torch bfloat16 tensor (no NumPy dtype) is widened to float32, which holds
    every bfloat16 value exactly. A tensor that requires grad or lives on a GPU
    raises a ``DamchaTypeError`` naming ``argument`` instead of torch's bare
    RuntimeError/TypeError.
    """
    try:
        return np.asarray(value)
    except (TypeError, RuntimeError, ValueError) as exc:
        failure = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        if str(getattr(value, "dtype", "")).endswith("bfloat16") and callable(getattr(value, "float", None)):
            try:
                return np.asarray(value.float())
            except (TypeError, RuntimeError, ValueError) as again:
                failure = f"{type(again).__name__}: {' '.join(str(again).split())}"
    raise DamchaTypeError(
        invalid_argument(
            argument,
            "an array NumPy can read (a torch tensor that requires grad or is on a GPU needs .detach().cpu())",
            f"{argument}={describe(value)} ({failure})",
        )
    )


def _glorot(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, fan_out: int) -> np.ndarray:
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape)


def init_params(config: DamchaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh float64 parameters with canonical names; gates are 0 (exactly MHA).

    Args:
        config: the layer's ``DamchaConfig``.
        seed: seed of the NumPy generator, an int >= 0; tensors are drawn in
            canonical order.

    Returns:
        A dict ``name -> np.ndarray`` with the shapes of ``config.param_shapes()``.
    """
    check_config(config)
    seed = check_seed("seed", seed, optional=False)
    rng = np.random.default_rng(seed)
    # The metric leaves' initialisers come from the metric table; tensors are
    # drawn in canonical order, so the values depend on the seed alone.
    metric_stds: dict[str, float] = {}
    for side in config.metric_sides:
        stds = structure(config.metric).stds(
            config.side_features(side), config.side_heads(side), config.key_dim, config.metric_rank
        )
        metric_stds.update({f"metric.{side}.{leaf}": std for leaf, std in stds.items()})
    params: dict[str, np.ndarray] = {}
    for name, shape in config.param_shapes().items():
        group, leaf = name.rsplit(".", 1)
        if name in metric_stds:
            std = metric_stds[name]
            value = rng.normal(0.0, std, size=shape) if std else np.zeros(shape)
        elif leaf == "bias":
            value = np.zeros(shape)
        elif group == "output":
            H, d_v, E_o = shape
            value = _glorot(rng, shape, H * d_v, E_o)
        else:
            E, S, d = shape
            value = _glorot(rng, shape, E, S * d)
        params[name] = value
    return params


def check_params(params: Mapping[str, Any], config: DamchaConfig, *, argument: str = "params") -> None:
    """Check names, shapes and dtypes against ``config`` without reading values.

    Works on any array type with ``.shape`` and ``.dtype`` (NumPy, torch, JAX
    tracers under ``jit``), so ports share the reference's rules and messages.
    ``config`` is a ``DamchaConfig`` or any config with a ``param_shapes()``
    mapping of name -> shape (e.g. a stack's), held to the same rules.

    Raises:
        DamchaTypeError: ``params`` is not a mapping, or a tensor is not a real
            floating array.
        DamchaValueError: a name is missing or unexpected, or a shape is wrong.
    """
    if not isinstance(config, DamchaConfig) and not callable(getattr(config, "param_shapes", None)):
        raise DamchaTypeError(
            invalid_argument("config", "a DamchaConfig (or a config with param_shapes())", f"config={describe(config)}")
        )
    if not isinstance(params, Mapping):
        raise DamchaTypeError(
            invalid_argument(argument, "a mapping of name -> array", f"{argument}={describe(params)}")
        )
    expected = config.param_shapes()
    missing = [n for n in expected if n not in params]
    extra = sorted(n for n in params if n not in expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {extra}")
        raise DamchaValueError(
            invalid_argument(
                argument,
                f"exactly the config's parameter names {list(expected)}",
                f"{argument} with {'; '.join(parts)} names",
            )
        )
    for name, shape in expected.items():
        value = params[name]
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            value = as_numpy(value, f"{argument}[{name!r}]")  # a ragged list: a DamchaTypeError, not ValueError
        if not is_real_float(value.dtype):
            raise DamchaTypeError(
                invalid_argument(
                    f"{argument}[{name!r}]", "a real floating array", f"{argument}[{name!r}]={describe(value)}"
                )
            )
        if tuple(value.shape) != shape:
            raise DamchaValueError(
                invalid_argument(
                    f"{argument}[{name!r}]",
                    f"shape {shape} for this config",
                    f"{argument}[{name!r}].shape={tuple(value.shape)}",
                )
            )


def validate_params(
    params: Mapping[str, Any], config: DamchaConfig, *, argument: str = "params"
) -> dict[str, np.ndarray]:
    """``check_params``, then finiteness; returns float64 NumPy copies.

    Raises:
        DamchaTypeError, DamchaValueError: as ``check_params``; also
            DamchaValueError when a value is NaN or infinite.
    """
    return _checked_params(params, config, argument, keep=True)


def check_params_finite(
    params: Mapping[str, Any], config: DamchaConfig, *, argument: str = "params"
) -> dict[str, np.ndarray]:
    """``validate_params``' checks without its float64 copies, for callers that
    only refuse bad params (saving, loading) or cast them themselves (the ONNX
    exporter): a float64 copy of every tensor at once is twice a float32
    layer's memory, here one tensor's at a time. Returns each value as the
    NumPy array that was checked, in its own dtype (no copy of a NumPy array),
    so a caller never reads a value twice."""
    return _checked_params(params, config, argument, keep=False)


def _checked_params(
    params: Mapping[str, Any], config: DamchaConfig, argument: str, *, keep: bool
) -> dict[str, np.ndarray]:
    """The checks of ``validate_params``; returns float64 copies (``keep``) or the checked arrays as they are."""
    if isinstance(params, Mapping):
        # One read per value: a mapping that answers a second read differently
        # (lazy or mutating) must not get a value past the checks below.
        params = dict(params)
    check_params(params, config, argument=argument)
    out: dict[str, np.ndarray] = {}
    for name in config.param_shapes():
        native = as_numpy(params[name], f"{argument}[{name!r}]")
        array = native.astype(np.float64)
        finite = np.isfinite(array)
        if not np.all(finite):
            raise DamchaValueError(
                invalid_argument(
                    f"{argument}[{name!r}]",
                    "finite values (no NaN or inf)",
                    f"{int(np.sum(np.isnan(array)))} NaN and {int(np.sum(np.isinf(array)))} inf of {array.size} "
                    f"entries, shape={array.shape}",
                )
            )
        out[name] = array if keep else native
    return out


def _overflow_threshold(max_value: float) -> float:
    """The smallest magnitude that rounds to inf in a binary float format whose
    largest finite value is ``max_value``: max + half an ulp. The format's max
    is (2 - ulp) * 2**e, and the tie rounds to inf (max's last bit is odd), so
    a value fits iff its magnitude is below this; float16: 65520, not 65504."""
    _, exponent = math.frexp(max_value)  # max_value = m * 2**exponent, 0.5 <= m < 1
    return max_value / 2 + math.ldexp(1.0, exponent - 1)


def check_params_fit(params: Mapping[str, Any], dtype_name: str, max_value: float, *, argument: str = "params") -> None:
    """Refuse params that round to inf in a narrower dtype they are cast to.

    ``validate_params`` checks finiteness in float64; a finite 1e6 still
    becomes inf in float16 (max 65504), and the layer would hold inf and
    compute NaN. Each port calls this with its target dtype's largest finite
    value (``torch.finfo``, ``jnp.finfo``, ``np.finfo``, ``ml_dtypes.finfo``).

    A value fits iff it rounds to a finite number: float16 keeps 65519.99 (it
    rounds to 65504) and makes 65520 inf. The rounding is the ports' own:
    torch's and ml_dtypes' float64 -> float16/bfloat16 casts round through
    float32, so a value is judged once rounded to float32, and every port keeps
    or refuses the same params (NumPy's direct cast would also keep the values
    within half a float32 ulp below the threshold, e.g. 65519.999, that torch
    makes inf). A float64 target keeps every finite value.

    Raises:
        DamchaValueError: naming the tensor, its max |value| and the dtype's limits.
    """
    if max_value >= np.finfo(np.float64).max:
        return
    threshold = _overflow_threshold(max_value)
    for name, value in params.items():
        array = np.abs(np.asarray(value, dtype=np.float64))
        largest = float(array.max()) if array.size else 0.0
        with np.errstate(over="ignore"):  # past float32's range is inf, which is refused
            rounded = float(np.float32(largest))
        if rounded >= threshold:
            raise DamchaValueError(
                invalid_argument(
                    f"{argument}[{name!r}]",
                    f"values that round to a finite {dtype_name} (max {max_value:g}; a magnitude of "
                    f"{threshold:.7g} or more, once rounded to float32 as the ports cast, becomes inf)",
                    f"max |value| = {largest!r}",
                )
            )
