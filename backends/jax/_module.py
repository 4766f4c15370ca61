"""Flax NNX modules: ``DamchaAttention`` (a drop-in for ``nnx.MultiHeadAttention``),
a shareable ``MetricGenerator``, and a pre-LN encoder block and stack."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe

from . import _functional as F

Array = jax.Array
Initializer = Callable[..., Array]

# LinearGeneral initialises its kernel flattened to (fan_in, fan_out), so plain
# Glorot uniform gives damcha_core.init_params' fans: (E, S*d) and (H*d_v, E_o).
_glorot = nnx.initializers.glorot_uniform()


def _flax_mask(mask: Array | None) -> Array | None:
    """Flax's mask convention at the module boundary: ``nnx.make_attention_mask``
    and ``make_causal_mask`` return float 0/1 masks and Flax reads any non-zero
    entry as "attend"; the functional core takes bool masks only."""
    if mask is None or getattr(mask, "dtype", None) is None:
        return mask  # None, or not an array: the core's error describes it
    dtype = jnp.dtype(mask.dtype)
    if dtype == jnp.bool_ or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        return mask
    return jnp.asarray(mask) != 0


def _fold_batch_dims(inputs_q: Any, inputs_k: Any, value: Any, mask: Any) -> tuple[Any, Any, Any, Any, tuple]:
    """Flax's ``[batch..., length, features]`` inputs as one batch axis.

    Unbatched (N, E) and multi-axis (B1, B2, ..., N, E) inputs are folded to
    (B, N, E), B the product of the batch axes (1 when there are none), and
    back afterwards; a Flax mask ``[batch..., H|1, N|1, M]`` is broadcast over
    the batch axes and folded the same way. (N, M) masks pass through.
    """
    lead = tuple(inputs_q.shape[:-2])
    for name, t in (("inputs_k", inputs_k), ("inputs_v", value)):
        if t is not None and (getattr(t, "ndim", None) != inputs_q.ndim or tuple(t.shape[:-2]) != lead):
            raise DamchaValueError(
                f"`{name}` must have the batch axes of `inputs_q`, {lead}. "
                f"Received: inputs_q.shape={tuple(inputs_q.shape)}, {name}.shape={tuple(getattr(t, 'shape', ()))}"
            )
    B = int(np.prod(lead)) if lead else 1
    fold = lambda t: None if t is None else jnp.reshape(t, (B,) + tuple(t.shape[-2:]))  # noqa: E731
    if mask is not None and getattr(mask, "ndim", None) == len(lead) + 3:
        tail = tuple(mask.shape[-3:])
        if any(m not in (1, b) for m, b in zip(mask.shape[:-3], lead)):
            raise DamchaValueError(
                f"`mask` must be broadcastable to [batch..., H, N, M] with batch axes {lead}. "
                f"Received: mask.shape={tuple(mask.shape)}"
            )
        mask = jnp.reshape(jnp.broadcast_to(mask, lead + tail), (B,) + tail)
    return fold(inputs_q), fold(inputs_k), fold(value), mask, lead


class MetricGenerator(nnx.Module):
    """The data-adaptive part of one side's cross-head map: phi(t) -> A(t) or u(t).

    Holds the generator ``kernel`` and ``bias`` (and, for metric "lowrank",
    the static factors ``u`` and ``v``); the per-layer gate lives in the
    layer. Pass one instance to several ``DamchaAttention`` layers (argument
    ``metric_generator``) for stack-wise sharing: NNX keeps it a single
    shared node, so ``nnx.split``/``nnx.grad`` see it once and its gradient
    sums over the layers.

    Args:
        in_features: E, feature size of the tokens feeding this side.
        num_heads: S, heads the map acts on.
        metric: "heads" (kernel (E, S, S), bias (S, S)) or "lowrank"
            (kernel (E, r), bias (r,), u and v (S, d, r)).
        rank: r, required for "lowrank".
        head_dim: d, required for "lowrank".
        param_dtype: dtype of the parameters.
        rngs: initialisation RNGs (stream ``params``).
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        *,
        metric: str = "heads",
        rank: int | None = None,
        head_dim: int | None = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        if metric not in ("heads", "lowrank"):
            raise DamchaValueError(f"`metric` must be one of ('heads', 'lowrank'). Received: metric={metric!r}")
        if metric == "lowrank" and (rank is None or head_dim is None):
            raise DamchaValueError(
                f"`rank` and `head_dim` are required with metric='lowrank'. Received: rank={rank!r}, head_dim={head_dim!r}"
            )
        self.in_features, self.num_heads, self.metric = in_features, num_heads, metric
        self.rank, self.head_dim = rank, head_dim
        E, S = in_features, num_heads

        def normal(shape: tuple[int, ...], fan_in: int) -> Array:
            # A Python float is weakly typed: the result stays in param_dtype (a
            # NumPy scalar would promote bfloat16 to float32, and float32 to
            # float64 under x64).
            return jax.random.normal(rngs.params(), shape, param_dtype) / float(np.sqrt(fan_in))

        if metric == "heads":
            self.kernel = nnx.Param(normal((E, S, S), E * S))
            self.bias = nnx.Param(jnp.zeros((S, S), param_dtype))
            self.u = nnx.data(None)
            self.v = nnx.data(None)
        else:
            r, d = rank, head_dim
            self.kernel = nnx.Param(normal((E, r), E))
            self.bias = nnx.Param(jnp.zeros((r,), param_dtype))
            self.u = nnx.Param(normal((S, d, r), r))
            self.v = nnx.Param(normal((S, d, r), S * d))

    def __call__(self, tokens: Array) -> Array:
        """Coefficients for tokens (B, T, E): A (B, T, S, S) or u (B, T, r)."""
        return F.coefficients(self.metric, self.kernel[...], self.bias[...], jnp.asarray(tokens))


class CrossHeadMap(nnx.Module):
    """One side's map L(t) = I + diag(gate) Delta(t): its own gate (S,),
    starting at 0 (exactly MHA), and a possibly shared ``MetricGenerator``."""

    def __init__(self, generator: MetricGenerator, *, param_dtype: Any = jnp.float32) -> None:
        self.gate = nnx.Param(jnp.zeros((generator.num_heads,), param_dtype))
        self.generator = generator


def make_metric_generators(
    config: DamchaConfig, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs
) -> dict[str, MetricGenerator]:
    """Fresh generators for every metric side of ``config`` (``{}`` for metric
    "none"): build once, then pass to each layer of a stack."""
    return {
        side: MetricGenerator(
            config.side_features(side), config.side_heads(side), metric=config.metric,
            rank=config.metric_rank, head_dim=config.key_dim, param_dtype=param_dtype, rngs=rngs,
        )
        for side in config.metric_sides
    }


def _check_generator(side: str, gen: Any, config: DamchaConfig) -> MetricGenerator:
    if not isinstance(gen, MetricGenerator):
        raise DamchaTypeError(
            f"`metric_generator[{side!r}]` must be a MetricGenerator. Received: {describe(gen)}"
        )
    expected = (config.side_features(side), config.side_heads(side), config.metric, config.metric_rank,
                config.key_dim if config.metric == "lowrank" else gen.head_dim)
    got = (gen.in_features, gen.num_heads, gen.metric, gen.rank, gen.head_dim)
    if got != expected:
        raise DamchaValueError(
            f"`metric_generator[{side!r}]` does not fit this layer: expected (in_features, num_heads, metric, "
            f"rank, head_dim)={expected}. Received: {got}"
        )
    return gen


def attention_config(
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    key_dim: int | None = None,
    value_dim: int | None = None,
    metric: str = "heads",
    metric_rank: int | None = None,
    coupling: str = "tied",
    scale: float | None = None,
    dropout_rate: float = 0.0,
    use_bias: bool = True,
) -> DamchaConfig:
    """The ``DamchaConfig`` of ``DamchaAttention`` built with these arguments
    (nnx.MultiHeadAttention naming); every rule is checked by DamchaConfig."""
    if key_dim is None:
        qkv = in_features if qkv_features is None else qkv_features
        if isinstance(qkv, int) and isinstance(num_heads, int) and num_heads > 0:
            if qkv % num_heads:
                raise DamchaValueError(
                    "`qkv_features` must be divisible by `num_heads` (d = qkv_features / num_heads). "
                    f"Received: qkv_features={qkv}, num_heads={num_heads}"
                )
            key_dim = qkv // num_heads
        else:
            key_dim = qkv  # let DamchaConfig report the bad type
    elif qkv_features is not None and qkv_features != key_dim * num_heads:
        raise DamchaValueError(
            "`qkv_features` and `key_dim` disagree (qkv_features must be num_heads * key_dim); give one. "
            f"Received: qkv_features={qkv_features}, key_dim={key_dim}, num_heads={num_heads}"
        )
    return DamchaConfig(
        query_dim=in_features, num_heads=num_heads, key_dim=key_dim, value_dim=value_dim,
        num_kv_heads=num_kv_heads, context_dim=in_kv_features, output_dim=out_features,
        use_bias=use_bias, metric=metric, metric_rank=metric_rank, coupling=coupling,
        scale=scale, dropout=dropout_rate,
    )


class DamchaAttention(nnx.Module):
    """Data-Adaptive Mahalanobis Cross-Head Attention, a drop-in for
    ``nnx.MultiHeadAttention``.

    Same constructor and call conventions as ``nnx.MultiHeadAttention``
    (kernels ``query``/``key``/``value`` (E, S, d) and ``out`` (H, d_v, E_o)
    as ``LinearGeneral`` submodules), plus the DAMCHA options. With gates at
    0 (the initial state) it computes exactly MHA.

    Args:
        num_heads: H.
        in_features: E_q, feature size of ``inputs_q``.
        qkv_features: H * d; default ``in_features``. Give this or ``key_dim``.
        out_features: E_o; default ``in_features``.
        num_kv_heads: G (GQA/MQA); default ``num_heads``.
        in_kv_features: E_kv, feature size of ``inputs_k``; default ``in_features``.
        key_dim: d, per-head query/key size (overrides ``qkv_features``).
        value_dim: d_v; default ``key_dim``.
        metric, metric_rank, coupling, scale: as ``damcha_core.DamchaConfig``
            (defaults: "heads", None, "tied", 1/sqrt(d)).
        metric_generator: a ``MetricGenerator``, or a dict side -> generator,
            to share the generator with other layers; default fresh ones.
        dtype: computation dtype (default: promote inputs and params).
        param_dtype: parameter dtype (default float32).
        dropout_rate: attention-probability dropout (training only).
        deterministic: default for ``__call__``'s ``deterministic``.
        use_bias: biases on the four projections.
        kernel_init, out_kernel_init, bias_init, out_bias_init: projection
            initialisers; default Glorot uniform (as ``damcha_core.init_params``)
            and zeros; the ``out_`` ones default to the others, as in Flax.
        decode: default for ``__call__``'s ``decode`` (call ``init_cache`` first).
        rngs: RNGs (``params``, and ``dropout`` when dropout_rate > 0).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        key_dim: int | None = None,
        value_dim: int | None = None,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str = "tied",
        scale: float | None = None,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        use_bias: bool = True,
        kernel_init: Initializer = _glorot,
        out_kernel_init: Initializer | None = None,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        out_bias_init: Initializer | None = None,
        decode: bool | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        self.config = attention_config(
            num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features,
            key_dim=key_dim, value_dim=value_dim, metric=metric, metric_rank=metric_rank,
            coupling=coupling, scale=scale, dropout_rate=dropout_rate, use_bias=use_bias,
        )
        cfg = self.config
        given = self._given_generators(metric_generator, cfg)  # checked before any allocation
        H, G, d, d_v = cfg.num_heads, cfg.num_kv_heads, cfg.key_dim, cfg.value_dim
        # nnx.MultiHeadAttention's attribute names, so code reading them keeps working.
        self.num_heads, self.num_kv_heads, self.head_dim = H, G, d
        self.in_features, self.in_kv_features, self.out_features = cfg.query_dim, cfg.context_dim, cfg.output_dim
        self.qkv_features = H * d
        self.dropout_rate, self.deterministic, self.decode = cfg.dropout, deterministic, decode
        self.dtype, self.param_dtype, self.use_bias = dtype, param_dtype, use_bias

        linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, bias_init=bias_init, rngs=rngs)
        self.query = nnx.LinearGeneral(cfg.query_dim, (H, d), kernel_init=kernel_init, **linear)
        self.key = nnx.LinearGeneral(cfg.context_dim, (G, d), kernel_init=kernel_init, **linear)
        self.value = nnx.LinearGeneral(cfg.context_dim, (G, d_v), kernel_init=kernel_init, **linear)
        self.out = nnx.LinearGeneral(
            (H, d_v), cfg.output_dim, axis=(-2, -1), kernel_init=out_kernel_init or kernel_init,
            **{**linear, "bias_init": out_bias_init or bias_init},
        )

        generators = given if given is not None else make_metric_generators(cfg, param_dtype=param_dtype, rngs=rngs)
        self.metric = nnx.Dict({s: CrossHeadMap(generators[s], param_dtype=param_dtype) for s in cfg.metric_sides})

        self.rngs = rngs.dropout.fork() if cfg.dropout > 0 else nnx.data(None)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)


    @staticmethod
    def _given_generators(metric_generator: Any, config: DamchaConfig) -> dict[str, MetricGenerator] | None:
        """The caller's shared generators, checked against ``config``; None = make fresh ones."""
        if isinstance(metric_generator, MetricGenerator):
            if len(config.metric_sides) != 1:
                raise DamchaValueError(
                    f"`metric_generator` must be a dict side -> MetricGenerator for sides {config.metric_sides}. "
                    f"Received: a single {describe(metric_generator)}"
                )
            metric_generator = {config.metric_sides[0]: metric_generator}
        if metric_generator is None:
            return None
        if isinstance(metric_generator, Mapping):
            if set(metric_generator) != set(config.metric_sides):
                raise DamchaValueError(
                    f"`metric_generator` must have exactly the sides {list(config.metric_sides)}. "
                    f"Received: {sorted(metric_generator)}"
                )
            return {s: _check_generator(s, g, config) for s, g in metric_generator.items()}
        raise DamchaTypeError(
            "`metric_generator` must be a MetricGenerator, a dict side -> MetricGenerator or None. "
            f"Received: metric_generator={describe(metric_generator)}"
        )

    # ------------------------------------------------------- canonical params

    def _variables(self) -> dict[str, nnx.Variable]:
        """Canonical name -> the variable holding it."""
        out: dict[str, nnx.Variable] = {}
        for name, module in (("query", self.query), ("key", self.key), ("value", self.value), ("output", self.out)):
            out[f"{name}.kernel"] = module.kernel
            if self.use_bias:
                out[f"{name}.bias"] = module.bias
        for side, cross in self.metric.items():
            out[f"metric.{side}.gate"] = cross.gate
            for leaf in ("kernel", "bias", "u", "v"):
                var = getattr(cross.generator, leaf)
                if var is not None:
                    out[f"metric.{side}.{leaf}"] = var
        return {name: out[name] for name in self.config.param_shapes()}

    def arrays(self) -> dict[str, Array]:
        """The canonical params as JAX arrays (what ``damcha_attention`` takes)."""
        return {name: var[...] for name, var in self._variables().items()}

    def to_params(self) -> dict[str, np.ndarray]:
        """The canonical params as NumPy arrays in ``param_dtype``."""
        return {name: np.asarray(value) for name, value in self.arrays().items()}

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Load canonical params (validated against ``self.config``), cast to
        ``param_dtype``. A shared generator is shared: setting it here sets it
        for every layer that holds it."""
        dc.validate_params(params, self.config)
        for name, var in self._variables().items():
            var[...] = jnp.asarray(params[name], self.param_dtype)

    @classmethod
    def from_params(
        cls,
        params: Mapping[str, Any],
        config: DamchaConfig,
        *,
        rngs: nnx.Rngs | None = None,
        **kwargs: Any,
    ) -> "DamchaAttention":
        """A layer with ``config``'s shape holding ``params``; ``kwargs`` are
        the non-shape arguments (dtype, param_dtype, decode, deterministic)."""
        if not isinstance(config, DamchaConfig):
            raise DamchaTypeError(f"`config` must be a DamchaConfig. Received: config={describe(config)}")
        layer = cls(
            config.num_heads, config.query_dim, None, config.output_dim, config.num_kv_heads, config.context_dim,
            key_dim=config.key_dim, value_dim=config.value_dim, metric=config.metric,
            metric_rank=config.metric_rank, coupling=config.coupling, scale=config.scale,
            dropout_rate=config.dropout, use_bias=config.use_bias, rngs=rngs or nnx.Rngs(0), **kwargs,
        )
        layer.set_params(params)
        return layer

    def save(self, path: str | os.PathLike) -> None:
        """Write the canonical params and config as safetensors (``damcha_core.save_params``)."""
        dc.save_params(path, self.to_params(), self.config)

    @classmethod
    def load(cls, path: str | os.PathLike, *, rngs: nnx.Rngs | None = None, **kwargs: Any) -> "DamchaAttention":
        """Read a file written by ``save`` (or any backend's ``save_params``)."""
        params, config = dc.load_params(path)
        return cls.from_params(params, config, rngs=rngs, **kwargs)

    @classmethod
    def from_mha(
        cls,
        mha: nnx.MultiHeadAttention,
        *,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str = "tied",
        rngs: nnx.Rngs,
    ) -> "DamchaAttention":
        """A DAMCHA layer with ``mha``'s projections and gates at 0: identical
        outputs, ready to fine-tune the metric. The generator is fresh."""
        if not isinstance(mha, nnx.MultiHeadAttention):
            raise DamchaTypeError(f"`mha` must be an nnx.MultiHeadAttention. Received: mha={describe(mha)}")
        if mha.normalize_qk:
            raise DamchaValueError(
                "`mha` uses normalize_qk=True (LayerNorm on q and k), which DAMCHA v1 does not define. "
                "Received: mha.normalize_qk=True"
            )
        layer = cls(
            mha.num_heads, mha.in_features, mha.qkv_features, mha.out_features, mha.num_kv_heads,
            mha.in_kv_features, metric=metric, metric_rank=metric_rank, coupling=coupling,
            dtype=mha.dtype, param_dtype=mha.param_dtype, dropout_rate=mha.dropout_rate,
            deterministic=mha.deterministic, use_bias=mha.use_bias, decode=mha.decode, rngs=rngs,
        )
        variables = layer._variables()
        for name, module in (("query", mha.query), ("key", mha.key), ("value", mha.value), ("output", mha.out)):
            variables[f"{name}.kernel"][...] = module.kernel[...]
            if layer.use_bias:
                variables[f"{name}.bias"][...] = module.bias[...]
        return layer

    # ----------------------------------------------------------------- calls

    def _dropout_rng(self, deterministic: bool | None, rngs: Any) -> Array | None:
        if self.dropout_rate == 0.0:
            return None
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic is None:
            raise DamchaValueError(
                f"`deterministic` must be given (to __call__ or the constructor) when dropout_rate={self.dropout_rate} > 0. "
                "Received: deterministic=None"
            )
        if deterministic:
            return None
        stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs or self.rngs)
        if stream is None:
            raise DamchaValueError("`rngs` must be given to __call__ when dropout is active. Received: rngs=None")
        return stream()

    def __call__(
        self,
        inputs_q: Array,
        inputs_k: Array | None = None,
        inputs_v: Array | None = None,
        *,
        mask: Array | None = None,
        is_causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        decode: bool | None = None,
    ) -> Array:
        """Attention of ``inputs_q`` (B, N, E_q) over ``inputs_k`` (B, M, E_kv).

        As in Flax, inputs may also be unbatched (N, E) or carry several batch
        axes ``[batch..., N, E]`` (not with ``decode``), with masks
        ``[batch..., H|1, N|1, M]``; they are folded into one batch axis.

        As ``nnx.MultiHeadAttention``: ``inputs_k=None`` is self-attention,
        ``inputs_v`` defaults to ``inputs_k``; ``mask`` follows Flax: True or
        non-zero = attend (``nnx.make_attention_mask``/``make_causal_mask``
        return float 0/1 masks), shape (N, M) or (B, H, N, M) with size-1 dims. The key map is computed from
        ``inputs_k``'s tokens. With ``decode`` the new tokens are appended to
        the cache (``init_cache``) and attend causally over it (``is_causal``
        is implied). Returns (B, N, E_o).
        """
        if inputs_k is None and inputs_v is not None:
            raise DamchaValueError(
                "`inputs_k` cannot be None when `inputs_v` is given; pass the key/value tokens as inputs_k. "
                f"Received: inputs_k=None, inputs_v={describe(inputs_v)}"
            )
        value = None if inputs_v is None or inputs_v is inputs_k else inputs_v
        mask = _flax_mask(mask)
        decode = bool(self.decode if decode is None else decode)
        dropout_rng = self._dropout_rng(deterministic, rngs)
        if decode:
            if value is not None:
                raise DamchaValueError(
                    "`inputs_v` separate from `inputs_k` is not supported with decode=True. "
                    f"Received: inputs_v={describe(inputs_v)}"
                )
            return self._decode(inputs_q, inputs_k, mask)
        lead = None
        if getattr(inputs_q, "ndim", 3) != 3:  # Flax also takes (N, E) and [batch..., N, E]
            inputs_q, inputs_k, value, mask, lead = _fold_batch_dims(inputs_q, inputs_k, value, mask)
        y = F.damcha_attention(
            self.arrays(), self.config, inputs_q, inputs_k, value=value, mask=mask, is_causal=is_causal,
            dropout_rng=dropout_rng, deterministic=dropout_rng is None, dtype=self.dtype,
        )
        return y if lead is None else jnp.reshape(y, lead + tuple(y.shape[-2:]))

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        """Allocate the decoding cache for inputs of shape (B, max_length, E_q)."""
        if len(tuple(input_shape)) != 3:
            raise DamchaValueError(
                f"`input_shape` must be (batch, max_length, features). Received: input_shape={tuple(input_shape)}"
            )
        cache = F.init_cache(self.config, int(input_shape[0]), int(input_shape[1]), dtype)
        self.cached_key = nnx.Cache(cache["key"])
        self.cached_value = nnx.Cache(cache["value"])
        self.cache_index = nnx.Cache(cache["index"])

    def _decode(self, inputs_q: Array, inputs_k: Array | None, mask: Array | None) -> Array:
        if self.cached_key is None:
            raise DamchaValueError("The decoding cache is not initialised: call init_cache(input_shape) first.")
        cache = {"key": self.cached_key[...], "value": self.cached_value[...], "index": self.cache_index[...]}
        y, cache = F.decode_step(self.arrays(), self.config, cache, inputs_q, inputs_k, mask=mask, dtype=self.dtype)
        self.cached_key[...] = cache["key"]
        self.cached_value[...] = cache["value"]
        self.cache_index[...] = cache["index"]
        return y

    def metric_penalty(self, inputs_q: Array, inputs_k: Array | None = None) -> Array:
        """The optional regulariser mean ||L(t) - I||_F^2 / (S*d) (``damcha_core.metric_penalty``)."""
        return F.metric_penalty(self.arrays(), self.config, inputs_q, inputs_k)


class DamchaEncoderBlock(nnx.Module):
    """Pre-LN transformer encoder block with DAMCHA self-attention:
    x + Drop(Attn(LN(x))), then x + Drop(MLP(LN(x))) with a GELU MLP.

    Args:
        in_features: E.
        num_heads: H.
        mlp_features: hidden size of the MLP.
        dropout_rate: residual dropout.
        attention_dropout_rate: attention-probability dropout.
        metric_generator: shared generator(s), see ``DamchaAttention``.
        **attention_kwargs: further ``DamchaAttention`` options (key_dim,
            metric, metric_rank, coupling, num_kv_heads, dtype, param_dtype...).
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        mlp_features: int,
        *,
        dropout_rate: float = 0.0,
        attention_dropout_rate: float = 0.0,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        rngs: nnx.Rngs,
        **attention_kwargs: Any,
    ) -> None:
        dtype, param_dtype = attention_kwargs.get("dtype"), attention_kwargs.get("param_dtype", jnp.float32)
        norm = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(in_features, **norm)
        self.attention = DamchaAttention(
            num_heads, in_features, dropout_rate=attention_dropout_rate,
            metric_generator=metric_generator, rngs=rngs, **attention_kwargs,
        )
        self.mlp_norm = nnx.LayerNorm(in_features, **norm)
        self.mlp_in = nnx.Linear(in_features, mlp_features, **norm)
        self.mlp_out = nnx.Linear(mlp_features, in_features, **norm)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(
        self, x: Array, *, mask: Array | None = None, is_causal: bool = False, deterministic: bool | None = None
    ) -> Array:
        """x (B, N, E) -> (B, N, E)."""
        h = self.attention(self.attention_norm(x), mask=mask, is_causal=is_causal, deterministic=deterministic)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))
        return x + self.dropout(h, deterministic=deterministic)


class DamchaEncoder(nnx.Module):
    """A stack of ``DamchaEncoderBlock``s and a final LayerNorm.

    With ``share_metric=True`` (the paper's stack-wise regulariser) one
    ``MetricGenerator`` per side serves every layer; each layer keeps its own
    gate. ``self.metric_generators`` holds the shared ones (``{}`` otherwise).
    """

    def __init__(
        self,
        num_layers: int,
        in_features: int,
        num_heads: int,
        mlp_features: int,
        *,
        share_metric: bool = True,
        rngs: nnx.Rngs,
        **block_kwargs: Any,
    ) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise DamchaValueError(f"`num_layers` must be an int >= 1. Received: num_layers={describe(num_layers)}")
        if "metric_generator" in block_kwargs:
            raise DamchaValueError("`metric_generator` is managed by DamchaEncoder; use share_metric=True.")
        shared: dict[str, MetricGenerator] = {}
        if share_metric:
            config = attention_config(num_heads, in_features, **_shape_kwargs(block_kwargs))
            shared = make_metric_generators(
                config, param_dtype=block_kwargs.get("param_dtype", jnp.float32), rngs=rngs
            )
        self.metric_generators = nnx.Dict(shared)
        self.layers = nnx.List([
            DamchaEncoderBlock(
                in_features, num_heads, mlp_features, metric_generator=dict(shared) if share_metric else None,
                rngs=rngs, **block_kwargs,
            )
            for _ in range(num_layers)
        ])
        self.final_norm = nnx.LayerNorm(
            in_features, dtype=block_kwargs.get("dtype"),
            param_dtype=block_kwargs.get("param_dtype", jnp.float32), rngs=rngs,
        )

    def __call__(
        self, x: Array, *, mask: Array | None = None, is_causal: bool = False, deterministic: bool | None = None
    ) -> Array:
        """x (B, N, E) -> (B, N, E)."""
        for layer in self.layers:
            x = layer(x, mask=mask, is_causal=is_causal, deterministic=deterministic)
        return self.final_norm(x)


_SHAPE_ARGS = ("qkv_features", "key_dim", "value_dim", "num_kv_heads", "metric", "metric_rank", "coupling", "scale", "use_bias")


def _shape_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in _SHAPE_ARGS}
