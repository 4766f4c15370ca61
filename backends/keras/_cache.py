"""The key/value cache of ``DamchaAttention`` (KerasHub's ``CachedMultiHeadAttention`` layout).

A cache is one tensor (B, 2, L, G, d): slot 0 holds the *mapped* keys
k~ = L_k(c) k, slot 1 the values, so a cached key never needs its map again
and the cache is the size of an MHA cache. These functions make, check,
write and mask it; the layer's ``call`` uses them when given ``cache=``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import damcha_core as dc
import keras
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe
from keras import ops

from ._functional import dtype_name, visibility

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def static_shape(x: Any) -> tuple:
    """x's shape with every dim that is not a plain int as None.

    Symbolic dims (jax2tf's shape polymorphism in ``model.export`` on JAX,
    torch SymInts) cannot be compared or converted to int: checks skip them,
    as they skip a None dim of a ``keras.Input``.
    """
    return tuple(int(s) if isinstance(s, (int, np.integer)) else None for s in x.shape)


def concrete_int(value: Any) -> int | None:
    """The value of an int or a concrete int tensor; None when traced (jit, tf.function)."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        return int(np.asarray(ops.convert_to_numpy(value)))
    except Exception:  # noqa: BLE001 - a tracer or symbolic tensor (each backend raises its own error type): its value is not known yet
        return None


def check_layout(config: DamchaConfig) -> None:
    """Keys and values share one tensor: a cache needs value_dim == key_dim."""
    if config.value_dim != config.key_dim:
        raise DamchaValueError(
            dc.invalid_argument(
                "value_dim",
                "value_dim == key_dim for a cache: it stacks keys and values in one (B, 2, L, G, d) tensor",
                f"key_dim={config.key_dim}, value_dim={config.value_dim}",
            )
        )


def init_cache(config: DamchaConfig, batch_size: int, max_length: int, dtype: str) -> Any:
    """A zero cache (B, 2, L, G, d) of ``dtype``."""
    # A batch of 0 is an empty cache (its steps give empty outputs, as the layer's do on
    # an empty batch); a cache of no position could hold no token.
    for name, value, least in (("batch_size", batch_size, 0), ("max_length", max_length, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise DamchaValueError(dc.invalid_argument(name, f"an int >= {least}", f"{name}={describe(value)}"))
    check_layout(config)
    shape = (int(batch_size), 2, int(max_length), config.num_kv_heads, config.key_dim)
    return ops.zeros(shape, dtype=dtype)


def check_cache(
    config: DamchaConfig, query: Any, value: Any, masks: dict[str, Any], use_causal_mask: bool, cache: Any, index: Any
) -> int | None:
    """Validate ``cache`` and ``cache_update_index`` of a call; returns the
    key length L the masks span (None without a cache)."""
    if cache is None:
        if index is not None:
            raise DamchaValueError(
                dc.invalid_argument(
                    "cache_update_index",
                    "None without a `cache`",
                    f"cache=None, cache_update_index={describe(index)}",
                )
            )
        return None
    check_layout(config)
    if dtype_name(cache) not in FLOAT_DTYPES:
        raise dc.float_dtype_error("cache", cache)
    shape = static_shape(cache)
    B = static_shape(query)[0]
    expected = (B, 2, None, config.num_kv_heads, config.key_dim)
    if len(shape) != 5 or any(e is not None and s is not None and s != e for s, e in zip(shape, expected)):
        raise DamchaValueError(
            dc.invalid_argument(
                "cache",
                f"shape (B, 2, L, G, d) = ({B}, 2, L, {config.num_kv_heads}, {config.key_dim})",
                f"cache.shape={shape}",
            )
        )
    for name in ("value_mask", "key_mask"):
        if masks[name] is not None:
            raise DamchaValueError(
                dc.invalid_argument(
                    name,
                    f"None with a cache (it would cover only the new tokens): pass an `attention_mask` (B, N, L) "
                    f"over the whole cache instead (Keras also fills `{name}` from the tensor's own mask, e.g. "
                    "Embedding(mask_zero=True))",
                    f"{name}.shape={tuple(masks[name].shape)}",
                )
            )
    if index is None:
        if use_causal_mask:
            raise DamchaValueError(
                dc.invalid_argument(
                    "cache_update_index",
                    "the position of the first new token with use_causal_mask=True and a cache",
                    "use_causal_mask=True, cache_update_index=None",
                )
            )
        return shape[2]
    bad_index = isinstance(index, bool) or not (isinstance(index, (int, np.integer)) or hasattr(index, "dtype"))
    if bad_index or (hasattr(index, "dtype") and ("int" not in dtype_name(index) or len(index.shape) != 0)):
        raise DamchaTypeError(
            dc.invalid_argument(
                "cache_update_index", "an int or an int scalar tensor", f"cache_update_index={describe(index)}"
            )
        )
    T, n = static_shape(value)[1], static_shape(query)[1]
    if use_causal_mask and T is not None and n is not None and n != T:
        raise DamchaValueError(
            dc.invalid_argument(
                "value",
                "one new key per query token with use_causal_mask=True and a cache (self-attention decoding)",
                f"query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}",
            )
        )
    start = concrete_int(index)
    if start is not None and shape[2] is not None and T is not None and not 0 <= start <= shape[2] - T:
        # Under jit the index is traced and slice_update would clamp it silently; here it is known.
        raise DamchaValueError(
            dc.invalid_argument(
                "cache_update_index",
                f"an index in [0, L - M] = [0, {shape[2] - T}] to write {T} tokens into a cache of L={shape[2]}",
                f"cache_update_index={start}",
            )
        )
    return shape[2]


def traced_overflow(index: Any, length: int | None, T: int | None) -> Any:
    """A traced ``cache_update_index`` (under jit) that leaves no room for T
    tokens, as a boolean scalar for the output's NaN poison (slice_update
    would clamp it and overwrite the last slots silently); None where
    ``check_cache`` checked a known index, or a size is unknown."""
    if concrete_int(index) is not None or length is None or T is None:
        return None
    index = ops.convert_to_tensor(index)
    return ops.logical_or(ops.less(index, 0), ops.greater(index, length - T))


def read_cache(cache: Any, dtype: str) -> tuple[Any, Any]:
    """The cached (mapped) keys and values (B, L, G, d), in ``dtype``."""
    k, v = halves(cache)
    return ops.cast(k, dtype), ops.cast(v, dtype)


def halves(cache: Any) -> tuple[Any, Any]:
    """The cache's keys and values (B, L, G, d) as one ``unstack``: one op per
    step instead of two slices, each of which (``cache[:, 0]``) converts its
    begin/end/strides to tensors on every eager call; TensorFlow's unstack of a
    batch of one shares the cache's buffer instead of copying it."""
    k, v = ops.unstack(cache, num=2, axis=1)
    return k, v


def update_cache(cache: Any, index: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """Write the new tokens' mapped keys and values at ``index``; returns
    ``(cache, keys, values)`` with every slot, keys and values in k's dtype."""
    # One update of the whole cache with the new tokens' (B, 2, T, G, d): the cache
    # is copied once per step (updating each half and stacking them copied it three times).
    new = ops.stack([ops.cast(k, cache.dtype), ops.cast(v, cache.dtype)], axis=1)
    cache = ops.slice_update(cache, [0, 0, index, 0, 0], new)
    keys, values = halves(cache)
    return cache, ops.cast(keys, k.dtype), ops.cast(values, k.dtype)


@functools.lru_cache(maxsize=64)
def _slot_offsets(n: int, length: int) -> np.ndarray:
    """(1, 1, N, L) int32: slot j minus query i."""
    return (np.arange(length, dtype=np.int32)[None, :] - np.arange(n, dtype=np.int32)[:, None])[None, None]


def causal_slots(n: int | None, length: int | None, index: Any) -> Any:
    """(1, 1, N, L) bool, query i (token index + i) sees slot j <= index + i:
    one comparison of a cached offset table with the index per step (None
    when N or L is not static). An index known on the host (an eager decoding
    loop's int) compares in NumPy: one conversion of the finished mask instead
    of a conversion of the table, a cast and a comparison on the device."""
    if n is None or length is None:
        return None
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return ops.convert_to_tensor(_slot_offsets(n, length) <= int(index))
    if hasattr(index, "dtype") and dtype_name(index) != "int32":
        index = ops.cast(index, "int32")
    return ops.less_equal(_slot_offsets(n, length), index)


def cache_visibility(
    n: Any,
    m: Any,
    cache: Any,
    index: Any,
    *,
    query_mask: Any,
    attention_mask: Any,
    use_causal_mask: bool,
    window: int | None = None,
) -> Any:
    """(B|1, H|1, N, L) bool over the cache's slots, or None when nothing is hidden.

    With an index, query i is token index + i: with ``use_causal_mask`` it
    sees slots j <= index + i (bottom-right), without it the slots written so
    far (j < index + M); ``window`` keeps |index + i - j| < window. Without an
    index the cache is read as it is.
    """
    L = ops.shape(cache)[2]
    if index is None:
        return visibility(n, L, query_mask=query_mask, attention_mask=attention_mask, window=window)
    written = None if use_causal_mask else ops.cast(index, "int32") + m
    return visibility(
        n,
        L,
        query_mask=query_mask,
        attention_mask=attention_mask,
        causal=use_causal_mask,
        query_offset=index,
        valid_length=written,
        window=window,
    )


def check_cache_dtype(layer: keras.layers.Layer, dtype: Any) -> str:
    """The dtype of a new cache: the layer's compute dtype (Keras casts floating
    call inputs to it, a cache included, so any other float dtype is refused)."""
    if dtype is None:
        return layer.compute_dtype
    wanted = keras.backend.standardize_dtype(dtype)
    if wanted not in FLOAT_DTYPES:
        raise DamchaTypeError(dc.invalid_argument("dtype", "a float dtype for a cache", f"dtype={describe(dtype)}"))
    if wanted != layer.compute_dtype and layer.autocast:
        raise DamchaValueError(
            dc.invalid_argument(
                "dtype",
                f"the layer's compute dtype {layer.compute_dtype!r} for a cache: Keras casts floating call inputs "
                f"to it, so the cache would come back as {layer.compute_dtype}",
                f"dtype={wanted!r}",
            )
        )
    return wanted
