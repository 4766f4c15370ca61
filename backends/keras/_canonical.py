"""Canonical parameter I/O of ``DamchaAttention``: the weights under
``damcha_core``'s names and shapes, so they move between every port.

The layer's methods (``to_canonical``, ``load_canonical``, ``from_canonical``,
``save``, ``load``) call these functions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

import damcha_core as dc
import keras
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe
from damcha_core._params import check_no_config_kwargs, check_params_finite, detached

if TYPE_CHECKING:
    from ._layer import DamchaAttention


def require_built(layer: DamchaAttention, what: str) -> DamchaConfig:
    """The layer's config; a DamchaValueError naming ``what`` if it is not built."""
    if not layer.built or layer.config is None:
        raise DamchaValueError(
            f"`{what}` needs a built layer; call it on data or use from_canonical first. "
            f"Received: an unbuilt layer {layer.name!r}"
        )
    return layer.config


def _check_plain(layer: DamchaAttention, what: str) -> None:
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


def canonical_variables(layer: DamchaAttention) -> dict[str, Any]:
    """Canonical name -> ``keras.Variable``, in canonical order (a shared
    generator's variable appears once per name). The output kernel and bias
    keep the layer's ``output_shape`` ((H, d_v, *output_shape) and
    (*output_shape,)); everything else has its canonical shape."""
    config = require_built(layer, "canonical_variables")
    _check_plain(layer, "canonical_variables")
    for dense in layer._projections().values():
        if dense.lora_enabled:
            raise DamchaValueError(
                f"`canonical_variables` cannot give one variable per weight while LoRA is enabled on {dense.name!r} "
                "(its kernel is a sum). Use to_canonical (merged weights) or disable LoRA. "
                f"Received: layer {layer.name!r}"
            )
    out = _weights(layer, config)
    return {name: out[name] for name in config.param_shapes()}


def _weights(layer: DamchaAttention, config: DamchaConfig) -> dict[str, Any]:
    """Canonical name -> the layer's weight of that name (a projection's
    ``kernel`` is the merged one when LoRA is on), in no particular order."""
    out: dict[str, Any] = {}
    for name, dense in layer._projections().items():
        out[f"{name}.kernel"] = dense.kernel
        if config.use_bias:
            out[f"{name}.bias"] = dense.bias
    for side, generator in layer.metric_generators.items():
        out[f"metric.{side}.gate"] = layer.metric_gates[side]
        for leaf in generator.leaf_names():
            out[f"metric.{side}.{leaf}"] = getattr(generator, leaf)
    return out


def to_canonical(layer: DamchaAttention) -> dict[str, np.ndarray]:
    """The weights as canonical NumPy arrays (in the variables' dtype); LoRA
    updates are merged into their kernels."""
    config = require_built(layer, "to_canonical")
    _check_plain(layer, "to_canonical")
    shapes = config.param_shapes()
    out = _weights(layer, config)
    return {name: np.asarray(keras.ops.convert_to_numpy(out[name])).reshape(shapes[name]) for name in shapes}


def _held_dtype(dtype: Any) -> tuple[str, str]:
    """``(dtype the backend holds, its name for messages)`` of a Keras dtype:
    on JAX without ``jax_enable_x64`` a float64 variable (or computation) is
    float32, and a value past float32's range would be stored as inf."""
    declared = keras.backend.standardize_dtype(dtype)
    if keras.backend.backend() != "jax":
        return declared, declared
    import jax

    held = jax.dtypes.canonicalize_dtype(declared).name
    return held, held if held == declared else f"{held} ({declared} without jax_enable_x64)"


def _check_fit(name: str, value: Any, variable: Any, layer: Any) -> None:
    """``check_params_fit`` of one value against the dtype a Keras variable
    holds and, where ``layer`` casts the variable when it computes (a mixed
    precision policy: float32 variables, float16 compute), against ``layer``'s
    compute dtype: a value that fits float32 but not float16 would be inf in
    every call."""
    dtype, label = _held_dtype(variable.dtype)
    dc.check_params_fit({name: value}, label, float(ml_dtypes.finfo(dtype).max))
    compute, compute_label = _held_dtype(layer.compute_dtype)
    # A variable made with autocast=False (LayerNormalization's) is read in its own dtype.
    casts = layer.autocast and getattr(variable, "_autocast", True)
    if compute != dtype and casts and keras.backend.is_float_dtype(compute):
        dc.check_params_fit(
            {name: value},
            f"{compute_label}, the compute dtype of dtype policy {layer.dtype_policy.name!r}",
            float(ml_dtypes.finfo(compute).max),
        )


def load_canonical(layer: DamchaAttention, params: Mapping[str, Any]) -> None:
    """Assign canonical params, validated against ``layer.config``."""
    checked = dc.validate_params(detached(params), require_built(layer, "load_canonical"))
    variables = canonical_variables(layer)
    for name, variable in variables.items():  # all checked before any is assigned
        _check_fit(name, checked[name], variable, layer)
    for name, variable in variables.items():
        value = checked[name].reshape(tuple(variable.shape))
        variable.assign(value.astype(keras.backend.standardize_dtype(variable.dtype)))


def from_canonical(cls: type, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> DamchaAttention:
    """A built ``cls`` holding ``params`` for ``config``."""
    dc.check_config(config)
    params = detached(params)
    check_params_finite(params, config)
    from_config = dict(
        num_heads=config.num_heads,
        key_dim=config.key_dim,
        value_dim=config.value_dim,
        dropout=config.dropout,
        use_bias=config.use_bias,
        output_shape=config.output_dim,
        metric=config.metric,
        metric_rank=config.metric_rank,
        coupling=config.coupling,
        num_kv_heads=config.num_kv_heads,
        scale=config.scale,
    )
    check_no_config_kwargs(kwargs, from_config)
    layer = cls(**from_config, **kwargs)
    # Zeros skip the random draws (slow to compile per shape on JAX): the
    # params overwrite every variable right after.
    layer._zero_init = True
    layer.build((None, None, config.query_dim), (None, None, config.value_input_dim), (None, None, config.context_dim))
    layer._zero_init = False
    load_canonical(layer, params)
    return layer


def _check_file_options(layer: DamchaAttention) -> None:
    """A file loads in every port with its config only: refuse options that
    change the outputs and that DAMCHA v1's canonical config has no field for."""
    axes = getattr(layer, "_attention_axes", None)
    layout = getattr(layer, "_layout", None)
    if axes is not None and layout is not None and layout.attention_axes == tuple(range(1, layout.rank - 1)):
        # Every axis but batch and features, for the built rank: the default, which
        # Keras's own MHA writes into its config when it builds (from_mha copies it).
        axes = None
    shape = getattr(layer, "_output_shape", None)
    options = {
        "sliding_window": getattr(layer, "_sliding_window", None),
        "attention_axes": axes,
        # The config holds output_dim only: a (2, 4) output loaded as (8,).
        "output_shape": shape if shape is not None and len(shape) > 1 else None,
    }
    for name, value in options.items():
        if value is not None:
            raise DamchaValueError(
                dc.invalid_argument(
                    name,
                    f"its default for `save`: DAMCHA v1's canonical config has no {name}, so the file would load (in "
                    f"every port) as a layer without it, with other outputs. Save the weights with "
                    f"damcha_core.save_params(path, layer.to_canonical(), layer.config) and restore {name} yourself "
                    f"(build a layer with it, then load_canonical)",
                    f"layer {layer.name!r} with {name}={value!r}",
                )
            )


def save(layer: DamchaAttention, path: str | os.PathLike) -> None:
    """Weights and config as DAMCHA safetensors (``damcha_core.save_params``)."""
    config = require_built(layer, "save")
    _check_file_options(layer)
    dc.save_params(path, to_canonical(layer), config)


def load(cls: type, path: str | os.PathLike, **kwargs: Any) -> DamchaAttention:
    """``from_canonical`` on a DAMCHA safetensors file."""
    params, config = dc.load_params(path)
    return from_canonical(cls, params, config, **kwargs)


# ------------------------------------------------------------------ stacks


def _activation_name(fn: Any) -> str | None:
    from ._blocks import gelu_tanh

    return {keras.activations.relu: "relu", keras.activations.gelu: "gelu", gelu_tanh: "gelu_tanh"}.get(fn)


def _split_stack(layers: Any, argument: str) -> tuple[list[Any], Any]:
    """The blocks of a stack and its final LayerNormalization (or None)."""
    from ._blocks import TransformerDecoder, TransformerEncoder

    kinds = (TransformerEncoder, TransformerDecoder)
    if isinstance(layers, (keras.layers.Layer, str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise DamchaTypeError(
            dc.invalid_argument(
                argument,
                "a non-empty list of damcha_keras TransformerEncoder/TransformerDecoder blocks, optionally followed by one keras.layers.LayerNormalization",
                f"{argument}={describe(layers)}",
            )
        )
    layers = list(layers)
    final = layers.pop() if isinstance(layers[-1], keras.layers.LayerNormalization) and len(layers) > 1 else None
    types = {type(b) for b in layers}
    if not types <= set(kinds) or len(types) != 1:
        raise DamchaTypeError(
            dc.invalid_argument(
                argument,
                "blocks of one kind, all TransformerEncoder or all TransformerDecoder (then an optional final "
                "LayerNormalization)",
                f"{argument} with blocks of types {sorted(t.__name__ for t in types)}",
            )
        )
    return layers, final


# Set by stack_from_canonical on the blocks of a share_metric=True stack without
# generators (metric="none"), whose sharing no generator object can show.
_SHARE_FLAG = "_damcha_share_metric"


def _sharing(blocks: list[Any]) -> bool:
    """True when every block uses block 0's generator objects (stack-wise sharing).

    A lone block shares when its generator was handed to it (``metric_generator``,
    as ``stack_from_canonical`` does for ``share_metric=True``): damcha_core names
    a one-layer stack's generator ``shared.*`` whenever ``share_metric``, so the
    names must round-trip for one layer too. A block that made its own does not.
    """
    first = blocks[0]._attention.metric_generators
    if not first:
        # metric="none": no generator to share, yet the flag round-trips (as in torch and
        # JAX): stack_from_canonical records it on the blocks it builds.
        return all(getattr(b, _SHARE_FLAG, False) for b in blocks)
    if len(blocks) == 1:
        return blocks[0].metric_generator is not None
    return all(all(b._attention.metric_generators.get(side) is g for side, g in first.items()) for b in blocks[1:])


def stack_config(layers: Sequence[Any], *, causal: bool | None = None) -> dc.EncoderConfig:
    """The ``damcha_core.EncoderConfig`` of a stack of built blocks, or a
    DamchaValueError listing what does not fit the stack format."""
    from ._blocks import TransformerDecoder

    blocks, final = _split_stack(layers, "blocks")
    decoder = isinstance(blocks[0], TransformerDecoder)
    causal = decoder if causal is None else dc.check_bool("causal", causal)
    if decoder and not causal:
        raise DamchaValueError(
            dc.invalid_argument("causal", "True or None for TransformerDecoder blocks (always causal)", "causal=False")
        )
    problems = []
    first = blocks[0]
    if any(not b.built for b in blocks):
        problems.append("built blocks (call the model once)")
    else:
        for i, b in enumerate(blocks):
            if _activation_name(b.activation) is None:
                problems.append(
                    f"activation relu, gelu or gelu_tanh (block {i} has "
                    f"{getattr(b.activation, '__name__', b.activation)})"
                )
            if b.activation is not first.activation or b.normalize_first != first.normalize_first:
                problems.append(f"one activation and normalize_first (block {i} differs)")
            if b.layer_norm_epsilon != first.layer_norm_epsilon:
                problems.append(f"one layer_norm_epsilon (block {i} differs)")
            if b._attention.config != first._attention.config:
                problems.append(f"one attention config (block {i} differs)")
            for dense in (b._ffn_in, b._ffn_out):
                if dense.quantization_mode is not None:
                    # Its kernel holds integer codes (scaled when it computes): canonical
                    # weights exist for float kernels only, as for the attention's projections.
                    problems.append(
                        f"float feed-forward Dense layers: take canonical weights before quantize() (block {i}'s "
                        f"{dense.name!r} is quantized, {dense.quantization_mode})"
                    )
        if final is not None and (
            not final.built or final.epsilon != first.layer_norm_epsilon or not (final.center and final.scale)
        ):
            problems.append("a built final LayerNormalization with the blocks' epsilon, center and scale")
    if problems:
        raise DamchaValueError(
            dc.invalid_argument(
                "blocks",
                "a stack that fits the stack format (damcha_core.EncoderConfig), with "
                + "; ".join(dict.fromkeys(problems)),
                f"blocks={describe(list(layers))}",
            )
        )
    activation = _activation_name(first.activation)
    assert activation is not None, "an unknown activation is one of the problems above"
    return dc.EncoderConfig(
        first._attention.config,
        num_layers=len(blocks),
        ffn_dim=first.intermediate_dim,
        share_metric=_sharing(blocks),
        norm_eps=float(first.layer_norm_epsilon),
        causal=bool(causal),
        norm_first=bool(first.normalize_first),
        activation=activation,
        final_norm=final is not None,
    )


def _block_variables(block: Any, *, assign: bool = False) -> dict[str, Any]:
    """Stack names of one block's norm and feed-forward weights: variables, but
    a feed-forward kernel under LoRA is the merged kernel (a tensor), which
    ``to_canonical`` reads as the attention's own merges its projections; with
    ``assign`` (loading) such a kernel is refused, as the attention's load
    refuses one: it is a sum, with no one variable to assign."""
    for dense in (block._ffn_in, block._ffn_out):
        if assign and dense.lora_enabled:
            raise DamchaValueError(
                dc.invalid_argument(
                    "blocks",
                    "feed-forward Dense layers without LoRA to load canonical weights into (a LoRA kernel is "
                    "kernel + lora_a @ lora_b: no one variable to assign). Load before enable_lora, or into a "
                    "stack without LoRA; stack_to_canonical reads the merged kernels",
                    f"block {block.name!r} with LoRA enabled on {dense.name!r}",
                )
            )
    return {
        "norm1.scale": block._attention_norm.gamma,
        "norm1.bias": block._attention_norm.beta,
        "norm2.scale": block._ffn_norm.gamma,
        "norm2.bias": block._ffn_norm.beta,
        "ffn.in.kernel": block._ffn_in.kernel,
        "ffn.in.bias": block._ffn_in.bias,
        "ffn.out.kernel": block._ffn_out.kernel,
        "ffn.out.bias": block._ffn_out.bias,
    }


def stack_to_canonical(
    layers: Sequence[Any], *, causal: bool | None = None
) -> tuple[dict[str, np.ndarray], dc.EncoderConfig]:
    """``(params, EncoderConfig)`` of a stack in damcha_core's stack format, float64.

    Args:
        layers: built ``TransformerEncoder`` blocks (or all ``TransformerDecoder``),
            in order, optionally followed by the final ``LayerNormalization``.
            A generator every block shares is stored once.
        causal: defaults to True for decoder blocks (always causal), False for
            encoder blocks.
    """
    config = stack_config(layers, causal=causal)
    blocks, final = _split_stack(layers, "blocks")
    shapes = config.param_shapes()
    to_np = lambda v: np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float64)  # noqa: E731
    params: dict[str, np.ndarray] = {}
    for i, block in enumerate(blocks):
        for key, value in block._attention.to_canonical().items():
            name = f"layers.{i}.attention.{key}"
            if name in shapes:
                params[name] = np.asarray(value, dtype=np.float64)
            else:  # the generator the stack shares: stored once, under "shared."
                params.setdefault(f"shared.{key}", np.asarray(value, dtype=np.float64))
        params.update({f"layers.{i}.{key}": to_np(v) for key, v in _block_variables(block).items()})
    if final is not None:
        params["final_norm.scale"], params["final_norm.bias"] = to_np(final.gamma), to_np(final.beta)
    return {name: params[name] for name in shapes}, config  # the core's order: files and diffs agree


def stack_load_canonical(layers: Sequence[Any], params: Mapping[str, Any]) -> Sequence[Any]:
    """Copy stack params (validated against the stack's own config) in; returns ``layers``."""
    config = stack_config(layers)
    checked = dc.validate_stack_params(params, config)
    blocks, final = _split_stack(layers, "blocks")
    # Every value is checked against its variable's dtype before anything is assigned: a
    # refusal must not leave the first blocks loaded and the rest as they were.
    targets: dict[str, tuple[Any, Any]] = {}  # name -> (variable, the layer that computes with it)
    for i, block in enumerate(blocks):
        attention = block._attention
        targets.update({f"layers.{i}.attention.{k}": (v, attention) for k, v in canonical_variables(attention).items()})
        targets.update({f"layers.{i}.{key}": (v, block) for key, v in _block_variables(block, assign=True).items()})
    if final is not None:
        targets.update({"final_norm.scale": (final.gamma, final), "final_norm.bias": (final.beta, final)})
    for name, (variable, owner) in targets.items():
        if name not in checked:  # a shared generator: stored once under "shared."
            name = f"shared.{name.split('.attention.', 1)[1]}"
        _check_fit(name, checked[name], variable, owner)
    for i, block in enumerate(blocks):
        block._attention.load_canonical(config.layer_params(checked, i))
        for key, variable in _block_variables(block).items():
            variable.assign(checked[f"layers.{i}.{key}"].astype(keras.backend.standardize_dtype(variable.dtype)))
    if final is not None:
        final.gamma.assign(checked["final_norm.scale"].astype(keras.backend.standardize_dtype(final.gamma.dtype)))
        final.beta.assign(checked["final_norm.bias"].astype(keras.backend.standardize_dtype(final.beta.dtype)))
    return layers


def stack_from_canonical(params: Mapping[str, Any], config: dc.EncoderConfig, **kwargs: Any) -> list[Any]:
    """Built blocks holding stack ``params`` for ``config``: ``TransformerDecoder``
    blocks when ``config.causal``, else ``TransformerEncoder``, then a
    ``LayerNormalization`` when ``config.final_norm``. With ``share_metric`` the
    blocks share one generator per side. ``kwargs`` go to every block
    (``dtype``, ``seed``, ``metric_l2``, ...)."""
    from ._blocks import TransformerDecoder, TransformerEncoder, gelu_tanh
    from ._generator import MetricGenerator

    if not isinstance(config, dc.EncoderConfig):
        raise DamchaTypeError(
            dc.invalid_argument("config", "a damcha_core.EncoderConfig", f"config={describe(config)}")
        )
    checked = dc.validate_stack_params(params, config)
    a = config.attention
    if not a.use_bias:
        raise DamchaValueError(
            dc.invalid_argument(
                "config",
                "a config with attention biases (damcha_keras blocks have them)",
                "config.attention.use_bias=False",
            )
        )
    cls = TransformerDecoder if config.causal else TransformerEncoder
    dtype = kwargs.get("dtype")
    shared: Any = None
    if config.share_metric and a.metric_sides:
        gens = {
            side: MetricGenerator(
                a.side_heads(side),
                metric=a.metric,
                key_dim=a.key_dim,
                metric_rank=a.metric_rank,
                name=f"shared_metric_{side}",
                dtype=dtype,
            )
            for side in a.metric_sides
        }
        shared = gens if a.coupling == "separate" else next(iter(gens.values()))
    activation = gelu_tanh if config.activation == "gelu_tanh" else config.activation
    head: dict[str, Any] = {"key_dim": a.key_dim} if a.key_dim * a.num_heads != a.query_dim else {}
    head.update(
        {
            k: v
            for k, v in (("value_dim", a.value_dim if a.value_dim != a.key_dim else None), ("scale", a.scale))
            if v is not None
        }
    )
    blocks: list[Any] = [
        cls(
            config.ffn_dim,
            a.num_heads,
            dropout=a.dropout,
            activation=activation,
            layer_norm_epsilon=config.norm_eps,
            normalize_first=config.norm_first,
            metric=a.metric,
            metric_rank=a.metric_rank,
            coupling=a.coupling,
            num_kv_heads=a.num_kv_heads,
            metric_generator=shared,
            **head,
            **kwargs,
        )
        for _ in range(config.num_layers)
    ]
    for block in blocks:
        block.build((None, None, a.query_dim))
        if config.share_metric and not a.metric_sides:
            setattr(block, _SHARE_FLAG, True)  # nothing shared to show it: _sharing reads this
    if config.final_norm:
        final = keras.layers.LayerNormalization(epsilon=config.norm_eps, dtype=dtype, name="final_norm")
        final.build((None, None, a.query_dim))
        blocks.append(final)
    stack_load_canonical(blocks, checked)
    return blocks
