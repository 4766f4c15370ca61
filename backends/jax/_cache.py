"""Decoding with a key/value cache: the pure ``init_cache``/``decode_step``
and the NNX module's cache (``DecodeCache``, a base class of ``DamchaAttention``).

The cache stores the *transformed* keys k~ = L_k(c) k: the key map depends
only on the key's own token, so it is never recomputed, at no extra size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

import jax
import jax.numpy as jnp
from damcha_core import (
    DamchaConfig,
    DamchaTypeError,
    DamchaValueError,
    check_int,
    check_shapes,
    config_sizes,
    describe,
    invalid_argument,
)

from ._functional import (
    Array,
    Params,
    _check_config,
    _output,
    _poison,
    _prepare,
    _qkv,
    attend,
    check_precision,
    is_real_floating_dtype,
)
from ._masks import MaskArg, check_hint, check_hinted, np_dtype, read_mask


def init_cache(config: DamchaConfig, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> dict[str, Array]:
    """An empty decoding cache: transformed keys k~ (B, L, G, d), values v
    (B, L, G, d_v) and the number of filled positions ``index`` (int32).

    k~ is cached instead of k: the key map depends only on the key's own
    token, so it never has to be recomputed, at no extra size.
    """
    _check_config(config)
    # A batch of 0 is an empty cache, as Flax's init_cache((0, L, E)) makes one (its
    # steps give empty outputs); a cache of no position could hold no token.
    batch_size = check_int("batch_size", batch_size, minimum=0)
    max_length = check_int("max_length", max_length)
    return _empty_cache(config, (batch_size,), max_length, dtype)


def _check_cache_dtype(dtype: Any) -> Any:
    if not is_real_floating_dtype(dtype):
        raise DamchaTypeError(invalid_argument("dtype", "a floating dtype", f"dtype={describe(dtype)}"))
    return dtype


def _empty_cache(config: DamchaConfig, batch: tuple[int, ...], max_length: int, dtype: Any) -> dict[str, Array]:
    """Zeros of shape [batch..., L, G, d] and [batch..., L, G, d_v], and index 0."""
    dtype = _check_cache_dtype(dtype)
    G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
    return {
        "key": jnp.zeros((*batch, max_length, G, d), dtype),
        "value": jnp.zeros((*batch, max_length, G, d_v), dtype),
        "index": jnp.zeros((), jnp.int32),
    }


def _check_cache(cache: Mapping[str, Any], config: DamchaConfig) -> tuple[Array, Array, Array]:
    """The cache's arrays, checked against ``config`` (a cache made for another
    layer would otherwise fail inside ``dynamic_update_slice``)."""
    cached_k, cached_v, index = cache["key"], cache["value"], cache["index"]
    G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
    for name, array, width in (("key", cached_k, d), ("value", cached_v, d_v)):
        shape = getattr(array, "shape", None)
        key_shape = tuple(getattr(cached_k, "shape", ()))
        if shape is None or len(shape) != 4 or tuple(shape[2:]) != (G, width) or tuple(shape[:2]) != key_shape[:2]:
            raise DamchaValueError(
                invalid_argument(
                    f"cache['{name}']",
                    f"shape (B, max_length, G, {'d' if name == 'key' else 'd_v'}) = (B, max_length, {G}, {width}) "
                    "for this config, as init_cache makes it",
                    f"cache['{name}']={describe(array)}"
                    + ("" if name == "key" else f", cache['key']={describe(cached_k)}"),
                )
            )
        dtype = np_dtype(array)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise DamchaTypeError(
                invalid_argument(f"cache['{name}']", "a floating array", f"cache['{name}']={describe(array)}")
            )
    if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
        index = jnp.asarray(index, jnp.int32)
    index_dtype = np_dtype(index)
    if getattr(index, "shape", None) != () or index_dtype is None or not jnp.issubdtype(index_dtype, jnp.integer):
        raise DamchaValueError(
            invalid_argument(
                "cache['index']",
                "an integer scalar (the number of filled positions)",
                f"cache['index']={describe(index)}",
            )
        )
    if not isinstance(index, jax.core.Tracer) and int(index) < 0:
        raise DamchaValueError(invalid_argument("cache['index']", "an int >= 0", f"cache['index']={int(index)}"))
    return jnp.asarray(cached_k), jnp.asarray(cached_v), index


def decode_attend(
    config: DamchaConfig,
    cache: Mapping[str, Array],
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | MaskArg | None = None,
    dropout_rng: Array | None = None,
    broadcast_dropout: bool = False,
    precision: Any = None,
    mask_hint: str | None = None,
    weights_out: list[Array] | None = None,
) -> tuple[Array, dict[str, Array], Array | None]:
    """Write k~ (B, T, G, d) and v (B, T, G, d_v) into ``cache`` at ``index`` and
    attend q~ (B, T, H, d) causally over the cache: query i sits at position
    index + i. Returns o (B, T, H, d_v), the new cache and the mask's NaN flag
    (the caller checks the room: ``check_room``). With ``weights_out`` the
    probabilities (B, H, T, L) over the whole cache are appended to it."""
    cached_k, cached_v, index = cache["key"], cache["value"], cache["index"]
    zero = jnp.zeros((), jnp.int32)
    start = (zero, index.astype(jnp.int32), zero, zero)
    keys = jax.lax.dynamic_update_slice(cached_k, k.astype(cached_k.dtype), start)
    values = jax.lax.dynamic_update_slice(cached_v, v.astype(cached_v.dtype), start)
    dt = jnp.result_type(q.dtype, keys.dtype, values.dtype)
    o, weights, flag = attend(
        config,
        q.astype(dt),
        keys.astype(dt),
        values.astype(dt),
        mask=mask,
        is_causal=True,
        query_offset=index,
        return_weights=weights_out is not None,
        dropout_rng=dropout_rng,
        broadcast_dropout=broadcast_dropout,
        precision=precision,
        mask_hint=mask_hint,
    )
    if weights_out is not None:
        assert weights is not None  # attend returns them when asked
        weights_out.append(weights)
    return o, {"key": keys, "value": values, "index": index + q.shape[1]}, flag


def check_room(index: Any, T: int, L: int, name: str, shape: tuple[int, ...]) -> Array | None:
    """A concrete cache index must leave room for T more positions (raises if
    not; returns None). A traced one (under jit) cannot be checked on the host:
    returns the flag index + T > L for the output's NaN poison, where
    dynamic_update_slice would clamp the index and overwrite the last slots
    silently."""
    if isinstance(index, jax.core.Tracer):
        return index + T > L
    if int(index) + T > L:
        raise DamchaValueError(
            invalid_argument(
                name,
                f"at most {L - int(index)} new tokens: "
                + ("the cache is full" if int(index) >= L else f"the cache has room for {L - int(index)} more")
                + f" ({int(index)} of max_length={L} positions are used)",
                f"{name}.shape={tuple(shape)}",
            )
        )
    return None


def either_flag(a: Array | None, b: Array | None) -> Array | None:
    """Two NaN flags (None: never) as one."""
    return b if a is None else a if b is None else jnp.logical_or(a, b)


def check_step_keys(T: int, keys: int, lead: tuple[int, ...], config: DamchaConfig) -> None:
    """A decoding step appends one key per query token (as Flax's MHA
    requires): ``keys`` key tokens of another length than the ``T`` queries
    would fill the cache out of step with ``cache_index`` (slots overwritten
    next step, or left zero and attended)."""
    if keys != T:
        raise DamchaValueError(
            invalid_argument(
                "inputs_k",
                f"one key token per query token when decoding: {T}, the length of `inputs_q`",
                f"inputs_k.shape={(*lead, keys, config_sizes(config)[0])}, "
                f"inputs_q.shape={(*lead, T, config.query_dim)}",
            )
        )


def decode_step(
    params: Params,
    config: DamchaConfig,
    cache: Mapping[str, Array],
    query: Array,
    context: Array | None = None,
    *,
    value: Array | None = None,
    mask: Array | None = None,
    precision: Any = None,
    dtype: Any = None,
    mask_hint: str | None = None,
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
        value: the tokens whose values are appended (B, T, E_v) when they
            are not the context (``config.value_input_dim``).
        mask: optional mask over the whole cache, (T, L) or (B, H, T, L):
            bool, or numeric 0/1 as in ``damcha_attention``.
        precision: as ``damcha_attention``.
        dtype: computation dtype; default promotes inputs and params.
        mask_hint: as ``damcha_attention`` ("causal": the cache's causal rule,
            query i of the step seeing keys j <= index + i, and padding only;
            "padding": padding only).

    Returns:
        ``(y (B, T, E_o), new_cache)``. When ``index`` is concrete, writing
        past ``max_length`` raises; under ``jit`` the index is traced and such
        a write makes the output NaN (``dynamic_update_slice`` would clamp it
        silently), so size the cache for the whole sequence.
    """
    config = _check_config(config)
    precision = check_precision("precision", precision)
    if not isinstance(cache, Mapping) or set(cache) != {"key", "value", "index"}:
        raise DamchaValueError(
            invalid_argument(
                "cache",
                "the dict from init_cache with keys ['index', 'key', 'value']",
                f"cache={describe(cache)}" if not isinstance(cache, Mapping) else f"cache with keys {sorted(cache)}",
            )
        )
    cached_k, cached_v, index = _check_cache(cache, config)
    B, L = cached_k.shape[0], cached_k.shape[1]
    # The mask spans the whole cache (T, L), not (T, T): it is checked below, not by _prepare.
    p, config, x, c, v_tokens, _ = _prepare(params, config, query, context, value, None, dtype)
    T = x.shape[1]
    tokens = x if c is None else c
    if tokens.shape[0] != B or tokens.shape[1] != T:
        raise DamchaValueError(
            invalid_argument(
                "query" if x.shape[0] != B or c is None else "context",
                f"`query` and `context` of shape (B, T, .) with the cache's batch size B={B} and one key per "
                "query token",
                f"query.shape={tuple(x.shape)}, context.shape={None if c is None else tuple(c.shape)}",
            )
        )
    mask_hint = check_hint(mask_hint, mask)
    checked = read_mask(mask)
    if checked.array is not None:
        check_shapes(config, x.shape, (B, L, config_sizes(config)[0]), checked.array.shape)
    overflow = check_room(index, T, L, "query", x.shape)
    # A concrete mask against its hint, here (not in the compiled step, where it is traced): a
    # DamchaValueError, not NaN. keep=False: a JAX mask read for it still takes the compiled step.
    check_hinted(checked, T, L, hint=mask_hint, offset=index, keep=False)
    # Everything is checked (a concrete mask against its hint just above): the math is one
    # compiled program, one dispatch per step when eager (op by op only for a precision jit
    # cannot hash). A NumPy mask with a hint took the op-by-op step here once: 15.7 ms a
    # step against 2.9 (E=512, H=8, B=1, 512 cached keys), computing the same.
    step: Any = _compiled_step if _hashable(precision) else functools.partial(_step, host=checked.host)
    return step(
        p,
        config,
        cached_k,
        cached_v,
        index,
        x,
        c,
        v_tokens,
        checked.array,
        checked.flag,
        overflow,
        precision=precision,
        mask_hint=mask_hint,
    )


def _step(
    p: Params,
    config: DamchaConfig,
    cached_k: Array,
    cached_v: Array,
    index: Array,
    x: Array,
    c: Array | None,
    v_tokens: Array | None,
    mask: Array | None,
    flag: Array | None,
    overflow: Array | None,
    *,
    precision: Any,
    mask_hint: str | None,
    host: np.ndarray | None = None,
) -> tuple[Array, dict[str, Array]]:
    """decode_step's math on checked arguments (``mask``, ``flag``, ``host``: the
    fields of a MaskArg; ``overflow``: ``check_room``'s flag of a traced index)."""
    checked = None if mask is None else MaskArg(mask, host, flag)
    # Compiled, the maps' multiply-adds fuse into the cache update and q's copy (``cross_head_maps``' terms).
    q, k, v = _qkv(p, config, x, c, v_tokens, precision, terms=isinstance(x, jax.core.Tracer))
    o, new_cache, bad = decode_attend(
        config,
        {"key": cached_k, "value": cached_v, "index": index},
        q,
        k,
        v,
        mask=checked,
        precision=precision,
        mask_hint=mask_hint,
    )
    y = _poison(_output(p, config, o.astype(x.dtype), precision), either_flag(bad, overflow))
    return y, new_cache


# An eager step dispatches ~90 small ops one by one (each a Python-side dispatch of
# several microseconds, more than its arithmetic at B=1); compiled, it is one.
# Under an outer jit this is inlined as a nested call. config, precision and mask_hint are static.
_compiled_step = jax.jit(_step, static_argnames=("config", "precision", "mask_hint"))


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class DecodeCache:
    """The NNX module's decoding cache (a base class of ``DamchaAttention``):
    ``cached_key`` (k~, [batch..., L, G, d]), ``cached_value`` ([batch..., L,
    G, d_v]) and ``cache_index``, ``nnx.Cache`` variables named and shaped as
    in ``nnx.MultiHeadAttention``."""

    config: DamchaConfig
    cached_key: nnx.Cache | None
    cached_value: nnx.Cache | None
    cache_index: nnx.Cache | None

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        """Allocate the decoding cache for inputs of shape [batch..., max_length, E_q]
        (``(B, L, E_q)``, or ``(L, E_q)`` for unbatched decoding), as Flax does."""
        shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else None
        if shape is None or len(shape) < 2:
            raise DamchaValueError(
                invalid_argument(
                    "input_shape",
                    "a shape [batch..., max_length, features], e.g. (batch, max_length, features)",
                    f"input_shape={describe(input_shape)}",
                )
            )
        batch = tuple(check_int(f"input_shape[{i}]", n, minimum=0) for i, n in enumerate(shape[:-2]))
        max_length = check_int("max_length (input_shape[-2])", shape[-2])
        cache = _empty_cache(self.config, batch, max_length, dtype)
        self.cached_key = nnx.Cache(cache["key"])
        self.cached_value = nnx.Cache(cache["value"])
        self.cache_index = nnx.Cache(cache["index"])

    def _check_step(self, lead: tuple[int, ...], T: int, keys: int, name: str) -> Array | None:
        """Refuse a decoding step of ``T`` query and ``keys`` key tokens with batch axes ``lead``
        that the cache cannot take (not initialised, other batch axes, not one key per query,
        no room); returns ``check_room``'s flag (None, or the overflow of a traced index).

        Reads shapes and the index only, so a caller runs it before anything with an effect:
        the layer before it draws its dropout key, whose stream a refused call would advance."""
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise DamchaValueError("The decoding cache is not initialised: call init_cache(input_shape) first.")
        cached_k = self.cached_key[...]
        batch, L = tuple(cached_k.shape[:-3]), cached_k.shape[-3]
        if lead != batch:
            raise DamchaValueError(
                invalid_argument(
                    name,
                    f"the batch axes of the cache from init_cache, {batch}",
                    f"{name} with batch axes {lead} (cached_key.shape={tuple(cached_k.shape)})",
                )
            )
        check_step_keys(T, keys, lead, self.config)
        return check_room(self.cache_index[...], T, L, name, (*lead, T, self.config.query_dim))

    def _decode(
        self,
        q: Array,
        k: Array,
        v: Array,
        mask: MaskArg | None,
        *,
        dropout_rng: Array | None,
        broadcast_dropout: bool,
        precision: Any,
        name: str,
        mask_hint: str | None = None,
        weights_out: list[Array] | None = None,
    ) -> tuple[Array, Array | None]:
        """q~ [batch..., T, H, d], k~, v [batch..., T, G, .] appended to the cache;
        o [batch..., T, H, d_v] and the mask's NaN flag. With ``weights_out``
        the probabilities [batch..., H, T, L] are appended to it."""
        lead, T = tuple(q.shape[:-3]), q.shape[-3]
        # Normally checked already (before the dropout key was drawn); again here for any other caller.
        overflow = self._check_step(lead, T, k.shape[-3], name)
        assert self.cached_key is not None and self.cached_value is not None and self.cache_index is not None
        cached_k, cached_v, index = self.cached_key[...], self.cached_value[...], self.cache_index[...]
        batch = lead
        B = math.prod(batch)  # not int(): a symbolic batch size (jax.export) stays symbolic
        fold = lambda t: jnp.reshape(t, (B, *t.shape[len(batch) :]))  # noqa: E731
        cache = {"key": fold(cached_k), "value": fold(cached_v), "index": index}
        folded: list[Array] = []
        o, cache, flag = decode_attend(
            self.config,
            cache,
            fold(q),
            fold(k),
            fold(v),
            mask=mask,
            dropout_rng=dropout_rng,
            broadcast_dropout=broadcast_dropout,
            precision=precision,
            mask_hint=mask_hint,
            weights_out=None if weights_out is None else folded,
        )
        if weights_out is not None:
            weights_out.extend(jnp.reshape(w, (*lead, *w.shape[1:])) for w in folded)
        self.cached_key[...] = jnp.reshape(cache["key"], cached_k.shape)
        self.cached_value[...] = jnp.reshape(cache["value"], cached_v.shape)
        self.cache_index[...] = cache["index"]
        return jnp.reshape(o, (*lead, *o.shape[1:])), either_flag(flag, overflow)

    def _decode_mask(self, T: int) -> Array:
        """(1, 1, T, L) bool: query i of this step (position index + i) sees cached keys j <= index + i."""
        cached_key, cache_index = self.cached_key, self.cache_index
        assert cached_key is not None and cache_index is not None  # the caller found the cache initialised
        L = cached_key.shape[-3]
        index = cache_index[...]
        return (jnp.arange(L)[None, :] <= jnp.arange(T)[:, None] + index)[None, None]
