"""Canonical parameter I/O of ``DamchaAttention``: the weights under
``damcha_core``'s names and shapes, so they move between every port.

The layer's methods (``to_canonical``, ``load_canonical``, ``from_canonical``,
``save``, ``load``) call these functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

import keras

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe

if TYPE_CHECKING:
    from ._layer import DamchaAttention


def require_built(layer: "DamchaAttention", what: str) -> None:
    if not layer.built or layer.config is None:
        raise DamchaValueError(f"`{what}` needs a built layer; call it on data or use from_canonical first. "
                               f"Received: an unbuilt layer {layer.name!r}")


def _check_plain(layer: "DamchaAttention", what: str) -> None:
    """Canonical weights exist for float projections of DAMCHA v1's form only."""
    if getattr(layer, "_use_gate", False):
        raise DamchaValueError(
            f"`{what}` is not available with use_gate=True: MHA's gate projection is not part of DAMCHA "
            f"v1's canonical form. Received: layer {layer.name!r} with use_gate=True"
        )
    for dense in layer._projections().values():
        if dense.quantization_mode is not None:
            raise DamchaValueError(
                f"`{what}` needs float projections; sublayer {dense.name!r} is quantized "
                f"({dense.quantization_mode}). Take canonical weights before quantize(). "
                f"Received: layer {layer.name!r}"
            )


def canonical_variables(layer: "DamchaAttention") -> dict[str, Any]:
    """Canonical name -> ``keras.Variable``, in canonical order (a shared
    generator's variable appears once per name). The output kernel and bias
    keep the layer's ``output_shape`` ((H, d_v, *output_shape) and
    (*output_shape,)); everything else has its canonical shape."""
    require_built(layer, "canonical_variables")
    _check_plain(layer, "canonical_variables")
    config = layer.config
    out: dict[str, Any] = {}
    for name, dense in layer._projections().items():
        if dense.lora_enabled:
            raise DamchaValueError(
                f"`canonical_variables` cannot give one variable per weight while LoRA is enabled on {dense.name!r} "
                "(its kernel is a sum). Use to_canonical (merged weights) or disable LoRA. "
                f"Received: layer {layer.name!r}"
            )
        out[f"{name}.kernel"] = dense.kernel
        if config.use_bias:
            out[f"{name}.bias"] = dense.bias
    for side, generator in layer.metric_generators.items():
        out[f"metric.{side}.gate"] = layer.metric_gates[side]
        for leaf in generator.leaf_names():
            out[f"metric.{side}.{leaf}"] = getattr(generator, leaf)
    return {name: out[name] for name in config.param_shapes()}


def to_canonical(layer: "DamchaAttention") -> dict[str, np.ndarray]:
    """The weights as canonical NumPy arrays (in the variables' dtype); LoRA
    updates are merged into their kernels."""
    require_built(layer, "to_canonical")
    _check_plain(layer, "to_canonical")
    config = layer.config
    shapes = config.param_shapes()
    out: dict[str, Any] = {}
    for name, dense in layer._projections().items():
        out[f"{name}.kernel"] = dense.kernel  # the merged kernel when LoRA is on
        if config.use_bias:
            out[f"{name}.bias"] = dense.bias
    for side, generator in layer.metric_generators.items():
        out[f"metric.{side}.gate"] = layer.metric_gates[side]
        for leaf in generator.leaf_names():
            out[f"metric.{side}.{leaf}"] = getattr(generator, leaf)
    return {name: np.asarray(keras.ops.convert_to_numpy(out[name])).reshape(shapes[name]) for name in shapes}


def load_canonical(layer: "DamchaAttention", params: Mapping[str, Any]) -> None:
    """Assign canonical params, validated against ``layer.config``."""
    require_built(layer, "load_canonical")
    checked = dc.validate_params(params, layer.config)
    for name, variable in canonical_variables(layer).items():
        value = checked[name].reshape(tuple(variable.shape))
        variable.assign(value.astype(keras.backend.standardize_dtype(variable.dtype)))


def from_canonical(cls: type, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> "DamchaAttention":
    """A built ``cls`` holding ``params`` for ``config``."""
    if not isinstance(config, DamchaConfig):
        raise DamchaTypeError(f"`config` must be a DamchaConfig. Received: config={describe(config)}")
    dc.validate_params(params, config)
    layer = cls(
        num_heads=config.num_heads, key_dim=config.key_dim, value_dim=config.value_dim,
        dropout=config.dropout, use_bias=config.use_bias, output_shape=config.output_dim,
        metric=config.metric, metric_rank=config.metric_rank, coupling=config.coupling,
        num_kv_heads=config.num_kv_heads, scale=config.scale, **kwargs,
    )
    # Zeros skip the random draws (slow to compile per shape on JAX): the
    # params overwrite every variable right after.
    layer._zero_init = True
    layer.build((None, None, config.query_dim), (None, None, config.context_dim))
    layer._zero_init = False
    load_canonical(layer, params)
    return layer


def save(layer: "DamchaAttention", path: str) -> None:
    """Weights and config as DAMCHA safetensors (``damcha_core.save_params``)."""
    require_built(layer, "save")
    dc.save_params(path, to_canonical(layer), layer.config)


def load(cls: type, path: str, **kwargs: Any) -> "DamchaAttention":
    """``from_canonical`` on a DAMCHA safetensors file."""
    params, config = dc.load_params(path)
    return from_canonical(cls, params, config, **kwargs)
