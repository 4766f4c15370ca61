"""Conversions between DAMCHA and standard multi-head attention parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._config import DamchaConfig
from ._errors import DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._params import init_params, validate_params
from ._reference import dense_map, side_of

PROJECTIONS = ("query", "key", "value", "output")


def projection_names(config: DamchaConfig) -> list[str]:
    """The canonical names of the four projections' tensors (the MHA part)."""
    return [n for n in config.param_shapes() if n.split(".")[0] in PROJECTIONS]


def params_from_mha(weights: Mapping[str, Any], config: DamchaConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """DAMCHA parameters whose outputs equal the given MHA's.

    Args:
        weights: the MHA projections in canonical layout: ``query.kernel``
            (E_q, H, d), ``key.kernel``, ``value.kernel``, ``output.kernel``
            (H, d_v, E_o) and, with ``config.use_bias``, the four biases.
        config: the DAMCHA layer to build; its projection shapes must match.
        seed: seed for the metric generator's initial weights.

    Returns:
        float64 params: the given projections, a freshly initialised generator
        and gates at 0, so ``damcha_attention`` equals the MHA exactly.
    """
    if not isinstance(weights, Mapping):
        raise DamchaTypeError(invalid_argument("weights", "a mapping of name -> array", f"weights={describe(weights)}"))
    params = init_params(config, seed)
    names = projection_names(config)
    metric_keys = sorted(n for n in weights if n.startswith("metric."))
    if metric_keys:
        raise DamchaValueError(
            invalid_argument(
                "weights", f"only the MHA projections {names}", f"weights with metric tensors {metric_keys}"
            )
        )
    checked = validate_params(
        {**{k: v for k, v in params.items() if k not in names}, **weights}, config, argument="weights"
    )
    params.update({n: checked[n] for n in names})
    return params


def fold_static_metric(params: Mapping[str, Any], config: DamchaConfig) -> tuple[dict[str, np.ndarray], DamchaConfig]:
    """Fold a static cross-head map into the query/key kernels.

    When every generator kernel is 0, L is the same for all tokens, so
    q~ = L (x W_q + b_q) = x (W_q L^T) + L b_q: plain MHA with new kernels.

    Returns:
        ``(mha_params, mha_config)`` with ``mha_config.metric == "none"`` and
        outputs equal to DAMCHA's.

    Raises:
        DamchaValueError: a generator kernel is not exactly 0 (the map then
            depends on the token and cannot be folded).
    """
    p = validate_params(params, config)
    for side in config.metric_sides:
        kernel = p[f"metric.{side}.kernel"]
        if np.any(kernel != 0):
            raise DamchaValueError(
                invalid_argument(
                    f"params['metric.{side}.kernel']",
                    "all zeros for a static, foldable metric",
                    f"max |value| = {np.max(np.abs(kernel)):.3g}",
                )
            )
    out = {n: p[n] for n in projection_names(config)}
    for role, name in (("q", "query"), ("k", "key")):
        adapted = side_of(config, role)
        if adapted is None:
            continue
        # Any token gives the same map: the generator sees it only through the zero kernel.
        token = np.ones((1, 1, config.side_features(adapted)))
        L = dense_map(p, config, adapted, token)[0, 0]  # (S, d, S, d)
        out[f"{name}.kernel"] = np.einsum("hiaj,eaj->ehi", L, p[f"{name}.kernel"])
        if config.use_bias:
            out[f"{name}.bias"] = np.einsum("hiaj,aj->hi", L, p[f"{name}.bias"])
    return out, config.replace(metric="none", metric_rank=None)
