"""Conversion of a built ``keras.layers.MultiHeadAttention`` into ``DamchaAttention``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras

from damcha_core import DamchaTypeError, DamchaValueError, describe

if TYPE_CHECKING:
    from ._layer import DamchaAttention


def from_mha(cls: type, layer: keras.layers.MultiHeadAttention, **kwargs: Any) -> "DamchaAttention":
    """An exact conversion of ``layer``: its projections copied, a fresh metric
    generator and gates 0 (see ``DamchaAttention.from_mha``)."""
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise DamchaTypeError(f"`layer` must be a keras.layers.MultiHeadAttention. Received: layer={describe(layer)}")
    if not layer.built:
        raise DamchaValueError(f"`layer` must be built (call it once). Received: an unbuilt layer {layer.name!r}")
    mha = layer.get_config()
    for option, ok in (("use_gate", not mha.get("use_gate")), ("sliding_window", mha.get("sliding_window") is None),
                       ("attention_axes", tuple(layer.attention_axes or (1,)) == (1,))):
        if not ok:
            raise DamchaValueError(
                f"`layer` uses {option}={mha.get(option)!r}, which DamchaAttention does not support."
            )
    qk, kk, vk, ok_ = (d.kernel for d in (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense))
    if len(qk.shape) != 3 or len(ok_.shape) != 3:
        raise DamchaValueError(
            "`layer` must have rank-3 inputs and a 1-D output (kernels (E, H, d) and (H, d_v, E_o)). "
            f"Received: query kernel {tuple(qk.shape)}, output kernel {tuple(ok_.shape)}"
        )
    if kk.shape[0] != vk.shape[0]:
        raise DamchaValueError(
            "`layer` has different key and value feature sizes; DAMCHA has one context size. "
            f"Received: key kernel {tuple(kk.shape)}, value kernel {tuple(vk.shape)}"
        )
    options = dict(
        num_heads=mha["num_heads"], key_dim=mha["key_dim"], value_dim=mha["value_dim"],
        dropout=mha["dropout"], use_bias=mha["use_bias"], output_shape=int(ok_.shape[-1]),
        kernel_initializer=mha["kernel_initializer"], bias_initializer=mha["bias_initializer"],
        kernel_regularizer=mha["kernel_regularizer"], bias_regularizer=mha["bias_regularizer"],
        kernel_constraint=mha["kernel_constraint"], bias_constraint=mha["bias_constraint"],
        seed=mha["seed"], dtype=layer.dtype_policy,
    )
    options.update(kwargs)
    new = cls(**options)
    new.build((None, None, int(qk.shape[0])), (None, None, int(vk.shape[0])))
    for ours, theirs in ((new.query_dense, layer.query_dense), (new.key_dense, layer.key_dense),
                         (new.value_dense, layer.value_dense), (new.output_dense, layer.output_dense)):
        ours.kernel.assign(theirs.kernel)
        if new.use_bias:
            ours.bias.assign(theirs.bias)
    return new
