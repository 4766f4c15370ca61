"""DamchaAttention: a drop-in for keras.layers.MultiHeadAttention, written with keras.ops.

This module holds the layer: building the sublayers and variables, and
``call``, which runs the projections (sublayers, called as layers so
quantization, LoRA and dtype policies apply) and the math of ``_functional``.
MHA's arguments and the input checks (``_args``), the masks (``_masks``), the
cache (``_cache``), canonical I/O (``_canonical``) and MHA conversion
(``_convert``) live in their own modules.
"""

from __future__ import annotations

import contextlib
import math
import os
import string
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

import damcha_core as dc
import keras
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe, invalid_argument
from keras import ops
from keras.src.backend import get_keras_mask, set_keras_mask  # MHA itself uses them; no public alias in Keras 3.15

from . import _args, _cache, _canonical, _convert, _masks
from . import _functional as F
from ._args import KERAS_NAMES
from ._cache import static_shape
from ._functional import dtype_name
from ._generator import MetricGenerator, hold, read_sharing, record_sharing, serialize_generator

# The entry of each DamchaAttention with a metric in a weights file that records
# whether its generator was handed in (1: ``metric_generator``, as shared stacks
# do) or is its own (0): see DamchaAttention.save_own_variables.
SHARED_GENERATOR_KEY = "damcha_shared_generator"


def _dense(layer: Any, x: Any) -> Any:
    """``layer(x)`` for an EinsumDense over tokens (B, T, ...). Keras's TensorFlow
    einsum returns (1, 0, ...) for an empty batch of no token (0, 0, ...) (it
    reshapes with an inferred dim, ambiguous at size 0): the output then keeps
    x's batch and length."""
    y = layer(x)
    if keras.backend.backend() == "tensorflow" and 0 in static_shape(x)[:2]:
        y = ops.reshape(y, (*ops.shape(x)[:2], *ops.shape(y)[2:]))
    return y


def _converted(layer: keras.layers.Layer, x: Any) -> Any:
    """x as Keras's ``Layer.__call__`` converts an argument for ``layer`` (an
    array to a tensor, a float cast to the layer's input dtype), with its Keras
    mask kept; a symbolic tensor as it is."""
    tensor = keras.ops.is_tensor(x)
    if keras.backend.is_keras_tensor(x) or not (tensor or hasattr(x, "__array__")):
        return x
    mask = get_keras_mask(x) if tensor else None
    y = layer.dtype_policy.convert_input(x, layer.autocast, layer.input_dtype)
    if mask is not None:
        set_keras_mask(y, mask)
    return y


@keras.saving.register_keras_serializable(package="damcha")
class DamchaAttention(keras.layers.Layer):
    """Data-Adaptive Mahalanobis Cross-Head Attention, a drop-in for
    ``keras.layers.MultiHeadAttention``.

    Queries and keys are projected as in MHA, q (B, N, H, d) and k (B, M, G, d);
    then each token's own cross-head map mixes its heads,
    ``(L(t) y)^h = y^h + g_h * sum_a A(t)[h, a] y^a`` with A(t) computed from
    the token's RMS-normalised features (see ``docs/keras.md`` and
    ``damcha_core``). The attention itself is ``keras.ops.dot_product_attention``
    on the mixed heads, so every backend's fused kernel applies. Gates start at
    0: a fresh layer computes exactly what MHA computes with the same weights.

    The first block of arguments is MHA's, in MHA's order; the keyword-only
    block is DAMCHA's.

    Args:
        num_heads: H, number of query heads.
        key_dim: d, size of each query/key head.
        value_dim: d_v, size of each value head; defaults to ``key_dim``.
        dropout: attention-probability dropout, training only.
        use_bias: whether the projections have biases.
        output_shape: the output's trailing shape, an int or a tuple of ints
            (E_o = their product in the canonical form); defaults to the
            query's feature size.
        attention_axes: the axes of rank > 3 inputs attended over (MHA's
            meaning; default: every axis but batch and features, set at
            build as MHA does, so a built layer reads ``(1,)`` for rank-3
            inputs). The other axes act as batch axes; the cross-head map acts
            on each position's heads.
        sliding_window: a query attends only to keys within
            ``sliding_window - 1`` positions of itself (MHA's symmetric band;
            with ``use_causal_mask`` the causal window).
        flash_attention: as MHA: ``True`` asks every attention for the
            backend's flash kernel (the backend raises where it has none; with
            ``dropout`` > 0 or ``return_attention_scores`` this raises), ``None``
            lets the backend choose unless ``keras.config.disable_flash_attention()``.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as in MHA, for the projections.
        use_gate: MHA's gated attention: the attention output is multiplied
            by ``sigmoid(query projection)`` (a ``gate`` sublayer, (E_q, H,
            d_v)) before the output projection. Not part of DAMCHA v1's
            canonical form: such a layer has no ``to_canonical``.
        seed: seeds the dropout and the metric generator's initialiser.
        metric: "heads" (default), "lowrank" or "none" (exactly MHA).
        metric_rank: r, required with ``metric="lowrank"``.
        coupling: None (default) picks "tied" (one map for queries and keys)
            when the metric is on, ``num_kv_heads == num_heads`` and the query
            and key inputs have one feature size, else "separate"; or
            "tied", "separate", "query" (queries only).
        num_kv_heads: G, key/value heads; must divide ``num_heads``.
        scale: softmax scale; ``None`` means ``1/sqrt(key_dim)``.
        metric_l2: coefficient of the metric penalty added with ``add_loss``
            (mean of ||L(t) - I||_F^2 / (S*d) over tokens and sides); default 0.0 (no penalty).
        metric_generator: a ``MetricGenerator`` shared with other layers
            (stack-wise sharing), or for ``coupling="separate"`` a dict
            ``{"q": ..., "k": ...}``; ``None`` creates the layer's own.
        **kwargs: base ``keras.layers.Layer`` arguments (name, dtype, ...).

    Call arguments:
        query: (B, N, E_q), or (B, *dims, E_q) with ``attention_axes``.
        value: (B, M, E_kv) (same rank as ``query``).
        key: optional (B, M, E_kv); defaults to ``value``. It feeds the key
            projection and the key-side metric.
        query_mask: (B, N); False rows see no key and output 0 before the
            output projection. Filled from the query's Keras mask.
        value_mask, key_mask: (B, M); False keys are hidden.
        attention_mask: (B, N, M), (N, M) or (B, H, N, M) (size-1 dims
            broadcast), True = may attend.
        return_attention_scores: also return probabilities (B, H, N, M).
        training: enables dropout.
        use_causal_mask: hide key j from query i when j > i (top-left); with
            a cache, j > cache_update_index + i (bottom-right). Any truthy
            value known at call time.
        cache: a key/value cache for incremental decoding, (B, 2, L, G, d)
            (KerasHub's ``CachedMultiHeadAttention`` layout; needs
            ``value_dim == key_dim``; ``init_cache`` makes one). It holds the
            *mapped* keys k~ = L_k(c) k, so cached keys never need their map
            again. With ``cache_update_index`` the new tokens' k~ and v are
            written at that position and the queries attend over the slots
            written so far (positions < index + M); without it the cache is
            read as is (e.g. precomputed cross-attention memory) and
            ``value``/``key`` are ignored. Masks then span the cache:
            ``attention_mask`` (B, N, L); ``value_mask``/``key_mask`` are
            refused.
        cache_update_index: int or int scalar tensor, the position of the
            first new token in ``cache``.

    Masks are boolean, or integer/float with values 0 and 1 (1 = may attend,
    as Keras reads them). Any other value (an additive 0/-inf float mask) is
    refused with a ``DamchaValueError`` when the values are known; under
    tracing (``jit``, ``tf.function``), where they are not, it makes the
    output NaN, never a silently inverted mask.

    Returns:
        (B, N, *output_shape), or ``(output, scores)``; with a cache, the
        updated cache is appended: ``(output, cache)`` or ``(output, scores,
        cache)``. A query that may attend to no key gets attention output 0
        (not NaN, not uniform as in MHA), so its output is the output bias.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | tuple[int, ...] | None = None,
        attention_axes: int | tuple[int, ...] | None = None,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        use_gate: bool = False,
        seed: int | None = None,
        *,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str | None = None,
        num_kv_heads: int | None = None,
        scale: float | None = None,
        metric_l2: float = 0.0,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        policy = self.dtype_policy
        for which in (policy.variable_dtype, policy.compute_dtype):
            # dtype="int32" or "bool" failed in the first call with TensorFlow's or ml_dtypes' own error,
            # where torch (dtype) and Flax (param_dtype, dtype) refuse them by name.
            if keras.backend.standardize_dtype(which) not in _args.FLOAT_DTYPES:
                raise DamchaTypeError(
                    invalid_argument(
                        "dtype",
                        "a real floating dtype or dtype policy (float16, bfloat16, float32, float64, mixed_float16, "
                        "...)",
                        f"dtype={describe(kwargs.get('dtype'))} (variable dtype {policy.variable_dtype}, compute "
                        f"dtype {policy.compute_dtype})",
                    )
                )
        self.supports_masking = True
        self._output_shape = _args.check_output_shape(output_shape)
        self._attention_axes = _args.check_attention_axes(attention_axes)
        args = _args.check_args(
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            num_kv_heads=num_kv_heads,
            use_bias=use_bias,
            metric=metric,
            metric_rank=metric_rank,
            coupling=coupling,
            scale=scale,
            dropout=dropout,
            metric_l2=metric_l2,
            seed=seed,
            sliding_window=sliding_window,
            use_gate=use_gate,
            flash_attention=flash_attention,
        )
        self._num_heads = args["num_heads"]
        self._key_dim = args["key_dim"]
        self._value_dim = args["value_dim"]
        self._num_kv_heads = args["num_kv_heads"]
        self._dropout = args["dropout"]
        self._use_bias = args["use_bias"]
        self._metric = args["metric"]
        self._metric_rank = args["metric_rank"]
        self._coupling_arg = coupling
        self._scale = args["scale"]
        self._metric_l2 = args["metric_l2"]
        self._sliding_window = args["sliding_window"]
        self._use_gate = args["use_gate"]
        self.seed = args["seed"]
        # As MHA: the argument, or the global switch (None = let the backend
        # choose, False after keras.config.disable_flash_attention()).
        self._flash_attention_arg = flash_attention
        self._flash_attention = flash_attention or keras.config.is_flash_attention_enabled()
        if self._flash_attention and self._dropout > 0:
            raise DamchaValueError(
                "Dropout is not supported when flash attention is enabled: the flash kernel has no "
                f"attention dropout. Set dropout=0.0 or flash_attention=False. Received: dropout={self._dropout}, "
                f"flash_attention={flash_attention!r}"
            )
        self._kernel_initializer = keras.initializers.get(kernel_initializer)
        self._bias_initializer = keras.initializers.get(bias_initializer)
        self._kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self._bias_regularizer = keras.regularizers.get(bias_regularizer)
        self._kernel_constraint = keras.constraints.get(kernel_constraint)
        self._bias_constraint = keras.constraints.get(bias_constraint)
        self._metric_generator_arg = _args.check_generator_arg(metric_generator, args["metric"], args["coupling"])
        self._dropout_layer = keras.layers.Dropout(rate=self._dropout, seed=self.seed, dtype=self.dtype_policy)
        self.config: DamchaConfig | None = None
        self._generators: dict[str, MetricGenerator] = {}
        self._gates: dict[str, Any] = {}
        # Set by from_canonical/from_mha, whose values overwrite the initial ones:
        # zeros skip the random draws (slow to compile per shape on JAX).
        self._zero_init = False
        # Input signatures already checked (``_check_inputs``); the checks depend on the built config only.
        self._checked: set[tuple] = set()

    # ------------------------------------------------------------ properties

    num_heads = property(lambda self: self._num_heads)
    key_dim = property(lambda self: self._key_dim)
    value_dim = property(lambda self: self._value_dim)
    num_kv_heads = property(lambda self: self._num_kv_heads)
    dropout = property(lambda self: self._dropout)
    use_bias = property(lambda self: self._use_bias)
    attention_axes = property(lambda self: self._attention_axes)
    metric = property(lambda self: self._metric)
    metric_l2 = property(lambda self: self._metric_l2)
    query_dense = property(lambda self: self._query_dense)
    key_dense = property(lambda self: self._key_dense)
    value_dense = property(lambda self: self._value_dense)
    output_dense = property(lambda self: self._output_dense)

    @property
    def _built_config(self) -> DamchaConfig:
        """``config`` where the layer must be built (``call`` and what it runs)."""
        if self.config is None:
            raise DamchaValueError(
                f"layer {self.name!r} is not built yet: call it on data, or `build` it, first. Received: an unbuilt layer"
            )
        return self.config

    @property
    def coupling(self) -> str | None:
        """The coupling in use once built; before, the argument (None = automatic)."""
        return self.config.coupling if self.config is not None else self._coupling_arg

    @property
    def metric_gates(self) -> dict[str, Any]:
        """The gate variable (S,) of each metric side; empty before build and for metric "none"."""
        return dict(self._gates)

    @property
    def metric_generators(self) -> dict[str, MetricGenerator]:
        """The generator of each metric side ("qk", or "q"/"k"); empty for metric "none".
        Before build: the shared generators passed as ``metric_generator``."""
        if self.built:
            return dict(self._generators)
        given = self._metric_generator_arg
        if isinstance(given, MetricGenerator):
            return {"qk" if self._coupling_arg in (None, "tied") else "q": given}
        return dict(given or {})

    # ----------------------------------------------------------------- build

    def _dense_kwargs(self) -> dict[str, Any]:
        # Fresh initialiser instances so that seeded initialisers do not give
        # identical query/key/value kernels (MHA does the same).
        if self._zero_init:
            kernel_init, bias_init = "zeros", "zeros"
        else:
            kernel_init = self._kernel_initializer.__class__.from_config(self._kernel_initializer.get_config())
            bias_init = self._bias_initializer.__class__.from_config(self._bias_initializer.get_config())
        return dict(
            kernel_initializer=kernel_init,
            bias_initializer=bias_init,
            kernel_regularizer=self._kernel_regularizer,
            bias_regularizer=self._bias_regularizer,
            kernel_constraint=self._kernel_constraint,
            bias_constraint=self._bias_constraint,
            dtype=self.dtype_policy,
        )

    def build(self, query_shape: tuple, value_shape: tuple, key_shape: tuple | None = None) -> None:
        _args.check_build_shapes(self._attention_axes, query_shape, value_shape, key_shape)
        E_q, E_v = int(query_shape[-1]), int(value_shape[-1])
        E_k = E_v if key_shape is None else int(key_shape[-1])
        E_o = math.prod(self._output_shape) if self._output_shape else E_q
        self.config = dc.make_config(
            names=KERAS_NAMES,
            query_dim=E_q,
            context_dim=E_k,
            value_input_dim=E_v,
            output_dim=E_o,
            num_heads=self._num_heads,
            key_dim=self._key_dim,
            value_dim=self._value_dim,
            num_kv_heads=self._num_kv_heads,
            use_bias=self._use_bias,
            metric=self._metric,
            metric_rank=self._metric_rank,
            coupling=self._coupling_arg,
            scale=self._scale,
            dropout=self._dropout,
        )
        self._layout = F.Layout(len(query_shape), _args.resolve_axes(self._attention_axes, len(query_shape)))
        if self._attention_axes is None:
            # As Keras MHA: the default axes are set at build, so attention_axes and get_config
            # read (1,) for rank-3 inputs (save takes them: _canonical._check_file_options).
            self._attention_axes = self._layout.attention_axes
        self._checked.clear()
        cfg = self.config
        H, G, d, d_v = cfg.num_heads, cfg.num_kv_heads, cfg.key_dim, cfg.value_dim
        dense = lambda equation, shape, axes, name, **kw: keras.layers.EinsumDense(  # noqa: E731
            equation,
            output_shape=shape,
            bias_axes=axes if self._use_bias else None,
            name=name,
            **self._dense_kwargs(),
            **kw,
        )
        out_dims = self._output_shape or (E_q,)
        out = string.ascii_lowercase[4 : 4 + len(out_dims)]
        # Attribute names, sublayer names and creation order as Keras MHA's, so
        # weight paths and the order of get_weights()/set_weights() match.
        # Tokens reach the projections as (B', T, E) whatever the input rank.
        self._query_dense = dense("abc,cde->abde", (None, H, d), "de", "query")
        self._key_dense = dense("abc,cde->abde", (None, G, d), "de", "key")
        if self._use_gate:
            self._gate_dense = dense("abc,cde->abde", (None, H, d_v), "de", "gate", activation="sigmoid")
        self._value_dense = dense("abc,cde->abde", (None, G, d_v), "de", "value")
        self._output_dense = dense(f"abcd,cd{out}->ab{out}", (None, *out_dims), out, "attention_output")
        self._query_dense.build((None, None, E_q))
        self._key_dense.build((None, None, E_k))
        if self._use_gate:
            self._gate_dense.build((None, None, E_q))
        self._value_dense.build((None, None, E_v))
        self._output_dense.build((None, None, H, d_v))
        given = self._metric_generator_arg
        # An unbuilt shared generator takes the feature size of the side it serves.
        sides = (
            dict(given)
            if isinstance(given, Mapping)
            else ({cfg.metric_sides[0]: given} if given is not None and len(cfg.metric_sides) == 1 else {})
        )
        hint = {id(g): cfg.side_features(side) for side, g in sides.items() if side in cfg.metric_sides}
        shared = dc.resolve_generators(
            given,
            cfg,
            generator_type=MetricGenerator,
            spec_of=lambda g: g.spec(hint.get(id(g))),
            names=KERAS_NAMES,
            coupling_was_auto=self._coupling_arg in (None, "auto"),
        )
        for i, side in enumerate(cfg.metric_sides):
            S, E = cfg.side_heads(side), cfg.side_features(side)
            generator = shared.get(side)
            if generator is None:
                generator = MetricGenerator(
                    S,
                    metric=cfg.metric,
                    key_dim=d,
                    metric_rank=cfg.metric_rank,
                    seed=None if self.seed is None else self.seed + 101 * (i + 1),
                    name=f"metric_{side}",
                    dtype=self.dtype_policy,
                )
                generator._zero_init = self._zero_init
            if not generator.built:
                generator.build((None, None, E))
            differs = cfg.generator_spec(side).mismatches(generator.spec())
            if differs:  # one unbuilt generator given for two sides of other sizes
                raise DamchaValueError(
                    dc.invalid_argument(
                        "metric_generator",
                        f"a generator that fits side {side!r} of layer {self.name!r} ({', '.join(differs)})",
                        f"metric_generator={generator.spec()}",
                    )
                )
            self._generators[side] = generator
            hold(generator, self)
            # The gate is per layer even when the generator is shared; 0 = exactly MHA.
            self._gates[side] = self.add_weight(name=f"metric_{side}_gate", shape=(S,), initializer="zeros")
        self.built = True

    # ------------------------------------------------------------------ math

    def _apply_map(self, side: str, tokens: Any, y: Any, penalties: list, recipes: list | None = None) -> Any:
        """L(t) y of ``side`` for stacked heads y (B, T, S, d).

        Metric "heads" takes the fast form: the generator, its gate and the
        identity folded into one (B, T, S, S) matrix per token, made once per
        side and tokens (a tied self-attention maps queries and keys with one
        matrix), then one batched product. The penalty (``metric_l2``),
        "lowrank" and a generator with a dtype policy of its own take the
        coefficient form, through the generator layer. ``recipes``: where
        given (torch training) and still empty, the fast form's (L y, matrix,
        y) is appended (``F.saved_as_recipes``).
        """
        generator = self._generators[side]
        gate = self._gates[side]
        if self._fast_map(side):
            if recipes is None:
                return F.compiled(F.map_heads, tokens, *self._map_weights(side), y)
            matrix = F.map_matrix(tokens, *self._map_weights(side))
            out = F.apply_map_matrix(matrix, y)
            if not recipes:  # one block: the first mapped side's (see ``call``)
                recipes.append((out, matrix, y))
            return out
        cfg = self._built_config
        coeff = generator(tokens)
        u, v = (generator.u, generator.v) if cfg.metric == "lowrank" else (None, None)
        if self._metric_l2 > 0:
            penalties.append(F.metric_penalty(cfg, side, coeff, gate, u, v))
        return F.apply_map(y, coeff, gate, metric=cfg.metric, u=u, v=v)

    def _fast_map(self, side: str) -> bool:
        """Whether ``side`` maps in the fast form (``_apply_map``)."""
        return (
            self._built_config.metric == "heads"
            and self._metric_l2 == 0
            and self._generators[side].compute_dtype == self.compute_dtype
        )

    def _map_weights(self, side: str) -> tuple[Any, Any, Any]:
        """The generator's kernel and bias and the gate of ``side``, for ``F.compiled`` (``F.map_weights``)."""
        generator = self._generators[side]
        return F.map_weights((generator.kernel, generator.bias, self._gates[side]))

    def _attend(
        self,
        q: Any,
        k: Any,
        v: Any,
        q_in: Any,
        v_in: Any,
        masks: _masks.CallMasks,
        *,
        use_causal_mask: bool,
        cache: Any,
        cache_update_index: Any,
        training: Any,
        return_attention_scores: bool,
    ) -> tuple[Any, Any]:
        """Attention on the mapped heads with the call's masks (boolean, folded):
        the fused kernel with its causal and key-mask arguments where the masks
        allow (``_masks.kernel_plan``), else MHA's hook ``_compute_attention``
        with the full boolean mask (``_masks.hook_mask``), as MHA does; a
        subclass that overrides the hook always gets the full mask.
        """
        window = self._sliding_window
        overridden = type(self)._compute_attention is not DamchaAttention._compute_attention
        explicit = self._explicit(q, training, return_attention_scores)
        scale = self._built_config.softmax_scale
        if not overridden and not explicit and self._flash_attention is not True:
            n_static, m_static = static_shape(q_in)[1], static_shape(v_in)[1]
            plan = _masks.kernel_plan(
                masks,
                n_static,
                m_static,
                use_causal_mask=use_causal_mask,
                cache=cache,
                cache_update_index=cache_update_index,
                window=window,
            )
            if plan is not None:
                out = F.fused_attention(
                    q,
                    k,
                    v,
                    scale=scale,
                    mask=plan.mask,
                    is_causal=plan.is_causal,
                    keep=plan.keep,
                    flash_attention=self._flash_attention,
                )
                return out, None
        visible, causal_only = _masks.hook_mask(
            masks,
            q_in,
            v_in,
            use_causal_mask=use_causal_mask,
            cache=cache,
            cache_update_index=cache_update_index,
            window=window,
            overridden=overridden,
        )
        extra = {"use_causal_mask": True} if causal_only else {}
        return self._compute_attention(q, k, v, visible, training, return_attention_scores, **extra)

    def _explicit(self, q: Any, training: Any, return_attention_scores: bool) -> bool:
        """Whether attention takes the einsum/softmax path instead of the fused kernel."""
        dropping = self._dropout > 0 and bool(training)
        # float64 avoids dot_product_attention where the backend computes it in a
        # narrower dtype (JAX's kernel takes its softmax in float32; Keras 3.15's
        # torch backend runs it in float32), unless the user asked for the flash
        # kernel. TensorFlow's keeps float64.
        return (
            bool(return_attention_scores)
            or dropping
            or (
                dtype_name(q) == "float64"
                and self._flash_attention is not True
                and keras.backend.backend() != "tensorflow"
            )
        )

    def _compute_attention(
        self,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any = None,
        training: Any = None,
        return_attention_scores: bool = False,
        use_causal_mask: bool = False,
    ) -> tuple[Any, Any]:
        """Attention on the projected, mapped heads (MHA's override point).

        Args:
            query: (B, N, H, d), the mapped queries q~.
            key: (B, M, G, d), the mapped keys k~.
            value: (B, M, G, d_v).
            attention_mask: boolean (True = may attend), (N, M), (B, N, M) or
                (B|1, H|1, N|1, M|1); None hides nothing.
            training: enables dropout.
            return_attention_scores: return the probabilities too.
            use_causal_mask: top-left causal, combined with ``attention_mask``.

        Returns:
            ``(output (B, N, H, d_v), probabilities (B, H, N, M) or None)``.
        """
        if self._flash_attention and return_attention_scores:
            raise DamchaValueError(
                "Returning attention scores is not supported when flash attention is enabled. Please "
                "disable flash attention to access attention scores. Received: return_attention_scores=True, "
                f"flash_attention={self._flash_attention!r}"
            )
        query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
        visible = None if attention_mask is None else F.as_4d(ops.cast(attention_mask, "bool"))
        causal_only = bool(use_causal_mask) and visible is None
        if use_causal_mask and visible is not None:
            causal = F.visibility(ops.shape(query)[1], ops.shape(key)[1], causal=True)
            visible = ops.logical_and(visible, causal)
        dropping = self._dropout > 0 and bool(training)
        explicit = self._explicit(query, training, return_attention_scores)
        dropout = (lambda p: self._dropout_layer(p, training=training)) if dropping else None
        return F.attend(
            query,
            key,
            value,
            visible,
            scale=self._built_config.softmax_scale,
            causal_only=causal_only,
            explicit=explicit,
            dropout=dropout,
            flash_attention=self._flash_attention,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Keras's own __call__ rejects nested lists with a ValueError of its own;
        # name the argument instead (tensors and NumPy arrays pass unchanged).
        named = dict(zip(("query", "value", "key"), args))
        named.update({k: kwargs[k] for k in ("query", "value", "key") if k in kwargs})
        for name, value in named.items():
            # None: only key may be left out (it defaults to value); a built layer read
            # None's shape (a raw AttributeError), Keras's MHA names the input.
            if isinstance(value, (list, tuple)) or (value is None and name != "key"):
                raise DamchaTypeError(
                    dc.invalid_argument(
                        name, "a tensor or a NumPy array, (batch, length, features)", f"{name}={describe(value)}"
                    )
                )
        _args.check_numpy_flags(_args.ATTENTION_FLAGS, args, kwargs)
        query, value = named.get("query"), named.get("value")
        if query is value and query is not None and "key" not in named and self._convert_input_args:
            # One array given as query and value (``layer(x, x)``): Keras converts (and
            # casts) each argument on its own, so ``call`` would get two tensors and not
            # see a self-attention (one map matrix for queries and keys). Converted once,
            # as Keras converts it, it reaches ``call`` as one tensor.
            one = _converted(self, query)
            if one is not query:
                args = tuple(one if a is query else a for a in args)
                kwargs = {k: (one if v is query else v) for k, v in kwargs.items()}
        return super().__call__(*args, **kwargs)

    def call(
        self,
        query: Any,
        value: Any,
        key: Any = None,
        query_mask: Any = None,
        value_mask: Any = None,
        key_mask: Any = None,
        attention_mask: Any = None,
        return_attention_scores: bool = False,
        training: bool | None = None,
        use_causal_mask: bool = False,
        cache: Any = None,
        cache_update_index: Any = None,
    ) -> Any:
        return_attention_scores = _args.flag("return_attention_scores", return_attention_scores)
        use_causal_mask = _args.flag("use_causal_mask", use_causal_mask)
        training = _args.training_flag(training)
        if self._flash_attention and return_attention_scores:
            self._compute_attention(None, None, None, return_attention_scores=True)  # raises
        masks = _masks.as_tensors(
            dict(query_mask=query_mask, value_mask=value_mask, key_mask=key_mask, attention_mask=attention_mask)
        )
        kv_len = self._check_cache(query, value, masks, use_causal_mask, cache, cache_update_index)
        self._check_inputs(query, value, key, masks, kv_len)
        masks, poison, mask_values = _masks.read_masks(masks)
        # The masks are consumed here (as MHA does): the projections must not
        # see them (they do not support masking and would warn).
        for tensor in (query, value, key):
            if tensor is not None:
                set_keras_mask(tensor, None)
        key = value if key is None else key
        layout = self._layout
        q_in, v_in, k_in = layout.fold(query), layout.fold(value), layout.fold(key)
        cfg = self._built_config
        penalties: list = []
        side_q, side_k = dc.side_of(cfg, "q"), dc.side_of(cfg, "k")
        read_only = cache is not None and cache_update_index is None
        # Training on torch: attention saves one mapped block, q~ (k~ where the queries are
        # not mapped), as its recipe (F.saved_as_recipes): what is kept is then MHA's.
        recipes: list | None = [] if cfg.metric == "heads" and F.torch_keeps_recipes() else None
        # Tied self-attention: one map matrix per token for the queries and the keys.
        tied = (
            side_q
            if side_q and side_q == side_k and k_in is q_in and not read_only and self._fast_map(side_q)
            else None
        )
        if tied and v_in is q_in and recipes is None and self._packs_projections(q_in):
            # One product for the projections and the generator (F.packed_self_heads).
            weights = (self._query_dense, self._key_dense, self._value_dense)
            projections = F.map_weights(tuple(x for layer in weights for x in (layer.kernel, layer.bias)))
            q, k, v = F.compiled(F.packed_self_heads, q_in, *self._map_weights(tied), *projections)
        else:
            q, k, v = self._project_and_map(q_in, k_in, v_in, cache, read_only, tied, penalties, recipes)
        if cache is not None and not read_only:
            over = _cache.traced_overflow(cache_update_index, kv_len, static_shape(k)[1])
            if over is not None:
                poison = over if poison is None else ops.logical_or(poison, over)
            cache, k, v = _cache.update_cache(cache, cache_update_index, k, v)
        if penalties:
            # sum / count rather than ops.mean: Keras 3.15's torch mean runs float64 in float32.
            self.add_loss(self._metric_l2 * (ops.sum(ops.stack(penalties)) / len(penalties)))

        with F.saved_as_recipes(recipes) if recipes else contextlib.nullcontext():
            out, scores = self._attend(
                q,
                k,
                v,
                q_in,
                v_in,
                _masks.fold(layout, masks, mask_values, query, value, self._num_heads),
                use_causal_mask=use_causal_mask,
                cache=cache,
                cache_update_index=cache_update_index,
                training=training,
                return_attention_scores=return_attention_scores,
            )
        if self._use_gate:
            out = out * _dense(self._gate_dense, q_in)
        y = _dense(self._output_dense, out)
        if poison is not None:
            y = y + ops.cast(ops.where(poison, float("nan"), 0.0), dtype_name(y))
        y = layout.unfold(y, query)
        scores = layout.unfold_scores(scores, query, value) if return_attention_scores else None
        result: tuple[Any, ...] = (y, scores) if return_attention_scores else (y,)
        if cache is not None:
            result = result + (cache,)
        return result if len(result) > 1 else y

    def _project_and_map(
        self,
        q_in: Any,
        k_in: Any,
        v_in: Any,
        cache: Any,
        read_only: bool,
        tied: str | None,
        penalties: list,
        recipes: list | None,
    ) -> tuple[Any, Any, Any]:
        """q~ (B, N, H, d), k~ (B, M, G, d) and v (B, M, G, d_v): each projection
        by its sublayer, then the maps (``tied``: the side whose one map matrix
        per token maps both the queries and the keys). With a read-only
        ``cache``, k~ and v are the cache's (k~ already mapped)."""
        side_q, side_k = dc.side_of(self._built_config, "q"), dc.side_of(self._built_config, "k")
        q = _dense(self._query_dense, q_in)  # (B, N, H, d)
        if read_only:
            k, v = _cache.read_cache(cache, dtype_name(q))
        else:
            k = _dense(self._key_dense, k_in)  # (B, M, G, d)
            v = _dense(self._value_dense, v_in)  # (B, M, G, d_v)
        if tied:
            if recipes is None:
                q, k = F.compiled(F.map_heads_pair, q_in, *self._map_weights(tied), q, k)
            else:
                matrix = F.map_matrix(q_in, *self._map_weights(tied))
                q, y_q, k = F.apply_map_matrix(matrix, q), q, F.apply_map_matrix(matrix, k)
                recipes.append((q, matrix, y_q))
        else:
            if side_q:
                q = self._apply_map(side_q, q_in, q, penalties, recipes)
            if side_k and not read_only:
                k = self._apply_map(side_k, k_in, k, penalties, recipes)
        return q, k, v

    def _packs_projections(self, tokens: Any) -> bool:
        """Whether a tied self-attention's projections and map may run as one
        product (``F.packed_self_heads``): on JAX (where it was measured), with
        float32/float64 tokens in the compute dtype of the query, key and value
        sublayers, each a plain float ``EinsumDense`` (not quantized, no
        activity regularizer, ``call`` not overridden), whose ``kernel`` (with
        its LoRA update where enabled) and ``bias`` are then all its call uses;
        and at least as many tokens (B*T, known when traced) as features E, so
        that the joined weights' copy (E x the product's width) is no larger than
        the product's output: a decoding step of a few tokens keeps the
        sublayers, where the copy would cost more than the product."""
        if keras.backend.backend() != "jax" or dtype_name(tokens) not in ("float32", "float64"):
            return False
        dims = static_shape(tokens)
        if not all(isinstance(n, int) for n in dims) or math.prod(dims[:-1]) < dims[-1]:
            return False
        return all(
            type(layer).call is keras.layers.EinsumDense.call
            and layer.quantization_mode is None
            and layer.activity_regularizer is None
            and layer.activation in (None, keras.activations.linear)
            and layer.compute_dtype == dtype_name(tokens)
            for layer in (self._query_dense, self._key_dense, self._value_dense)
        )

    def _check_inputs(self, query: Any, value: Any, key: Any, masks: dict[str, Any], kv_len: int | None) -> None:
        """``_args.check_inputs``, once per input signature (shapes and dtypes)."""
        signature = _args.input_signature(query, value, key, masks, kv_len)
        if signature is not None and signature in self._checked:
            return
        _args.check_inputs(self._built_config, self._layout, query, value, key, masks, kv_len)
        if signature is not None:
            if len(self._checked) >= 64:  # bounded: a layer called with ever new shapes
                self._checked.clear()
            self._checked.add(signature)

    # ------------------------------------------------------------ decoding

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """A zero key/value cache (B, 2, L, G, d) for ``call(..., cache=...)``.

        Args:
            batch_size: B.
            max_length: L, the most tokens the cache will hold.
            dtype: the layer's compute dtype (the default). Keras casts every
                floating input of a call, the cache included, to that dtype, so
                a cache of another float dtype would come back converted (and
                break a ``while_loop``/``fori_loop`` carry); it is refused.
        """
        if not self.built:
            raise DamchaValueError("The layer must be built (called once, or `build`) before it can use a cache.")
        return _cache.init_cache(self._built_config, batch_size, max_length, _cache.check_cache_dtype(self, dtype))

    def _check_cache(
        self, query: Any, value: Any, masks: dict[str, Any], use_causal_mask: bool, cache: Any, index: Any
    ) -> int | None:
        if cache is not None:
            if not self.built:
                self.build(tuple(query.shape), tuple(value.shape))
            if self._layout.folded:
                raise DamchaValueError(
                    dc.invalid_argument(
                        "cache",
                        "rank-3 inputs (batch, length, features) beside a cache",
                        f"query.shape={tuple(query.shape)}",
                    )
                )
        return _cache.check_cache(self._built_config, query, value, masks, use_causal_mask, cache, index)

    # ---------------------------------------------------------------- shapes

    def compute_output_shape(self, query_shape: tuple, value_shape: tuple, key_shape: tuple | None = None) -> tuple:
        _args.check_build_shapes(self._attention_axes, query_shape, value_shape, key_shape)
        trailing = self._output_shape or (tuple(query_shape)[-1],)
        return tuple(query_shape)[:-1] + tuple(trailing)

    def compute_output_spec(
        self,
        query: Any,
        value: Any,
        key: Any = None,
        query_mask: Any = None,
        value_mask: Any = None,
        key_mask: Any = None,
        attention_mask: Any = None,
        return_attention_scores: bool = False,
        training: bool | None = None,
        use_causal_mask: bool = False,
        cache: Any = None,
        cache_update_index: Any = None,
    ) -> keras.KerasTensor | tuple[keras.KerasTensor, ...]:
        # Functional models fail at model-building time, not at the first fit.
        return_attention_scores = _args.flag("return_attention_scores", return_attention_scores)
        use_causal_mask = _args.flag("use_causal_mask", use_causal_mask)
        training = _args.training_flag(training)
        if not self.built:
            self.build(tuple(query.shape), tuple(value.shape), None if key is None else tuple(key.shape))
        masks = _masks.as_tensors(
            dict(query_mask=query_mask, value_mask=value_mask, key_mask=key_mask, attention_mask=attention_mask)
        )
        kv_len = self._check_cache(query, value, masks, use_causal_mask, cache, cache_update_index)
        _args.check_inputs(self._built_config, self._layout, query, value, key, masks, kv_len)
        shape = self.compute_output_shape(query.shape, value.shape, None if key is None else key.shape)
        out = keras.KerasTensor(shape, dtype=self.compute_dtype)
        result: tuple = (out,)
        if return_attention_scores:
            kv_shape = tuple(value.shape) if cache is None else (cache.shape[0], cache.shape[2])
            scores = self._layout.scores_shape(tuple(query.shape), kv_shape, self._num_heads)
            result += (keras.KerasTensor(scores, dtype=self.compute_dtype),)
        if cache is not None:
            result += (keras.KerasTensor(cache.shape, dtype=cache.dtype),)
        return result if len(result) > 1 else out

    # -------------------------------------------------------- serialisation

    def get_config(self) -> dict[str, Any]:
        generator = self._metric_generator_arg
        if isinstance(generator, Mapping):
            generator = {side: serialize_generator(g) for side, g in generator.items()}
        elif generator is not None:
            generator = serialize_generator(generator)
        return {
            **super().get_config(),
            "num_heads": self._num_heads,
            "key_dim": self._key_dim,
            "value_dim": self._value_dim,
            "dropout": self._dropout,
            "use_bias": self._use_bias,
            "output_shape": self._output_shape,
            "attention_axes": self._attention_axes,
            "sliding_window": self._sliding_window,
            "flash_attention": self._flash_attention_arg,
            "kernel_initializer": keras.initializers.serialize(self._kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self._bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(self._kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(self._bias_regularizer),
            "kernel_constraint": keras.constraints.serialize(self._kernel_constraint),
            "bias_constraint": keras.constraints.serialize(self._bias_constraint),
            "use_gate": self._use_gate,
            "seed": self.seed,
            "metric": self._metric,
            "metric_rank": self._metric_rank,
            "coupling": self._coupling_arg,
            "num_kv_heads": self._num_kv_heads,
            "scale": self._scale,
            "metric_l2": self._metric_l2,
            "metric_generator": generator,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DamchaAttention:
        config = dict(config)
        generator = config.get("metric_generator")
        if isinstance(generator, Mapping) and "class_name" not in generator:
            config["metric_generator"] = {s: keras.saving.deserialize_keras_object(g) for s, g in generator.items()}
        elif generator is not None:
            config["metric_generator"] = keras.saving.deserialize_keras_object(generator)
        return cls(**config)

    # ---------------------------------------------------- weights

    def set_weights(self, weights: list) -> None:
        """Keras's ``set_weights``; also takes a ``MultiHeadAttention``'s
        ``get_weights()`` list (the projections only, in MHA's order): it sets
        the projections and keeps the metric weights, so with gates 0 the layer
        then computes what that MHA computes."""
        projections = [w for dense in self._mha_sublayers() for w in dense.weights] if self.built else []
        if not projections or len(weights) != len(projections) or len(projections) == len(self.weights):
            super().set_weights(weights)
            return
        for i, (variable, value) in enumerate(zip(projections, weights)):
            if tuple(np.shape(value)) != tuple(variable.shape):
                raise DamchaValueError(
                    dc.invalid_argument(
                        f"weights[{i}]",
                        f"the shape of {variable.path}, {tuple(variable.shape)} (weights in MultiHeadAttention's order)",
                        f"weights[{i}].shape={tuple(np.shape(value))}",
                    )
                )
        for variable, value in zip(projections, weights):
            variable.assign(value)

    def save_own_variables(self, store: Any) -> None:
        """The gates, as Keras saves them, and whether another layer maps with the
        generator (``record_sharing``).

        Keras saves a shared generator once, under the first layer that holds
        it, and loads each object once: a file saved from layers with their own
        generators would load into layers that share one without a word (the
        other layers' generators ignored, other outputs). The layout recorded
        here lets ``load_own_variables`` refuse that file. A generator handed to
        one layer only is not shared, and a clone's copy is its own.
        """
        super().save_own_variables(store)
        record_sharing(store, SHARED_GENERATOR_KEY, self._generators, self)

    def load_own_variables(self, store: Any) -> None:
        """The gates; a file recording the other generator layout (shared vs the
        layer's own) is refused before this layer's gates are assigned. A file
        saved before the layout was recorded loads as before."""
        store, mismatch = read_sharing(store, SHARED_GENERATOR_KEY, self._generators, self)
        if mismatch is not None:
            saved, mine = mismatch
            layout = {
                True: "a generator shared with other layers (handed to each as metric_generator, as stacks "
                "built with share_metric=True share one)",
                False: "a generator of its own",
            }
            build = (
                "pass one generator as metric_generator to every layer, share_metric=True for a stack"
                if saved
                else "each with its own generator, share_metric=False for a stack"
            )
            raise DamchaValueError(
                dc.invalid_argument(
                    "metric_generator",
                    f"the generator layout the weights were saved with: {layout[saved]}. Keras saves a shared "
                    "generator once, under the first layer that holds it, so a file saved one way does not fit "
                    f"layers built the other way: build the layers as saved ({build}) before loading it",
                    f"layer {self.path!r} built with {layout[mine]}",
                )
            )
        super().load_own_variables(store)

    def _mha_sublayers(self) -> list[keras.layers.EinsumDense]:
        gate = [self._gate_dense] if self._use_gate else []
        return [self._query_dense, self._key_dense, *gate, self._value_dense, self._output_dense]

    # ---------------------------------------------------- canonical weights

    def _projections(self) -> dict[str, keras.layers.EinsumDense]:
        """The four projections under their canonical names."""
        return {
            "query": self._query_dense,
            "key": self._key_dense,
            "value": self._value_dense,
            "output": self._output_dense,
        }

    def canonical_variables(self) -> dict[str, Any]:
        """Canonical name -> ``keras.Variable``, in canonical order (the same
        variable object appears once per name, even for a shared generator)."""
        return _canonical.canonical_variables(self)

    def to_canonical(self) -> dict[str, np.ndarray]:
        """The weights as canonical NumPy arrays (the variables' dtype); with
        ``self.config`` they load into any DAMCHA backend or ``damcha_core``."""
        return _canonical.to_canonical(self)

    def load_canonical(self, params: Mapping[str, Any]) -> DamchaAttention:
        """Assign canonical params (validated against ``self.config``) to this
        built layer; returns the layer."""
        _canonical.load_canonical(self, params)
        return self

    def save(self, path: str | os.PathLike) -> None:
        """Write the weights and config as DAMCHA safetensors (``damcha_core.save_params``).

        (``keras.Model.save`` writes ``.keras`` files; a layer has no such
        method, so ``save`` here is the canonical file, as in every port.)
        The file holds what computes the outputs: options that change them
        and that the canonical config has no field for are refused
        (``sliding_window``, ``attention_axes``, a multi-axis
        ``output_shape``); training-only options are not written (the
        penalty's ``metric_l2``, initialisers, regularisers): pass them to
        ``load`` (``DamchaAttention.load(path, metric_l2=1e-3)``).
        """
        _canonical.save(self, path)

    def save_canonical(self, path: str | os.PathLike) -> None:
        """Deprecated alias of ``save``."""
        warnings.warn("DamchaAttention.save_canonical is deprecated; use save", DeprecationWarning, stacklevel=2)
        _canonical.save(self, path)

    @classmethod
    def from_canonical(cls, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> DamchaAttention:
        """A built layer holding ``params`` for ``config``.

        Args:
            params: canonical arrays (e.g. ``damcha_core.init_params`` or
                ``load_params``); validated against ``config``.
            config: the ``DamchaConfig`` to build.
            **kwargs: further constructor arguments (``name``, ``dtype``,
                ``metric_l2``, ``metric_generator``, initialisers, ...).
        """
        return _canonical.from_canonical(cls, params, config, **kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike, **kwargs: Any) -> DamchaAttention:
        """``from_canonical`` on a DAMCHA safetensors file."""
        return _canonical.load(cls, path, **kwargs)

    @classmethod
    def from_mha(cls, layer: keras.layers.MultiHeadAttention, **kwargs: Any) -> DamchaAttention:
        """An exact conversion of a built ``keras.layers.MultiHeadAttention``.

        The projections are copied; the metric generator is freshly
        initialised and the gates are 0, so outputs equal the MHA's (except
        for fully masked query rows, where DAMCHA outputs the bias).

        Args:
            layer: a built ``MultiHeadAttention`` or ``GroupQueryAttention``
                (its gate, sliding window, ``output_shape``,
                ``attention_axes`` and flash choice are carried over).
            **kwargs: DAMCHA options and overrides (``metric``, ``coupling``,
                ``metric_rank``, ``seed``, ``name``, ...).
        """
        return _convert.from_mha(cls, layer, **kwargs)
