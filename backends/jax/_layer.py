"""``DamchaAttention``, the Flax NNX layer: a drop-in for ``nnx.MultiHeadAttention``
whose ``__call__`` delegates the math to ``_functional`` (canonical I/O in
``_canonical``, the decoding cache in ``_cache``, conversion in ``_convert``)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from damcha_core import DamchaConfig, DamchaValueError, describe

from . import _functional as F
from ._cache import DecodeCache
from ._canonical import CanonicalIO
from ._convert import from_mha
from ._generator import CrossHeadMap, MetricGenerator, given_generators, make_metric_generators

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


class DamchaAttention(CanonicalIO, DecodeCache, nnx.Module):
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
        given = given_generators(metric_generator, cfg)  # checked before any allocation
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
        return from_mha(cls, mha, metric=metric, metric_rank=metric_rank, coupling=coupling, rngs=rngs)

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
            return self._decode(self.arrays(), inputs_q, inputs_k, mask)
        lead = None
        if getattr(inputs_q, "ndim", 3) != 3:  # Flax also takes (N, E) and [batch..., N, E]
            inputs_q, inputs_k, value, mask, lead = _fold_batch_dims(inputs_q, inputs_k, value, mask)
        y = F.damcha_attention(
            self.arrays(), self.config, inputs_q, inputs_k, value=value, mask=mask, is_causal=is_causal,
            dropout_rng=dropout_rng, deterministic=dropout_rng is None, dtype=self.dtype,
        )
        return y if lead is None else jnp.reshape(y, lead + tuple(y.shape[-2:]))

    def metric_penalty(self, inputs_q: Array, inputs_k: Array | None = None) -> Array:
        """The optional regulariser mean ||L(t) - I||_F^2 / (S*d) (``damcha_core.metric_penalty``)."""
        return F.metric_penalty(self.arrays(), self.config, inputs_q, inputs_k)


