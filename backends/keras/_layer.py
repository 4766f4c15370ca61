"""DamchaAttention: a drop-in for keras.layers.MultiHeadAttention, written with keras.ops.

This module holds the layer: argument validation, building the sublayers and
variables, and ``call``, which runs the projections (sublayers) and the math
of ``_functional``. The cache (``_cache``), canonical I/O (``_canonical``)
and MHA conversion (``_convert``) live in their own modules.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import numpy as np

import keras
from keras import ops

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe

from . import _cache, _canonical, _convert
from . import _functional as F
from ._cache import FLOAT_DTYPES, static_shape
from ._functional import dtype_name
from ._generator import MetricGenerator, serialize_generator

_MASK_EXPECTED = (
    "boolean or integer (True / non-zero = may attend, as Keras MHA reads them); a float mask is refused "
    "because an additive 0/-inf mask would be read inverted"
)


def _is_mask_dtype(m: Any) -> bool:
    name = dtype_name(m)
    return name == "bool" or name.startswith(("int", "uint"))


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

    Args:
        num_heads: H, number of query heads.
        key_dim: d, size of each query/key head.
        value_dim: d_v, size of each value head; defaults to ``key_dim``.
        dropout: attention-probability dropout, training only.
        use_bias: whether the four projections have biases.
        output_shape: E_o, an int or a 1-tuple; defaults to the query's
            feature size. (Multi-dimensional output shapes are not supported.)
        flash_attention: passed to ``keras.ops.dot_product_attention``.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as in MHA, for the four projections.
        seed: seeds the dropout and the metric generator's initialiser.
        metric: "heads" (default), "lowrank" or "none" (exactly MHA).
        metric_rank: r, required with ``metric="lowrank"``.
        coupling: "tied" (default; one map for queries and keys), "separate"
            or "query" (queries only; works with GQA/MQA).
        num_kv_heads: G, key/value heads; must divide ``num_heads``.
        scale: softmax scale; ``None`` means ``1/sqrt(key_dim)``.
        metric_l2: coefficient of the metric penalty added with ``add_loss``
            (mean of ||L(t) - I||_F^2 / (S*d) over tokens and sides).
        metric_generator: a ``MetricGenerator`` shared with other layers
            (stack-wise sharing), or for ``coupling="separate"`` a dict
            ``{"q": ..., "k": ...}``; ``None`` creates the layer's own.
        **kwargs: base ``keras.layers.Layer`` arguments (name, dtype, ...).

    Call arguments:
        query: (B, N, E_q).
        value: (B, M, E_kv).
        key: optional (B, M, E_kv); defaults to ``value``. It feeds the key
            projection and the key-side metric.
        query_mask: bool (B, N); False rows see no key and output 0 before
            the output projection. Filled from the query's Keras mask.
        value_mask, key_mask: bool (B, M); False keys are hidden.
        attention_mask: bool (B, N, M), (N, M) or (B, H, N, M) (size-1 dims
            broadcast), True = may attend.
        return_attention_scores: also return probabilities (B, H, N, M).
        training: enables dropout.
        use_causal_mask: hide key j from query i when j > i (top-left); with
            a cache, j > cache_update_index + i (bottom-right).
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

    Returns:
        (B, N, E_o), or ``(output, scores)``; with a cache, the updated cache
        is appended: ``(output, cache)`` or ``(output, scores, cache)``. A query
        that may attend to no key gets attention output 0 (not NaN, not
        uniform as in MHA), so its output is the output bias.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | tuple[int] | None = None,
        flash_attention: bool | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        seed: int | None = None,
        *,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str = "tied",
        num_kv_heads: int | None = None,
        scale: float | None = None,
        metric_l2: float = 0.0,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.supports_masking = True
        if output_shape is not None and not isinstance(output_shape, int):
            try:
                output_shape = tuple(output_shape)
            except TypeError:
                output_shape = (output_shape,)
            if len(output_shape) != 1:
                raise DamchaValueError(
                    "`output_shape` must be an int or a 1-tuple (DAMCHA projects to one feature axis, "
                    f"output.kernel (H, d_v, E_o)). Received: output_shape={describe(output_shape)}"
                )
            output_shape = output_shape[0]
        # A probe config applies the reference's rules to every hyper-parameter now,
        # so a bad argument fails at construction, not at the first call.
        probe = DamchaConfig(
            query_dim=1, num_heads=num_heads, key_dim=key_dim, value_dim=value_dim,
            num_kv_heads=num_kv_heads, output_dim=output_shape, use_bias=use_bias,
            metric=metric, metric_rank=metric_rank, coupling=coupling, scale=scale, dropout=dropout,
        )
        if isinstance(metric_l2, bool) or not isinstance(metric_l2, (int, float)) or not (metric_l2 >= 0 and np.isfinite(metric_l2)):
            raise DamchaValueError(f"`metric_l2` must be a finite number >= 0. Received: metric_l2={describe(metric_l2)}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise DamchaTypeError(f"`seed` must be an int or None. Received: seed={describe(seed)}")
        self._probe = probe
        self._num_heads = probe.num_heads
        self._key_dim = probe.key_dim
        self._value_dim = probe.value_dim
        self._num_kv_heads = probe.num_kv_heads
        self._dropout = probe.dropout
        self._use_bias = use_bias
        self._output_dim = None if output_shape is None else probe.output_dim
        self._flash_attention = flash_attention
        self._metric = metric
        self._metric_rank = probe.metric_rank
        self._coupling = coupling
        self._scale = probe.scale
        self._metric_l2 = float(metric_l2)
        self.seed = seed
        self._kernel_initializer = keras.initializers.get(kernel_initializer)
        self._bias_initializer = keras.initializers.get(bias_initializer)
        self._kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self._bias_regularizer = keras.regularizers.get(bias_regularizer)
        self._kernel_constraint = keras.constraints.get(kernel_constraint)
        self._bias_constraint = keras.constraints.get(bias_constraint)
        self._shared_generators = self._check_generators(metric_generator, probe)
        self._metric_generator_arg = metric_generator
        self._dropout_layer = keras.layers.Dropout(rate=probe.dropout, seed=seed, dtype=self.dtype_policy)
        self.config: DamchaConfig | None = None
        # Set by from_canonical/from_mha, whose values overwrite the initial ones:
        # zeros skip the random draws (slow to compile per shape on JAX).
        self._zero_init = False

    # ------------------------------------------------------------ properties

    num_heads = property(lambda self: self._num_heads)
    key_dim = property(lambda self: self._key_dim)
    value_dim = property(lambda self: self._value_dim)
    num_kv_heads = property(lambda self: self._num_kv_heads)
    dropout = property(lambda self: self._dropout)
    use_bias = property(lambda self: self._use_bias)
    metric = property(lambda self: self._metric)
    coupling = property(lambda self: self._coupling)
    metric_l2 = property(lambda self: self._metric_l2)
    query_dense = property(lambda self: self._query_dense)
    key_dense = property(lambda self: self._key_dense)
    value_dense = property(lambda self: self._value_dense)
    output_dense = property(lambda self: self._output_dense)

    @property
    def metric_gates(self) -> dict[str, Any]:
        """The gate variable (S,) of each metric side; empty before build and for metric "none"."""
        return dict(self._gates) if self.built else {}

    @property
    def metric_generators(self) -> dict[str, MetricGenerator]:
        """The generator of each metric side ("qk", or "q"/"k"); empty for metric "none"."""
        return dict(self._generators) if self.built else dict(self._shared_generators)

    def _check_generators(self, given: Any, probe: DamchaConfig) -> dict[str, MetricGenerator]:
        sides = probe.metric_sides
        if given is None:
            return {}
        if not sides:
            raise DamchaValueError("`metric_generator` must be None with metric='none'. Received: "
                                   f"metric_generator={describe(given)}")
        if isinstance(given, MetricGenerator):
            if len(sides) != 1:
                raise DamchaValueError(
                    "with coupling='separate' pass `metric_generator` as a dict {'q': ..., 'k': ...}. "
                    f"Received: metric_generator={describe(given)}"
                )
            return {sides[0]: given}
        if isinstance(given, Mapping) and set(given) == set(sides) and all(isinstance(g, MetricGenerator) for g in given.values()):
            return dict(given)
        raise DamchaTypeError(
            f"`metric_generator` must be a MetricGenerator (or a dict with keys {list(sides)} of them) or None. "
            f"Received: metric_generator={describe(given)}"
        )

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
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape is None:
                continue
            if len(shape) != 3 or shape[-1] is None:
                raise DamchaValueError(
                    f"`{name}` must have rank 3, (batch, length, features), with a known feature size. "
                    f"Received: {name}.shape={tuple(shape)}"
                )
        if key_shape is not None and key_shape[-1] != value_shape[-1]:
            raise DamchaValueError(
                "`key` and `value` must have the same feature size (DAMCHA has one context size, "
                f"context_dim). Received: key.shape={tuple(key_shape)}, value.shape={tuple(value_shape)}"
            )
        E_q, E_kv = int(query_shape[-1]), int(value_shape[-1])
        self.config = self._probe.replace(
            query_dim=E_q, context_dim=E_kv, output_dim=self._output_dim if self._output_dim else E_q
        )
        cfg = self.config
        H, G, d, d_v = cfg.num_heads, cfg.num_kv_heads, cfg.key_dim, cfg.value_dim
        dense = lambda equation, shape, axes, name: keras.layers.EinsumDense(  # noqa: E731
            equation, output_shape=shape, bias_axes=axes if self._use_bias else None, name=name, **self._dense_kwargs()
        )
        # Attribute names and sublayer names as Keras MHA's, so weight paths match.
        self._query_dense = dense("abc,cde->abde", (None, H, d), "de", "query")
        self._key_dense = dense("abc,cde->abde", (None, G, d), "de", "key")
        self._value_dense = dense("abc,cde->abde", (None, G, d_v), "de", "value")
        self._output_dense = dense("abcd,cde->abe", (None, cfg.output_dim), "e", "attention_output")
        self._query_dense.build(tuple(query_shape))
        self._key_dense.build(tuple(key_shape if key_shape is not None else value_shape))
        self._value_dense.build(tuple(value_shape))
        self._output_dense.build((None, None, H, d_v))
        self._generators: dict[str, MetricGenerator] = {}
        self._gates: dict[str, Any] = {}
        for i, side in enumerate(cfg.metric_sides):
            S, E = cfg.side_heads(side), cfg.side_features(side)
            generator = self._shared_generators.get(side)
            if generator is None:
                generator = MetricGenerator(
                    S, metric=cfg.metric, key_dim=d, metric_rank=cfg.metric_rank,
                    seed=None if self.seed is None else self.seed + 101 * (i + 1),
                    name=f"metric_{side}", dtype=self.dtype_policy,
                )
                generator._zero_init = self._zero_init
            generator.check_compatible(E, S, d, cfg.metric, cfg.metric_rank, self.name)
            if not generator.built:
                generator.build((None, None, E))
            self._generators[side] = generator
            # The gate is per layer even when the generator is shared; 0 = exactly MHA.
            self._gates[side] = self.add_weight(name=f"metric_{side}_gate", shape=(S,), initializer="zeros")
        self.built = True

    # ----------------------------------------------------------- validation

    def _check_inputs(self, query: Any, value: Any, key: Any, masks: dict[str, Any], kv_len: int | None = None) -> None:
        for name, x in (("query", query), ("value", value), ("key", key)):
            if x is not None and dtype_name(x) not in FLOAT_DTYPES:
                raise dc.float_dtype_error(name, x)
        for name, m in masks.items():
            if m is not None and not _is_mask_dtype(m):
                raise dc.mask_dtype_error(m, name, _MASK_EXPECTED)
        qs, vs = static_shape(query), static_shape(value)
        cfg = self.config
        # The layer's own argument names (value, key), not damcha_core's (context).
        for name, x, features in (("query", query, cfg.query_dim), ("value", value, cfg.context_dim),
                                  ("key", key, cfg.context_dim)):
            if x is None:
                continue
            shape = static_shape(x)
            if len(shape) != 3:
                raise DamchaValueError(
                    f"`{name}` must have rank 3, (batch, length, features). Received: {name}.shape={tuple(x.shape)}"
                )
            if shape[-1] is not None and shape[-1] != features:  # None: traced (e.g. torch ONNX export)
                raise DamchaValueError(
                    f"`{name}` must have {features} features, the size the layer was built with. "
                    f"Received: {name}.shape={tuple(x.shape)}"
                )
        if qs[0] is not None and vs[0] is not None and qs[0] != vs[0]:
            raise DamchaValueError(
                "`query` and `value` must have the same batch size. "
                f"Received: query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}"
            )
        if key is not None:
            ks = static_shape(key)
            if len(ks) != 3 or len(vs) != 3 or any(
                a is not None and b is not None and a != b for a, b in zip(ks[:2], vs[:2])
            ):
                raise DamchaValueError(
                    "`key` must have the same (batch, length) as `value`. "
                    f"Received: key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
                )
        # Unknown (symbolic) dims take the value the other tensors imply, so only
        # real contradictions are reported by the shared shape rules.
        B = next((s for s in (qs[0] if qs else None, vs[0] if vs else None) if s is not None), 1)
        fill = lambda shape, dims: tuple(dims[i] if s is None else s for i, s in enumerate(shape))  # noqa: E731
        N = qs[1] if len(qs) > 1 and qs[1] is not None else 1
        M = vs[1] if len(vs) > 1 and vs[1] is not None else 1
        qs = fill(qs, (B, N, cfg.query_dim)) if len(qs) == 3 else qs
        vs = fill(vs, (B, M, cfg.context_dim)) if len(vs) == 3 else vs
        dc.check_shapes(self.config, qs, vs)
        if kv_len is not None:
            M = kv_len  # with a cache, masks span its L slots
        H = self._num_heads
        for name, m, rank_shapes in (
            ("query_mask", masks.get("query_mask"), {2: (B, N)}),
            ("value_mask", masks.get("value_mask"), {2: (B, M)}),
            ("key_mask", masks.get("key_mask"), {2: (B, M)}),
            ("attention_mask", masks.get("attention_mask"), {2: (N, M), 3: (B, N, M), 4: (B, H, N, M)}),
        ):
            if m is None:
                continue
            shape = static_shape(m)
            target = rank_shapes.get(len(shape))
            broadcastable = name == "attention_mask"
            if target is None or any(
                s is not None and s != t and not (broadcastable and s == 1) for s, t in zip(shape, target)
            ):
                expected = " or ".join(str(t) for t in rank_shapes.values())
                extra = " (size-1 dims broadcast)" if broadcastable else ""
                raise DamchaValueError(
                    f"`{name}` must have shape {expected}{extra} for query.shape={tuple(query.shape)}, "
                    f"value.shape={tuple(value.shape)}. Received: {name}.shape={shape}"
                )

    # ------------------------------------------------------------------ math

    def _apply_map(self, side: str, tokens: Any, y: Any, penalties: list) -> Any:
        """L(t) y of ``side`` for stacked heads y (B, T, S, d)."""
        generator = self._generators[side]
        coeff = generator.call(tokens)
        gate = self._gates[side]
        u, v = (generator.u, generator.v) if self.config.metric == "lowrank" else (None, None)
        if self._metric_l2 > 0:
            penalties.append(F.metric_penalty(self.config, side, coeff, gate, u, v))
        return F.apply_map(y, coeff, gate, metric=self.config.metric, u=u, v=v)

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
        masks = dict(query_mask=query_mask, value_mask=value_mask, key_mask=key_mask, attention_mask=attention_mask)
        for name, flag in (("return_attention_scores", return_attention_scores), ("use_causal_mask", use_causal_mask)):
            if not isinstance(flag, (bool, np.bool_)):
                raise DamchaTypeError(f"`{name}` must be a bool. Received: {name}={describe(flag)}")
        kv_len = self._check_cache(query, value, masks, use_causal_mask, cache, cache_update_index)
        self._check_inputs(query, value, key, masks, kv_len)
        # As Keras MHA does, an integer mask means non-zero = may attend.
        query_mask, value_mask, key_mask, attention_mask = (
            m if m is None or dtype_name(m) == "bool" else ops.not_equal(m, 0) for m in masks.values()
        )
        if key is None:
            key = value
        cfg = self.config
        # Sublayers are invoked through .call: this layer already cast the inputs and
        # consumed their Keras masks, which plain projections would warn about.
        q = self._query_dense.call(query)  # (B, N, H, d)
        penalties: list = []
        side_q, side_k = dc.side_of(cfg, "q"), dc.side_of(cfg, "k")
        if side_q:
            q = self._apply_map(side_q, query, q, penalties)
        if cache is not None and cache_update_index is None:
            k, v = _cache.read_cache(cache, dtype_name(q))  # read-only: k~ already mapped
        else:
            k = self._key_dense.call(key)  # (B, M, G, d)
            v = self._value_dense.call(value)  # (B, M, G, d_v)
            if side_k:
                k = self._apply_map(side_k, key, k, penalties)
            if cache is not None:
                cache, k, v = _cache.update_cache(cache, cache_update_index, k, v)
        if penalties:
            self.add_loss(self._metric_l2 * ops.mean(ops.stack(penalties)))

        n, m = ops.shape(query)[1], ops.shape(value)[1]
        n_static, m_static = static_shape(query)[1], static_shape(value)[1]
        causal_only = (
            use_causal_mask and query_mask is None and value_mask is None and key_mask is None
            and attention_mask is None and n_static is not None and n_static == m_static and cache is None
        )
        if cache is not None:
            visible = _cache.cache_visibility(n, m, cache, cache_update_index, query_mask=query_mask,
                                              attention_mask=attention_mask, use_causal_mask=use_causal_mask)
        elif causal_only:
            visible = None
        else:
            visible = F.visibility(n, m, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                                   attention_mask=attention_mask, causal=use_causal_mask)
        # float64 avoids dot_product_attention: Keras 3.15's torch backend computes it
        # in float32 (its result_type misreads torch dtypes), silently losing precision.
        # value_dim != key_dim too: jax.nn.dot_product_attention rejects it and Keras
        # logs an error before falling back.
        explicit = (
            return_attention_scores
            or (self._dropout > 0 and bool(training))
            or dtype_name(q) == "float64"
            or cfg.value_dim != cfg.key_dim
        )
        dropout = (lambda p: self._dropout_layer(p, training=training)) if self._dropout > 0 else None
        out, scores = F.attend(q, k, v, visible, scale=cfg.softmax_scale, causal_only=causal_only,
                               explicit=explicit, dropout=dropout, flash_attention=self._flash_attention)
        y = self._output_dense.call(out)
        result = (y, scores) if return_attention_scores else (y,)
        if cache is not None:
            result = result + (cache,)
        return result if len(result) > 1 else y

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
        return _cache.init_cache(self.config, batch_size, max_length, _cache.check_cache_dtype(self, dtype))

    def _check_cache(self, query: Any, value: Any, masks: dict[str, Any], use_causal_mask: bool,
                     cache: Any, index: Any) -> int | None:
        if cache is not None and not self.built:
            self.build(tuple(query.shape), tuple(value.shape))
        return _cache.check_cache(self.config, query, value, masks, use_causal_mask, cache, index)

    def compute_output_shape(self, query_shape: tuple, value_shape: tuple, key_shape: tuple | None = None) -> tuple:
        E_o = self._output_dim if self._output_dim else query_shape[-1]
        return tuple(query_shape[:-1]) + (E_o,)

    def compute_output_spec(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
                            attention_mask=None, return_attention_scores=False, training=None, use_causal_mask=False,
                            cache=None, cache_update_index=None):
        # Functional models fail at model-building time, not at the first fit.
        masks = dict(query_mask=query_mask, value_mask=value_mask, key_mask=key_mask, attention_mask=attention_mask)
        kv_len = self._check_cache(query, value, masks, use_causal_mask, cache, cache_update_index)
        self._check_inputs(query, value, key, masks, kv_len)
        out = keras.KerasTensor(self.compute_output_shape(query.shape, value.shape), dtype=self.compute_dtype)
        result: tuple = (out,)
        if return_attention_scores:
            M = value.shape[1] if cache is None else cache.shape[2]
            result += (keras.KerasTensor((query.shape[0], self._num_heads, query.shape[1], M), dtype=self.compute_dtype),)
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
            "output_shape": self._output_dim,
            "flash_attention": self._flash_attention,
            "kernel_initializer": keras.initializers.serialize(self._kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self._bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(self._kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(self._bias_regularizer),
            "kernel_constraint": keras.constraints.serialize(self._kernel_constraint),
            "bias_constraint": keras.constraints.serialize(self._bias_constraint),
            "seed": self.seed,
            "metric": self._metric,
            "metric_rank": self._metric_rank,
            "coupling": self._coupling,
            "num_kv_heads": self._num_kv_heads,
            "scale": self._scale,
            "metric_l2": self._metric_l2,
            "metric_generator": generator,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DamchaAttention":
        config = dict(config)
        generator = config.get("metric_generator")
        if isinstance(generator, Mapping) and "class_name" not in generator:
            config["metric_generator"] = {s: keras.saving.deserialize_keras_object(g) for s, g in generator.items()}
        elif generator is not None:
            config["metric_generator"] = keras.saving.deserialize_keras_object(generator)
        return cls(**config)

    # ---------------------------------------------------- canonical weights

    def canonical_variables(self) -> dict[str, Any]:
        """Canonical name -> ``keras.Variable``, in canonical order (the same
        variable object appears once per name, even for a shared generator)."""
        return _canonical.canonical_variables(self)

    def to_canonical(self) -> dict[str, np.ndarray]:
        """The weights as canonical NumPy arrays (the variables' dtype); with
        ``self.config`` they load into any DAMCHA backend or ``damcha_core``."""
        return _canonical.to_canonical(self)

    def load_canonical(self, params: Mapping[str, Any]) -> "DamchaAttention":
        """Assign canonical params (validated against ``self.config``) to this
        built layer; returns the layer."""
        _canonical.load_canonical(self, params)
        return self

    def save(self, path: str) -> None:
        """Write the weights and config as DAMCHA safetensors (``damcha_core.save_params``).

        (``keras.Model.save`` writes ``.keras`` files; a layer has no such
        method, so ``save`` here is the canonical file, as in every port.)
        """
        _canonical.save(self, path)

    def save_canonical(self, path: str) -> None:
        """Deprecated alias of ``save``."""
        warnings.warn("DamchaAttention.save_canonical is deprecated; use save", DeprecationWarning, stacklevel=2)
        _canonical.save(self, path)

    @classmethod
    def from_canonical(cls, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> "DamchaAttention":
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
    def load(cls, path: str, **kwargs: Any) -> "DamchaAttention":
        """``from_canonical`` on a DAMCHA safetensors file."""
        return _canonical.load(cls, path, **kwargs)

    @classmethod
    def from_mha(cls, layer: keras.layers.MultiHeadAttention, **kwargs: Any) -> "DamchaAttention":
        """An exact conversion of a built ``keras.layers.MultiHeadAttention``.

        The projections are copied; the metric generator is freshly
        initialised and the gates are 0, so outputs equal the MHA's (except
        for fully masked query rows, where DAMCHA outputs the bias).

        Args:
            layer: a built MHA with rank-3 inputs, no gate, no sliding window
                and a 1-D ``output_shape``.
            **kwargs: DAMCHA options and overrides (``metric``, ``coupling``,
                ``metric_rank``, ``seed``, ``name``, ...).
        """
        return _convert.from_mha(cls, layer, **kwargs)
