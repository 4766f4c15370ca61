"""Conversion of a built ``keras.layers.MultiHeadAttention`` (or
``GroupedQueryAttention``) into ``DamchaAttention``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

import keras
from damcha_core import DamchaTypeError, DamchaValueError, describe, invalid_argument

if TYPE_CHECKING:
    from ._layer import DamchaAttention


def _mha_options(layer: keras.layers.MultiHeadAttention) -> dict[str, Any]:
    mha = layer.get_config()
    return dict(
        num_heads=mha["num_heads"],
        key_dim=mha["key_dim"],
        value_dim=mha["value_dim"],
        dropout=mha["dropout"],
        use_bias=mha["use_bias"],
        output_shape=mha["output_shape"],
        attention_axes=mha["attention_axes"],
        sliding_window=mha.get("sliding_window"),
        use_gate=bool(mha.get("use_gate", False)),
        kernel_initializer=mha["kernel_initializer"],
        bias_initializer=mha["bias_initializer"],
        kernel_regularizer=mha["kernel_regularizer"],
        bias_regularizer=mha["bias_regularizer"],
        kernel_constraint=mha["kernel_constraint"],
        bias_constraint=mha["bias_constraint"],
        # MHA applies it to its four projections' outputs, DAMCHA to the layer's output (docs/keras.md):
        # not the same loss, but dropping it would lose the user's term altogether.
        activity_regularizer=mha.get("activity_regularizer"),
        seed=mha["seed"],
    )


def _gqa_options(layer: keras.layers.GroupQueryAttention) -> dict[str, Any]:
    gqa = layer.get_config()
    return dict(
        num_heads=gqa["num_query_heads"],
        key_dim=gqa["head_dim"],
        num_kv_heads=gqa["num_key_value_heads"],
        dropout=gqa["dropout"],
        use_bias=gqa["use_bias"],
        sliding_window=gqa.get("sliding_window"),
        use_gate=bool(gqa.get("use_gate", False)),
        kernel_initializer=gqa["kernel_initializer"],
        bias_initializer=gqa["bias_initializer"],
        kernel_regularizer=gqa["kernel_regularizer"],
        bias_regularizer=gqa["bias_regularizer"],
        kernel_constraint=gqa["kernel_constraint"],
        bias_constraint=gqa["bias_constraint"],
        activity_regularizer=gqa.get("activity_regularizer"),
        seed=gqa["seed"],
    )


# The methods through which a subclass can change what MHA / GQA computes: ``call``
# and the attention hooks it calls (a subclass overriding ``_compute_attention``
# keeps ``call`` and still computes something else), and the builders of what they
# use (``_build_attention`` sets MHA's softmax and einsum equations, ``_make_output_dense``
# its output projection).
_ATTENTION_HOOKS = (
    "call",
    "_compute_attention",
    "_masked_softmax",
    "_compute_attention_mask",
    "_compute_causal_mask",
    "_compute_sliding_window_mask",
    "_build_attention",
    "_make_output_dense",
)


def _overridden(layer: Any, base: type) -> list[str]:
    """The attention methods ``layer``'s class overrides below ``base``. KerasHub's
    CachedMultiHeadAttention does not count: MHA's attention plus the cache
    arguments, which DamchaAttention takes too."""
    found: list[str] = []
    for cls in type(layer).__mro__:
        if cls is base:
            break
        if cls.__module__.startswith("keras_hub.") and cls.__qualname__ == "CachedMultiHeadAttention":
            continue
        found += [h for h in _ATTENTION_HOOKS if h in cls.__dict__ and h not in found]
    return found


def _name(layer: Any) -> str:
    return getattr(layer, "path", None) or layer.name


def _copy(source: Any, target: Any) -> Any:
    """A fresh NumPy copy of variable ``source``'s value, in ``target``'s shape."""
    return np.array(keras.ops.convert_to_numpy(source.value)).reshape(tuple(target.shape))


def from_mha(cls: type, layer: Any, **kwargs: Any) -> DamchaAttention:
    """An exact conversion of ``layer``: its projections (and gate) copied, a
    fresh metric generator and gates 0 (see ``DamchaAttention.from_mha``)."""
    if isinstance(layer, keras.layers.MultiHeadAttention):
        options = _mha_options(layer)
    elif isinstance(layer, keras.layers.GroupQueryAttention):
        options = _gqa_options(layer)
    else:
        raise DamchaTypeError(
            invalid_argument(
                "layer", "a keras.layers.MultiHeadAttention or GroupQueryAttention", f"layer={describe(layer)}"
            )
        )
    base = (
        keras.layers.MultiHeadAttention
        if isinstance(layer, keras.layers.MultiHeadAttention)
        else keras.layers.GroupQueryAttention
    )
    overridden = _overridden(layer, base)
    if overridden:
        # from_mha builds a new layer that reproduces the base class's call only;
        # convert() keeps the layer (and its own call) and hooks its projections.
        raise DamchaValueError(
            invalid_argument(
                "layer",
                f"a keras.layers.{base.__name__} computing what {base.__name__} computes (a subclass with its own "
                "call or attention hooks computes something from_mha cannot copy; damcha_keras.convert(model) "
                "keeps the subclass's call)",
                f"layer={_name(layer)} ({type(layer).__module__}.{type(layer).__qualname__}), which overrides "
                + ", ".join(overridden),
            )
        )
    if not layer.built:
        raise DamchaValueError(
            invalid_argument("layer", "a built layer (call it once)", f"an unbuilt layer {layer.name!r}")
        )
    theirs = {
        "query": layer._query_dense,
        "key": layer._key_dense,
        "value": layer._value_dense,
        "output": layer._output_dense,
    }
    if options["use_gate"]:
        theirs["gate"] = layer._gate_dense
    for name, dense in theirs.items():
        if getattr(dense, "lora_enabled", False):
            # Its kernel is then the merged tensor, not a variable (from_mha failed with a raw
            # AttributeError), and a copy would drop the LoRA factors the user trains.
            raise DamchaValueError(
                invalid_argument(
                    "layer",
                    "a layer without LoRA on its projections (damcha_keras.convert(model) converts the layer in "
                    "place and keeps its LoRA projections)",
                    f"layer={describe(layer)} with LoRA enabled on its {name} projection",
                )
            )
        if dense.quantization_mode is not None:
            raise DamchaValueError(
                invalid_argument(
                    "layer",
                    "a layer with float projections (convert the float layer, then quantize the DamchaAttention)",
                    f"layer={describe(layer)} with a quantized {name} projection ({dense.quantization_mode})",
                )
            )
    # Build from the kernels: they hold the feature sizes whatever the input rank.
    E_q, E_k, E_v = (int(theirs[n].kernel.shape[0]) for n in ("query", "key", "value"))
    rank = len(layer._query_dense.equation.split(",")[0])  # the query's rank, from its projection
    # The name too, as a drop-in: weights, checkpoints and model.get_layer() find layers by it.
    options.update(dtype=layer.dtype_policy, name=layer.name)
    # The flash choice MHA resolved at construction (its get_config drops it):
    # True asks every call for the flash kernel, False follows
    # keras.config.disable_flash_attention(), None lets the backend choose.
    options["flash_attention"] = getattr(layer, "_flash_attention", None)
    options.update(kwargs)
    new = cls(**options)
    dims = (None,) * (rank - 1)
    new.build((*dims, E_q), (*dims, E_v), (*dims, E_k))
    ours = {**new._projections(), **({"gate": new._gate_dense} if new._use_gate else {})}
    # Copy through NumPy: on the JAX backend a same-shape reshape returns the
    # very array, and assigning it would share one buffer between the two
    # layers; a jitted train step donates its variables' buffers, so training
    # either layer would delete the other's weights ("Array has been deleted").
    for name, dense in theirs.items():
        if name not in ours:
            continue
        ours[name].kernel.assign(_copy(dense.kernel, ours[name].kernel))
        if new.use_bias and dense.bias is not None:
            ours[name].bias.assign(_copy(dense.bias, ours[name].bias))
        # Frozen stays frozen (a model frozen before conversion would otherwise
        # train these projections again); the new gates and generators train.
        ours[name].trainable = dense.trainable
        for attr in ("kernel", "bias"):
            theirs_var, ours_var = getattr(dense, attr, None), getattr(ours[name], attr, None)
            if theirs_var is not None and ours_var is not None:
                ours_var.trainable = theirs_var.trainable
    return new
