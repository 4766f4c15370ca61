"""Decoding with a key/value cache: the pure ``init_cache``/``decode_step``
and the NNX module's cache (``DecodeCache``, a base class of ``DamchaAttention``).

The cache stores the *transformed* keys k~ = L_k(c) k: the key map depends
only on the key's own token, so it is never recomputed, at no extra size.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, check_shapes, describe, mask_dtype_error

from ._functional import Array, Params, _attend, _check_config, _output, _prepare, _qkv


def init_cache(config: DamchaConfig, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> dict[str, Array]:
    """An empty decoding cache: transformed keys k~ (B, L, G, d), values v
    (B, L, G, d_v) and the number of filled positions ``index`` (int32).

    k~ is cached instead of k: the key map depends only on the key's own
    token, so it never has to be recomputed, at no extra size.
    """
    _check_config(config)
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise DamchaValueError(f"`{name}` must be an int >= 1. Received: {name}={describe(value)}")
    try:
        floating = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise DamchaTypeError(f"`dtype` must be a floating dtype. Received: dtype={describe(dtype)}")
    G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
    return {
        "key": jnp.zeros((batch_size, max_length, G, d), dtype),
        "value": jnp.zeros((batch_size, max_length, G, d_v), dtype),
        "index": jnp.zeros((), jnp.int32),
    }


def _check_cache(cache: Mapping[str, Any], config: DamchaConfig) -> tuple[Array, Array, Array]:
    """The cache's arrays, checked against ``config`` (a cache made for another
    layer would otherwise fail inside ``dynamic_update_slice``)."""
    cached_k, cached_v, index = cache["key"], cache["value"], cache["index"]
    G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
    for name, array, width in (("key", cached_k, d), ("value", cached_v, d_v)):
        shape = getattr(array, "shape", None)
        dtype = getattr(array, "dtype", None)
        if shape is None or len(shape) != 4 or tuple(shape[2:]) != (G, width) or tuple(shape[:2]) != tuple(cached_k.shape[:2]):
            raise DamchaValueError(
                f"`cache['{name}']` must have shape (B, max_length, G, {'d' if name == 'key' else 'd_v'}) = "
                f"(B, max_length, {G}, {width}) for this config, as init_cache makes it. "
                f"Received: cache['{name}']={describe(array)}"
                + ("" if name == "key" else f", cache['key']={describe(cached_k)}")
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise DamchaTypeError(f"`cache['{name}']` must be floating. Received: cache['{name}']={describe(array)}")
    if isinstance(index, numbers.Integral) and not isinstance(index, bool):
        index = jnp.asarray(index, jnp.int32)
    if getattr(index, "shape", None) != () or not jnp.issubdtype(index.dtype, jnp.integer):
        raise DamchaValueError(
            f"`cache['index']` must be an integer scalar (the number of filled positions). Received: cache['index']={describe(index)}"
        )
    if not isinstance(index, jax.core.Tracer) and int(index) < 0:
        raise DamchaValueError(f"`cache['index']` must be >= 0. Received: cache['index']={int(index)}")
    return jnp.asarray(cached_k), jnp.asarray(cached_v), index


def decode_step(
    params: Params,
    config: DamchaConfig,
    cache: Mapping[str, Array],
    query: Array,
    context: Array | None = None,
    *,
    mask: Array | None = None,
    dtype: Any = None,
) -> tuple[Array, dict[str, Array]]:
    """Append T tokens to ``cache`` and attend causally over every cached key.

    Query i of this step sits at position ``index + i`` and sees cached keys
    j <= index + i (the bottom-right causal rule of a decoder with a cache),
    so a loop of steps equals one causal forward pass over the whole sequence.

    Args:
        params, config: as ``damcha_attention``.
        cache: from ``init_cache`` or a previous step.
        query: x (B, T, E_q), the new tokens.
        context: the tokens whose keys/values are appended, (B, T, E_kv);
            ``None`` means ``query`` (self-attention decoding).
        mask: optional bool mask over the whole cache, (T, L) or (B, H, T, L).
        dtype: computation dtype; default promotes inputs and params.

    Returns:
        ``(y (B, T, E_o), new_cache)``. When ``index`` is concrete, writing
        past ``max_length`` raises; under ``jit`` the index is traced and such
        a write would be clamped by ``dynamic_update_slice``, so size the
        cache for the whole sequence.
    """
    config = _check_config(config)
    if not isinstance(cache, Mapping) or set(cache) != {"key", "value", "index"}:
        raise DamchaValueError(
            f"`cache` must be the dict from init_cache with keys ['index', 'key', 'value']. Received: cache={describe(cache)}"
            if not isinstance(cache, Mapping) else
            f"`cache` must be the dict from init_cache with keys ['index', 'key', 'value']. Received keys: {sorted(cache)}"
        )
    cached_k, cached_v, index = _check_cache(cache, config)
    B, L = cached_k.shape[0], cached_k.shape[1]
    # The mask spans the whole cache (T, L), not (T, T): it is checked below, not by _prepare.
    p, config, x, c, _, _ = _prepare(params, config, query, context, None, None, dtype)
    T = x.shape[1]
    tokens = x if c is None else c
    if tokens.shape[0] != B or tokens.shape[1] != T:
        raise DamchaValueError(
            f"`query` and `context` must be (B, T, .) with the cache's batch size B={B} and one key per query token. "
            f"Received: query.shape={tuple(x.shape)}, context.shape={None if c is None else tuple(c.shape)}"
        )
    if mask is not None:
        if getattr(mask, "dtype", None) is None or jnp.dtype(mask.dtype) != jnp.bool_:
            raise mask_dtype_error(mask)
        check_shapes(config, x.shape, (B, L, config.context_dim), mask.shape)
        mask = jnp.asarray(mask)
    if not isinstance(index, jax.core.Tracer) and int(index) + T > L:
        raise DamchaValueError(
            f"`cache` is full: {int(index)} of max_length={L} positions are used and {T} more were given. "
            "Received: query.shape=" + str(tuple(x.shape))
        )
    q, k, v = _qkv(p, config, x, c, None)
    start = (jnp.zeros((), jnp.int32), index.astype(jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    keys = jax.lax.dynamic_update_slice(cached_k, k.astype(cached_k.dtype), start)
    values = jax.lax.dynamic_update_slice(cached_v, v.astype(cached_v.dtype), start)
    o, _ = _attend(
        config, q.astype(keys.dtype), keys, values, mask=mask, is_causal=True,
        query_offset=index, return_weights=False, dropout_rng=None,
    )
    y = _output(p, config, o.astype(x.dtype))
    return y, {"key": keys, "value": values, "index": index + T}


class DecodeCache:
    """The NNX module's decoding cache (a base class of ``DamchaAttention``):
    ``cached_key`` (k~), ``cached_value`` and ``cache_index`` as ``nnx.Cache``
    variables, named as in ``nnx.MultiHeadAttention``."""

    config: DamchaConfig
    dtype: Any
    cached_key: nnx.Cache | None
    cached_value: nnx.Cache | None
    cache_index: nnx.Cache | None

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        """Allocate the decoding cache for inputs of shape (B, max_length, E_q)."""
        if len(tuple(input_shape)) != 3:
            raise DamchaValueError(
                f"`input_shape` must be (batch, max_length, features). Received: input_shape={tuple(input_shape)}"
            )
        cache = init_cache(self.config, int(input_shape[0]), int(input_shape[1]), dtype)
        self.cached_key = nnx.Cache(cache["key"])
        self.cached_value = nnx.Cache(cache["value"])
        self.cache_index = nnx.Cache(cache["index"])

    def _decode(self, params: Params, inputs_q: Array, inputs_k: Array | None, mask: Array | None) -> Array:
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise DamchaValueError("The decoding cache is not initialised: call init_cache(input_shape) first.")
        cache = {"key": self.cached_key[...], "value": self.cached_value[...], "index": self.cache_index[...]}
        y, cache = decode_step(params, self.config, cache, inputs_q, inputs_k, mask=mask, dtype=self.dtype)
        self.cached_key[...] = cache["key"]
        self.cached_value[...] = cache["value"]
        self.cache_index[...] = cache["index"]
        return y
