"""Transformer blocks in the KerasHub style, with DAMCHA self-attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

import damcha_core as dc
import keras
from damcha_core import DamchaValueError, describe

from . import _args, _canonical
from ._generator import MetricGenerator, serialize_generator
from ._layer import DamchaAttention


@keras.saving.register_keras_serializable(package="damcha")
def gelu_tanh(x: Any) -> Any:
    """GELU with the tanh approximation (Flax's default, the stack format's
    "gelu_tanh"), as a named, serializable activation for the blocks."""
    return keras.activations.gelu(x, approximate=True)


class _Block(keras.layers.Layer):
    """Shared body of the encoder and decoder blocks (post- or pre-norm)."""

    _causal = False

    def __init__(
        self,
        intermediate_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        activation: Any = "relu",
        layer_norm_epsilon: float = 1e-5,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        normalize_first: bool = False,
        *,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str | None = None,
        num_kv_heads: int | None = None,
        metric_l2: float = 0.0,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        seed: int | None = None,
        key_dim: int | None = None,
        value_dim: int | None = None,
        scale: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.intermediate_dim = dc.check_int("intermediate_dim", intermediate_dim)
        # The attention's own rules, now: build would otherwise divide by num_heads.
        sizes: dict[str, Any] = {k: v for k, v in (("key_dim", key_dim), ("value_dim", value_dim)) if v is not None}
        args = dc.check_layer_args(
            num_heads=num_heads,
            metric=metric,
            metric_rank=metric_rank,
            coupling=coupling,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            scale=scale,
            **sizes,
        )
        if not dc.check_real("layer_norm_epsilon", layer_norm_epsilon) > 0:
            raise DamchaValueError(
                dc.invalid_argument(
                    "layer_norm_epsilon", "a number > 0", f"layer_norm_epsilon={describe(layer_norm_epsilon)}"
                )
            )
        dc.check_generator_arg(
            metric_generator, metric=args["metric"], coupling=args["coupling"], generator_type=MetricGenerator
        )
        if isinstance(metric_generator, Mapping):
            metric_generator = dict(metric_generator)
        self.supports_masking = True
        self.num_heads = args["num_heads"]
        self.dropout = args["dropout"]
        self.activation = keras.activations.get(activation)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.normalize_first = dc.check_bool("normalize_first", normalize_first)
        self.damcha_options: dict[str, Any] = dict(
            metric=metric,
            metric_rank=metric_rank,
            coupling=coupling,
            num_kv_heads=num_kv_heads,
            metric_l2=dc.check_finite_nonneg("metric_l2", metric_l2),
        )
        # Only set when given, so configs of earlier versions stay as they were.
        self.head_options: dict[str, Any] = {
            k: v for k, v in (("key_dim", key_dim), ("value_dim", value_dim), ("scale", scale)) if v is not None
        }
        self.metric_generator = metric_generator
        self.seed = dc.check_seed("seed", seed)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A NumPy `training` is checked as given, before Keras makes it a tensor.
        _args.check_numpy_flags(_args.BLOCK_FLAGS, args, kwargs)
        return super().__call__(*args, **kwargs)

    def build(self, inputs_shape: tuple) -> None:
        hidden = inputs_shape[-1]
        key_dim = self.head_options.get("key_dim")
        if hidden is None or (key_dim is None and hidden % self.num_heads):
            raise DamchaValueError(
                dc.invalid_argument(
                    "inputs",
                    f"a known feature size, a multiple of num_heads={self.num_heads} (key_dim = hidden // num_heads "
                    "unless key_dim is given)",
                    f"inputs.shape={tuple(inputs_shape)}",
                )
            )
        init = lambda i: i.__class__.from_config(i.get_config())  # noqa: E731 (fresh instances)
        self._attention = DamchaAttention(
            num_heads=self.num_heads,
            key_dim=key_dim or hidden // self.num_heads,
            dropout=self.dropout,
            value_dim=self.head_options.get("value_dim"),
            scale=self.head_options.get("scale"),
            kernel_initializer=init(self.kernel_initializer),
            bias_initializer=init(self.bias_initializer),
            seed=self.seed,
            metric_generator=self.metric_generator,
            dtype=self.dtype_policy,
            name="self_attention",
            **self.damcha_options,
        )
        self._attention.build(inputs_shape, inputs_shape)

        def norm(name):
            return keras.layers.LayerNormalization(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)

        self._attention_norm = norm("self_attention_layer_norm")
        self._attention_norm.build(inputs_shape)
        self._attention_dropout = keras.layers.Dropout(self.dropout, seed=self.seed, dtype=self.dtype_policy)
        dense = lambda units, name: keras.layers.Dense(  # noqa: E731
            units,
            kernel_initializer=init(self.kernel_initializer),
            bias_initializer=init(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )
        self._ffn_in = dense(self.intermediate_dim, "feedforward_intermediate_dense")
        self._ffn_in.build(inputs_shape)
        self._ffn_out = dense(hidden, "feedforward_output_dense")
        self._ffn_out.build(tuple(inputs_shape[:-1]) + (self.intermediate_dim,))
        self._ffn_norm = norm("feedforward_layer_norm")
        self._ffn_norm.build(inputs_shape)
        self._ffn_dropout = keras.layers.Dropout(self.dropout, seed=self.seed, dtype=self.dtype_policy)
        self.built = True

    # ---------------------------------------------------- canonical weights

    def to_canonical(self) -> tuple[dict[str, np.ndarray], dc.EncoderConfig]:
        """This block in damcha_core's stack format: ``(params, EncoderConfig)``
        with one layer (float64). For a stack use ``stack_to_canonical(blocks)``."""
        return _canonical.stack_to_canonical([self])

    def load_canonical(self, params: Mapping[str, Any]) -> _Block:
        """Copy one-layer stack params (validated against this block) in; returns self."""
        _canonical.stack_load_canonical([self], params)
        return self

    @classmethod
    def from_canonical(cls, params: Mapping[str, Any], config: dc.EncoderConfig, **kwargs: Any) -> _Block:
        """A built block holding one-layer stack ``params`` for ``config``
        (``num_layers=1``, no final norm); ``stack_from_canonical`` builds stacks."""
        if not isinstance(config, dc.EncoderConfig) or config.num_layers != 1 or config.final_norm:
            raise DamchaValueError(
                dc.invalid_argument(
                    "config",
                    f"a damcha_core.EncoderConfig with num_layers=1 and final_norm=False for {cls.__name__}"
                    ".from_canonical (use stack_from_canonical for stacks)",
                    f"config={describe(config)}",
                )
            )
        (block,) = _canonical.stack_from_canonical(params, config, **kwargs)
        if not isinstance(block, cls):
            raise DamchaValueError(
                dc.invalid_argument(
                    "config",
                    f"a config that builds a {cls.__name__}; causal={config.causal} builds a {type(block).__name__}",
                    f"config.causal={config.causal}",
                )
            )
        return block

    def _forward(
        self,
        x: Any,
        padding_mask: Any,
        attention_mask: Any,
        training: Any,
        cache: Any = None,
        cache_update_index: Any = None,
        pad_name: str = "padding_mask",
    ) -> Any:
        if padding_mask is not None:
            # Checked here, named as the caller passed it (the attention inside
            # would name it `query_mask`): (B, N), the tokens' own batch and length.
            got, want = tuple(padding_mask.shape), tuple(x.shape[:2])
            if len(got) != 2 or any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(got, want)):
                raise DamchaValueError(
                    dc.invalid_argument(
                        pad_name, f"shape (B, N) = {want}, the inputs' batch and length", f"{pad_name}.shape={got}"
                    )
                )
        residual = x
        if self.normalize_first:
            x = self._attention_norm(x)
        if cache is None:
            x = self._attention(
                x,
                x,
                query_mask=padding_mask,
                value_mask=padding_mask,
                attention_mask=attention_mask,
                training=training,
                use_causal_mask=self._causal,
            )
        else:
            x, cache = self._attention(
                x,
                x,
                attention_mask=attention_mask,
                training=training,
                use_causal_mask=self._causal,
                cache=cache,
                cache_update_index=cache_update_index,
            )
        x = residual + self._attention_dropout(x, training=training)
        if not self.normalize_first:
            x = self._attention_norm(x)
        residual = x
        if self.normalize_first:
            x = self._ffn_norm(x)
        x = self._ffn_out(self.activation(self._ffn_in(x)))
        x = residual + self._ffn_dropout(x, training=training)
        if not self.normalize_first:
            x = self._ffn_norm(x)
        return x if cache is None else (x, cache)

    def compute_output_shape(self, inputs_shape: tuple) -> tuple:
        return tuple(inputs_shape)

    def get_config(self) -> dict[str, Any]:
        generator = self.metric_generator
        return {
            **super().get_config(),
            "intermediate_dim": self.intermediate_dim,
            "num_heads": self.num_heads,
            "dropout": self.dropout,
            "activation": keras.activations.serialize(self.activation),
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "normalize_first": self.normalize_first,
            **self.damcha_options,
            **self.head_options,
            "metric_generator": None
            if generator is None
            else (
                {side: serialize_generator(g) for side, g in generator.items()}
                if isinstance(generator, dict)
                else serialize_generator(generator)
            ),
            "seed": self.seed,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _Block:
        config = dict(config)
        generator = config.get("metric_generator")
        if isinstance(generator, dict) and "class_name" not in generator:  # {side: generator config}
            config["metric_generator"] = {s: keras.saving.deserialize_keras_object(g) for s, g in generator.items()}
        elif generator is not None:
            config["metric_generator"] = keras.saving.deserialize_keras_object(generator)
        return cls(**config)


@keras.saving.register_keras_serializable(package="damcha")
class TransformerEncoder(_Block):
    """A transformer encoder block (KerasHub's ``TransformerEncoder`` layout)
    whose self-attention is ``DamchaAttention``.

    Args:
        intermediate_dim: width of the feed-forward layer.
        num_heads: attention heads; key_dim = hidden // num_heads.
        dropout, activation, layer_norm_epsilon, kernel_initializer,
        bias_initializer, normalize_first: as in KerasHub.
        metric, metric_rank, coupling, num_kv_heads, metric_l2: DAMCHA options.
        metric_generator: a ``MetricGenerator`` shared by the blocks of a
            stack (stack-wise sharing), or ``{"q": ..., "k": ...}`` for
            ``coupling="separate"``; ``None`` gives the block its own.
        seed: dropout and initialiser seed.

    Call arguments:
        inputs: (B, N, hidden).
        padding_mask: bool (B, N), True = real token; defaults to the
            inputs' Keras mask (e.g. from ``Embedding(mask_zero=True)``).
        attention_mask: bool (B, N, N), True = may attend.
        training: enables dropout.
    """

    def call(
        self, inputs: Any, padding_mask: Any = None, attention_mask: Any = None, training: Any = None, mask: Any = None
    ) -> Any:
        pad_name = "mask" if padding_mask is None else "padding_mask"
        return self._forward(
            inputs, mask if padding_mask is None else padding_mask, attention_mask, training, pad_name=pad_name
        )


@keras.saving.register_keras_serializable(package="damcha")
class TransformerDecoder(_Block):
    """A decoder-only (GPT-style) block: causal DAMCHA self-attention and a
    feed-forward layer, KerasHub layout. There is no cross-attention.

    Arguments and call arguments as ``TransformerEncoder``; the causal rule
    (query i sees keys j <= i) is always applied, combined with the masks.

    Incremental decoding (KerasHub's argument names): pass
    ``self_attention_cache`` (B, 2, L, G, d) from ``init_cache`` and
    ``self_attention_cache_update_index`` (the position of the first new
    token); the call returns ``(outputs, self_attention_cache)``. Query i then
    sees cache slots j <= index + i. ``decoder_attention_mask`` must span
    the cache, (B, N, L); a padding mask is refused with a cache (it would
    describe only the new tokens): fold it into ``decoder_attention_mask``.
    """

    _causal = True

    def call(
        self,
        decoder_sequence: Any,
        decoder_padding_mask: Any = None,
        decoder_attention_mask: Any = None,
        training: Any = None,
        mask: Any = None,
        self_attention_cache: Any = None,
        self_attention_cache_update_index: Any = None,
    ) -> Any:
        pad = mask if decoder_padding_mask is None else decoder_padding_mask
        if self_attention_cache is None:
            if self_attention_cache_update_index is not None:
                raise DamchaValueError(
                    dc.invalid_argument(
                        "self_attention_cache_update_index",
                        "None without a `self_attention_cache`",
                        "self_attention_cache=None, "
                        f"self_attention_cache_update_index={describe(self_attention_cache_update_index)}",
                    )
                )
            pad_name = "mask" if decoder_padding_mask is None else "decoder_padding_mask"
            return self._forward(decoder_sequence, pad, decoder_attention_mask, training, pad_name=pad_name)
        if self_attention_cache_update_index is None:
            raise DamchaValueError(
                dc.invalid_argument(
                    "self_attention_cache_update_index",
                    "the position of the first new token with a `self_attention_cache`",
                    "self_attention_cache_update_index=None",
                )
            )
        if pad is not None:
            raise DamchaValueError(
                dc.invalid_argument(
                    "decoder_padding_mask",
                    "None with `self_attention_cache` (also no Keras mask on the inputs): it would cover only the "
                    "new tokens. Pass `decoder_attention_mask` (B, N, L) over the whole cache instead",
                    f"padding mask of shape {tuple(pad.shape)}",
                )
            )
        return self._forward(
            decoder_sequence,
            None,
            decoder_attention_mask,
            training,
            self_attention_cache,
            self_attention_cache_update_index,
        )

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """A zero self-attention cache (B, 2, L, G, d) for this (built) block."""
        if not self.built:
            raise DamchaValueError("The block must be built (called once, or `build`) before it can make a cache.")
        return self._attention.init_cache(batch_size, max_length, dtype)

    def compute_output_spec(
        self,
        decoder_sequence: Any,
        decoder_padding_mask: Any = None,
        decoder_attention_mask: Any = None,
        training: Any = None,
        mask: Any = None,
        self_attention_cache: Any = None,
        self_attention_cache_update_index: Any = None,
    ) -> Any:
        out = keras.KerasTensor(decoder_sequence.shape, dtype=self.compute_dtype)
        if self_attention_cache is None:
            return out
        return out, keras.KerasTensor(self_attention_cache.shape, dtype=self_attention_cache.dtype)

    def build(self, decoder_sequence_shape: tuple) -> None:
        super().build(decoder_sequence_shape)
