"""DamchaAttention: a drop-in for keras.layers.MultiHeadAttention, written with keras.ops."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

import keras
from keras import ops

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe

from ._generator import MetricGenerator, serialize_generator

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# Keras names of the four projections, in canonical order.
_DENSE_NAMES = {"query": "query", "key": "key", "value": "value", "output": "attention_output"}


def _dtype_name(x: Any) -> str:
    return keras.backend.standardize_dtype(x.dtype)


_MASK_EXPECTED = (
    "boolean or integer (True / non-zero = may attend, as Keras MHA reads them); a float mask is refused "
    "because an additive 0/-inf mask would be read inverted"
)


def _is_mask_dtype(m: Any) -> bool:
    name = _dtype_name(m)
    return name == "bool" or name.startswith(("int", "uint"))


def _static_shape(x: Any) -> tuple:
    """x's shape with every dim that is not a plain int as None.

    Symbolic dims (jax2tf's shape polymorphism in ``model.export`` on JAX,
    torch SymInts) cannot be compared or converted to int: checks skip them,
    as they skip a None dim of a ``keras.Input``.
    """
    return tuple(int(s) if isinstance(s, (int, np.integer)) else None for s in x.shape)


def _concrete_int(value: Any) -> int | None:
    """The value of an int or a concrete int tensor; None when traced (jit, tf.function)."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        return int(np.asarray(ops.convert_to_numpy(value)))
    except Exception:  # a tracer or symbolic tensor: its value is not known yet
        return None


def _side_of(config: DamchaConfig, role: str) -> str | None:
    return dc.side_of(config, role)


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
    query_dense = property(lambda self: self._dense["query"])
    key_dense = property(lambda self: self._dense["key"])
    value_dense = property(lambda self: self._dense["value"])
    output_dense = property(lambda self: self._dense["output"])

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
        bias = (lambda axes: axes if self._use_bias else None)
        self._dense = {
            "query": keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, H, d), bias_axes=bias("de"), name="query", **self._dense_kwargs()),
            "key": keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, G, d), bias_axes=bias("de"), name="key", **self._dense_kwargs()),
            "value": keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, G, d_v), bias_axes=bias("de"), name="value", **self._dense_kwargs()),
            "output": keras.layers.EinsumDense("abcd,cde->abe", output_shape=(None, cfg.output_dim), bias_axes=bias("e"), name="attention_output", **self._dense_kwargs()),
        }
        self._dense["query"].build(tuple(query_shape))
        self._dense["key"].build(tuple(key_shape if key_shape is not None else value_shape))
        self._dense["value"].build(tuple(value_shape))
        self._dense["output"].build((None, None, H, d_v))
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
            if x is not None and _dtype_name(x) not in _FLOAT_DTYPES:
                raise dc.float_dtype_error(name, x)
        for name, m in masks.items():
            if m is not None and not _is_mask_dtype(m):
                raise dc.mask_dtype_error(m, name, _MASK_EXPECTED)
        qs, vs = _static_shape(query), _static_shape(value)
        cfg = self.config
        # The layer's own argument names (value, key), not damcha_core's (context).
        for name, x, features in (("query", query, cfg.query_dim), ("value", value, cfg.context_dim),
                                  ("key", key, cfg.context_dim)):
            if x is None:
                continue
            shape = _static_shape(x)
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
            ks = _static_shape(key)
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
            shape = _static_shape(m)
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
        """L(t) y for stacked heads y (B, T, S, d), without forming L."""
        cfg = self.config
        generator = self._generators[side]
        coeff = generator.call(tokens)
        gate = ops.cast(self._gates[side], y.dtype)
        coeff = ops.cast(coeff, y.dtype)
        if cfg.metric == "heads":
            delta = ops.einsum("btha,btad->bthd", coeff, y)
        else:
            v = ops.cast(generator.v, y.dtype)
            u = ops.cast(generator.u, y.dtype)
            z = ops.einsum("btad,adr->btr", y, v)
            delta = ops.einsum("hdr,btr->bthd", u, coeff * z)
        if self._metric_l2 > 0:
            penalties.append(self._penalty(side, coeff, gate))
        return y + gate[:, None] * delta

    def _penalty(self, side: str, coeff: Any, gate: Any) -> Any:
        # Mean over tokens of ||L(t) - I||_F^2 / (S*d): damcha_core's formula, in float32.
        params = {f"metric.{side}.gate": ops.cast(gate, "float32")}
        if self.config.metric == "lowrank":
            generator = self._generators[side]
            params[f"metric.{side}.u"] = ops.cast(generator.u, "float32")
            params[f"metric.{side}.v"] = ops.cast(generator.v, "float32")
        return dc.role_penalty(ops, params, self.config, side, ops.cast(coeff, "float32"))

    def _visibility(self, query: Any, value: Any, query_mask, value_mask, key_mask, attention_mask, use_causal_mask):
        """Boolean (B|1, H|1, N|1, M|1) True = may attend, or None if nothing is hidden."""
        parts = []
        if attention_mask is not None:
            while len(attention_mask.shape) < 4:  # Keras convention: (N, M) -> (1, N, M) -> (1, 1, N, M)
                attention_mask = ops.expand_dims(attention_mask, -3)
            parts.append(attention_mask)
        if query_mask is not None:
            parts.append(query_mask[:, None, :, None])
        for m in (value_mask, key_mask):
            if m is not None:
                parts.append(m[:, None, None, :])
        if use_causal_mask:
            n, m = ops.shape(query)[1], ops.shape(value)[1]
            rows = ops.expand_dims(ops.arange(n, dtype="int32"), 1)
            cols = ops.expand_dims(ops.arange(m, dtype="int32"), 0)
            parts.append(ops.greater_equal(rows, cols)[None, None])
        if not parts:
            return None
        visible = parts[0]
        for p in parts[1:]:
            visible = ops.logical_and(visible, p)
        return visible

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
            m if m is None or _dtype_name(m) == "bool" else ops.not_equal(m, 0) for m in masks.values()
        )
        if key is None:
            key = value
        cfg = self.config
        # Sublayers are invoked through .call: this layer already cast the inputs and
        # consumed their Keras masks, which plain projections would warn about.
        q = self._dense["query"].call(query)  # (B, N, H, d)
        penalties: list = []
        side_q, side_k = _side_of(cfg, "q"), _side_of(cfg, "k")
        if side_q:
            q = self._apply_map(side_q, query, q, penalties)
        if cache is not None and cache_update_index is None:
            k, v = ops.cast(cache[:, 0], q.dtype), ops.cast(cache[:, 1], q.dtype)  # read-only: k~ already mapped
        else:
            k = self._dense["key"].call(key)  # (B, M, G, d)
            v = self._dense["value"].call(value)  # (B, M, G, d_v)
            if side_k:
                k = self._apply_map(side_k, key, k, penalties)
            if cache is not None:
                start = [0, cache_update_index, 0, 0]
                k = ops.slice_update(cache[:, 0], start, ops.cast(k, cache.dtype))
                v = ops.slice_update(cache[:, 1], start, ops.cast(v, cache.dtype))
                cache = ops.stack([k, v], axis=1)
                k, v = ops.cast(k, q.dtype), ops.cast(v, q.dtype)
        if penalties:
            self.add_loss(self._metric_l2 * ops.mean(ops.stack(penalties)))
        if cfg.group_size > 1:
            # Query head h reads kv head h // (H/G); repeating keeps every backend's
            # dot_product_attention on its plain MHA path.
            k = ops.repeat(k, cfg.group_size, axis=2)
            v = ops.repeat(v, cfg.group_size, axis=2)

        n_static, m_static = _static_shape(query)[1], _static_shape(value)[1]
        causal_only = (
            use_causal_mask and query_mask is None and value_mask is None and key_mask is None
            and attention_mask is None and n_static is not None and n_static == m_static and cache is None
        )
        if cache is not None:
            visible = self._cache_visibility(query, value, query_mask, attention_mask, use_causal_mask,
                                             cache, cache_update_index)
        else:
            visible = None if causal_only else self._visibility(
                query, value, query_mask, value_mask, key_mask, attention_mask, use_causal_mask
            )
        # float64 avoids dot_product_attention: Keras 3.15's torch backend computes it
        # in float32 (its result_type misreads torch dtypes), silently losing precision.
        # value_dim != key_dim too: jax.nn.dot_product_attention rejects it and Keras
        # logs an error before falling back.
        explicit = (
            return_attention_scores
            or (self._dropout > 0 and bool(training))
            or _dtype_name(q) == "float64"
            or cfg.value_dim != cfg.key_dim
        )
        if explicit:
            if causal_only:
                visible = self._visibility(query, value, None, None, None, None, True)
            out, scores = self._explicit_attention(q, k, v, visible, training)
        else:
            out, scores = self._fused_attention(q, k, v, visible, causal_only), None
        y = self._dense["output"].call(out)
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
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise DamchaValueError(f"`{name}` must be an int >= 1. Received: {name}={describe(value)}")
        self._check_cache_layout()
        if dtype is not None:
            wanted = keras.backend.standardize_dtype(dtype)
            if wanted not in _FLOAT_DTYPES:
                raise DamchaTypeError(f"`dtype` of a cache must be a float dtype. Received: dtype={describe(dtype)}")
            if wanted != self.compute_dtype and self.autocast:
                raise DamchaValueError(
                    f"`dtype` of a cache must be the layer's compute dtype {self.compute_dtype!r}: Keras casts "
                    f"floating call inputs to it, so the cache would come back as {self.compute_dtype}. "
                    f"Received: dtype={wanted!r}"
                )
        cfg = self.config
        shape = (int(batch_size), 2, int(max_length), cfg.num_kv_heads, cfg.key_dim)
        return ops.zeros(shape, dtype=dtype or self.compute_dtype)

    def _check_cache_layout(self) -> None:
        if not self.built:
            raise DamchaValueError("The layer must be built (called once, or `build`) before it can use a cache.")
        if self.config.value_dim != self.config.key_dim:
            raise DamchaValueError(
                "A cache stacks keys and values in one (B, 2, L, G, d) tensor, so it needs value_dim == key_dim. "
                f"Received: key_dim={self.config.key_dim}, value_dim={self.config.value_dim}"
            )

    def _check_cache(self, query: Any, value: Any, masks: dict[str, Any], use_causal_mask: bool,
                     cache: Any, index: Any) -> int | None:
        """Validate ``cache`` and ``cache_update_index``; returns the key length L masks span."""
        if cache is None:
            if index is not None:
                raise DamchaValueError(
                    f"`cache_update_index` needs a `cache`. Received: cache=None, cache_update_index={describe(index)}"
                )
            return None
        if not self.built:
            self.build(tuple(query.shape), tuple(value.shape))
        self._check_cache_layout()
        cfg = self.config
        if _dtype_name(cache) not in _FLOAT_DTYPES:
            raise dc.float_dtype_error("cache", cache)
        shape = _static_shape(cache)
        B = _static_shape(query)[0]
        expected = (B, 2, None, cfg.num_kv_heads, cfg.key_dim)
        if len(shape) != 5 or any(e is not None and s is not None and s != e for s, e in zip(shape, expected)):
            raise DamchaValueError(
                f"`cache` must have shape (B, 2, L, G, d) = ({B}, 2, L, {cfg.num_kv_heads}, {cfg.key_dim}). "
                f"Received: cache.shape={shape}"
            )
        for name in ("value_mask", "key_mask"):
            if masks[name] is not None:
                raise DamchaValueError(
                    f"`{name}` is not supported with a cache: it would cover only the new tokens. Pass an "
                    f"`attention_mask` (B, N, L) over the whole cache instead (Keras also fills `{name}` from "
                    f"the tensor's own mask, e.g. Embedding(mask_zero=True)). Received: {name}.shape="
                    f"{tuple(masks[name].shape)}"
                )
        if index is None:
            if use_causal_mask:
                raise DamchaValueError(
                    "`use_causal_mask=True` with a read-only cache needs `cache_update_index` (the position of "
                    "the first new token). Received: cache_update_index=None"
                )
            return shape[2]
        if isinstance(index, bool) or not (isinstance(index, (int, np.integer)) or hasattr(index, "dtype")):
            raise DamchaTypeError(f"`cache_update_index` must be an int or an int scalar tensor. Received: "
                                  f"cache_update_index={describe(index)}")
        if hasattr(index, "dtype") and ("int" not in _dtype_name(index) or len(index.shape) != 0):
            raise DamchaTypeError(f"`cache_update_index` must be an int or an int scalar tensor. Received: "
                                  f"cache_update_index={describe(index)}")
        T, n = _static_shape(value)[1], _static_shape(query)[1]
        if use_causal_mask and T is not None and n is not None and T != n:
            raise DamchaValueError(
                "`use_causal_mask=True` with a cache needs one new key per query token (self-attention "
                f"decoding). Received: query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}"
            )
        start = _concrete_int(index)
        if start is not None and shape[2] is not None and T is not None and not 0 <= start <= shape[2] - T:
            # Under jit the index is traced and slice_update would clamp it silently; here it is known.
            raise DamchaValueError(
                f"`cache_update_index` must be in [0, L - M] = [0, {shape[2] - T}] to write {T} tokens into a "
                f"cache of L={shape[2]}. Received: cache_update_index={start}"
            )
        return shape[2]

    def _cache_visibility(self, query: Any, value: Any, query_mask: Any, attention_mask: Any,
                          use_causal_mask: bool, cache: Any, index: Any) -> Any:
        """(B|1, H|1, N, L) bool over the cache's slots."""
        visible = self._visibility(query, value, query_mask, None, None, attention_mask, False)
        if index is None:
            return visible
        n, L, t = ops.shape(query)[1], ops.shape(cache)[2], ops.shape(value)[1]
        start = ops.cast(index, "int32")
        cols = ops.expand_dims(ops.arange(L, dtype="int32"), 0)
        if use_causal_mask:
            # Query i is token index + i: it sees slots j <= index + i (bottom-right).
            limit = ops.expand_dims(ops.arange(n, dtype="int32"), 1) + start
            slots = ops.less_equal(cols, limit)
        else:
            # Slots at or past index + M were never written: hide them.
            slots = ops.less(cols, start + t)
        slots = slots[None, None]
        return slots if visible is None else ops.logical_and(visible, slots)

    def _scaled(self, q: Any) -> Any:
        # convert_to_tensor with the dtype keeps the scale exact in float64; the
        # TensorFlow backend rounds a Python float scale through float32.
        return q * ops.convert_to_tensor(self.config.softmax_scale, dtype=_dtype_name(q))

    def _fused_attention(self, q: Any, k: Any, v: Any, visible: Any, causal_only: bool) -> Any:
        q, scale = self._scaled(q), 1.0
        if visible is None:
            return ops.dot_product_attention(
                q, k, v, scale=scale, is_causal=causal_only, flash_attention=self._flash_attention
            )
        # A row with no visible key would be NaN (torch) or uniform (tensorflow, jax);
        # unhide it for the kernel, then zero its output: probabilities 0 by spec.
        any_visible = ops.any(visible, axis=-1, keepdims=True)  # (B|1, H|1, N|1, 1)
        safe = ops.logical_or(visible, ops.logical_not(any_visible))
        out = ops.dot_product_attention(q, k, v, mask=safe, scale=scale, flash_attention=self._flash_attention)
        keep = ops.transpose(ops.cast(any_visible, out.dtype), (0, 2, 1, 3))  # (B|1, N|1, H|1, 1)
        return out * keep

    def _explicit_attention(self, q: Any, k: Any, v: Any, visible: Any, training: Any) -> tuple[Any, Any]:
        logits = ops.einsum("bnhd,bmhd->bhnm", self._scaled(q), k)
        # Softmax in at least float32, as dot_product_attention does.
        wide = "float32" if _dtype_name(logits) in ("float16", "bfloat16") else _dtype_name(logits)
        logits = ops.cast(logits, wide)
        if visible is not None:
            # A finite fill: a row that sees nothing then stays finite (uniform), and
            # the product with `visible` below makes it exactly 0.
            hidden = ops.convert_to_tensor(-1e9 if wide != "float64" else -1e300, dtype=wide)
            logits = ops.where(visible, logits, hidden)
        probs = ops.softmax(logits, axis=-1)
        if visible is not None:
            # Exact zeros at hidden keys, and for a row that sees nothing (softmax
            # of equal large negatives would be uniform).
            probs = probs * ops.cast(visible, wide)
        probs = ops.cast(probs, q.dtype)
        dropped = self._dropout_layer(probs, training=training) if self._dropout > 0 else probs
        return ops.einsum("bhnm,bmhd->bnhd", dropped, v), probs

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

    def _require_built(self, what: str) -> None:
        if not self.built or self.config is None:
            raise DamchaValueError(f"`{what}` needs a built layer; call it on data or use from_canonical first. "
                                   f"Received: an unbuilt layer {self.name!r}")

    def canonical_variables(self) -> dict[str, Any]:
        """Canonical name -> ``keras.Variable``, in canonical order (the same
        variable object appears once per name, even for a shared generator)."""
        self._require_built("canonical_variables")
        out: dict[str, Any] = {}
        for name, dense in self._dense.items():
            out[f"{name}.kernel"] = dense.kernel
            if self._use_bias:
                out[f"{name}.bias"] = dense.bias
        for side, generator in self._generators.items():
            out[f"metric.{side}.gate"] = self._gates[side]
            out[f"metric.{side}.kernel"] = generator.kernel
            out[f"metric.{side}.bias"] = generator.bias
            if self.config.metric == "lowrank":
                out[f"metric.{side}.u"] = generator.u
                out[f"metric.{side}.v"] = generator.v
        return {name: out[name] for name in self.config.param_shapes()}

    def to_canonical(self) -> dict[str, np.ndarray]:
        """The weights as canonical NumPy arrays (the variables' dtype); with
        ``self.config`` they load into any DAMCHA backend or ``damcha_core``."""
        return {name: np.asarray(keras.ops.convert_to_numpy(v)) for name, v in self.canonical_variables().items()}

    def load_canonical(self, params: Mapping[str, Any]) -> None:
        """Assign canonical params (validated against ``self.config``) to this built layer."""
        self._require_built("load_canonical")
        checked = dc.validate_params(params, self.config)
        for name, variable in self.canonical_variables().items():
            variable.assign(checked[name].astype(keras.backend.standardize_dtype(variable.dtype)))

    def save_canonical(self, path: str) -> None:
        """Write the weights and config as DAMCHA safetensors (``damcha_core.save_params``)."""
        dc.save_params(path, self.to_canonical(), self.config)

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
        if not isinstance(config, DamchaConfig):
            raise DamchaTypeError(f"`config` must be a DamchaConfig. Received: config={describe(config)}")
        dc.validate_params(params, config)
        layer = cls(
            num_heads=config.num_heads, key_dim=config.key_dim, value_dim=config.value_dim,
            dropout=config.dropout, use_bias=config.use_bias, output_shape=config.output_dim,
            metric=config.metric, metric_rank=config.metric_rank, coupling=config.coupling,
            num_kv_heads=config.num_kv_heads, scale=config.scale, **kwargs,
        )
        layer._zero_init = True
        layer.build((None, None, config.query_dim), (None, None, config.context_dim))
        layer._zero_init = False
        layer.load_canonical(params)
        return layer

    @classmethod
    def load(cls, path: str, **kwargs: Any) -> "DamchaAttention":
        """``from_canonical`` on a DAMCHA safetensors file."""
        params, config = dc.load_params(path)
        return cls.from_canonical(params, config, **kwargs)

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
        for name, dense in (("query", layer.query_dense), ("key", layer.key_dense),
                            ("value", layer.value_dense), ("output", layer.output_dense)):
            new._dense[name].kernel.assign(dense.kernel)
            if new.use_bias:
                new._dense[name].bias.assign(dense.bias)
        return new
