"""The masks of a ``DamchaAttention`` call: their checks, how their values are
read, and which mask reaches the attention.

At the boundary masks follow Keras MHA's convention: boolean, or integer/float
with values 0 and 1 (True / 1 = may attend). Inside they are the reference's
boolean "True = may attend". A call's masks reach the attention in one of two
forms, planned here: the fused kernel's ``is_causal`` and a (B, 1, 1, M) key
mask (``kernel_plan``) when they are causal and/or padding only, or else the
full boolean mask that MHA's ``_compute_attention`` hook takes (``hook_mask``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import damcha_core as dc
from damcha_core import DamchaValueError
from keras import ops

from . import _cache
from . import _functional as F
from ._cache import static_shape
from ._functional import dtype_name

MASK_DTYPES = ("bool", "int", "uint", "float", "bfloat")
MASK_EXPECTED = "boolean, or integer/float with values 0 and 1 (True / 1 = may attend, as Keras MHA reads them)"


class CallMasks(NamedTuple):
    """A call's masks, boolean and folded to rank-3 token layout, and
    ``values``: the attention mask's values as boolean (B|1, H|1, N, M) NumPy
    when they are known on the host at no cost (else None).

    ``attention_mask`` keeps its Keras shape ((N, M), (B, N, M) or
    (B|1, H|1, N, M); ``F.as_4d`` reads it as 4-D) and, when its values are
    known on the host, may be that NumPy array: it becomes a tensor only where
    the call needs it as one (``hook_mask``, a key-only mask in
    ``kernel_plan``), so a mask the fused kernel reads as causal costs no op."""

    query_mask: Any
    value_mask: Any
    key_mask: Any
    attention_mask: Any
    values: np.ndarray | None


class KernelPlan(NamedTuple):
    """The fused kernel's arguments: ``mask`` (a key mask or the cache's causal
    slots), ``is_causal`` and ``keep`` (the query rows that see some key)."""

    mask: Any
    is_causal: bool
    keep: Any


# ----------------------------------------------------------------- checks


def as_tensors(masks: dict[str, Any]) -> dict[str, Any]:
    """The masks with Python lists and tuples made arrays, as Keras MHA takes them (``ops.cast``).

    A NumPy array rather than a tensor: its values are then known on the host
    (``read_masks``), as for a NumPy mask. Anything else without a dtype (a
    string, a number, a set) is refused with the mask dtype error; tensors and
    arrays pass as they are, and ``check_dtypes`` judges the converted dtype.
    """
    out = dict(masks)
    for name, m in masks.items():
        if m is None or hasattr(m, "dtype"):
            continue
        if isinstance(m, (list, tuple)):
            try:
                out[name] = np.asarray(m)
            except (ValueError, TypeError):  # ragged or mixed: not an array
                raise dc.mask_dtype_error(
                    m, name, MASK_EXPECTED + " (a tensor, array or rectangular nested list)"
                ) from None
            continue
        raise dc.mask_dtype_error(m, name, MASK_EXPECTED + " (a tensor, array or rectangular nested list)")
    return out


def check_dtypes(masks: dict[str, Any]) -> None:
    for name, m in masks.items():
        if m is not None and not dtype_name(m).startswith(MASK_DTYPES):
            raise dc.mask_dtype_error(m, name, MASK_EXPECTED)


def check_shapes(
    masks: dict[str, Any],
    layout: F.Layout,
    num_heads: int,
    query: Any,
    value: Any,
    N: int | None,
    M: int | None,
    kv_len: int | None,
) -> None:
    """Each mask's shape against the query and value tokens (with a cache, the
    key masks span its ``kv_len`` slots); N and M are the attended lengths,
    None where unknown (symbolic)."""
    qs, vs = static_shape(query), static_shape(value)
    q_tokens, v_tokens = tuple(qs[:-1]), tuple(vs[:-1])
    if kv_len is not None:
        v_tokens = (vs[0], kv_len)
    for name, m, target in (
        ("query_mask", masks.get("query_mask"), q_tokens),
        ("value_mask", masks.get("value_mask"), v_tokens),
        ("key_mask", masks.get("key_mask"), v_tokens),
    ):
        if m is None:
            continue
        shape = static_shape(m)
        if len(shape) != len(target) or any(s is not None and t is not None and s != t for s, t in zip(shape, target)):
            raise DamchaValueError(
                dc.invalid_argument(
                    name,
                    f"shape {target} (the {'query' if name == 'query_mask' else 'key'} tokens) for "
                    f"query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}",
                    f"{name}.shape={shape}",
                )
            )
    m = masks.get("attention_mask")
    if m is not None:
        _check_attention_mask(layout, num_heads, static_shape(m), qs, vs, N, M, query, value)


def _check_attention_mask(
    layout: F.Layout, H: int, shape: tuple, qs: tuple, vs: tuple, N: Any, M: Any, query: Any, value: Any
) -> None:
    rank_shapes: dict[int, tuple]
    if not layout.folded:
        rank_shapes = {2: (N, M), 3: (qs[0], N, M), 4: (qs[0], H, N, M)}
    else:
        axes = layout.attention_axes
        full = (qs[0], *[qs[a] for a in layout.batch_axes], H, *[qs[a] for a in axes], *[vs[a] for a in axes])
        # Keras inserts a missing dim before the attention dims, one at a time.
        rank_shapes = {}
        for rank in range(2 * len(axes), len(full) + 1):
            lead = full[: rank - 2 * len(axes)]
            rank_shapes[rank] = lead + full[len(full) - 2 * len(axes) :]
    target = rank_shapes.get(len(shape))
    if target is None or any(s is not None and t is not None and s not in (1, t) for s, t in zip(shape, target)):
        expected = " or ".join(str(t) for t in rank_shapes.values())
        raise DamchaValueError(
            dc.invalid_argument(
                "attention_mask",
                f"shape {expected} (size-1 dims broadcast) for "
                f"query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}",
                f"attention_mask.shape={shape}",
            )
        )


# ---------------------------------------------------------------- reading


def read_masks(masks: dict[str, Any]) -> tuple[dict[str, Any], Any, np.ndarray | None]:
    """Boolean masks (True = may attend), a NaN poison scalar (or None), and
    the attention mask's values as boolean NumPy when they are known on the
    host at no cost (else None; ``kernel_plan`` reads causal and padding
    structure from them).

    Integer and float masks are read as Keras reads them, non-zero = may
    attend, only when their values are 0 and 1. Other values are refused
    when they are known; under tracing they cannot be inspected, and the
    poison makes the output NaN instead of silently reading an additive
    mask inverted."""
    out: dict[str, Any] = {}
    bad: Any = None
    host: np.ndarray | None = None
    for name, m in masks.items():
        if m is None or dtype_name(m) == "bool":
            out[name] = m
            if name == "attention_mask" and m is not None:
                host = F.host_values(m)
                if host is not None:
                    tri = F.causal_values(host)
                    host = host if tri is None else tri
            continue
        values = on_host = F.host_values(m)
        if values is None:
            try:
                values = np.asarray(ops.convert_to_numpy(m))
            except Exception:  # noqa: BLE001 - traced (each backend raises its own error type): checked in the graph instead
                values = None
        nonzero = None
        if values is not None:
            # An exact (N, N) lower triangle (ops.tril(ops.ones(...))): one comparison, 0/1 proven.
            tri = F.causal_values(values)
            nonzero = values != 0 if tri is None else tri
            # Values are 0/1 exactly when they equal their own non-zero pattern (NaN is not).
            if tri is None and not np.array_equal(values, nonzero):
                raise DamchaValueError(
                    dc.invalid_argument(
                        name,
                        f"only 0 and 1 in a {dtype_name(m)} mask (1 = may attend, as Keras reads masks); "
                        "other values, e.g. an additive 0/-inf mask, would be misread: pass a boolean mask "
                        "(True = may attend)",
                        f"{name}.shape={tuple(m.shape)} of dtype {dtype_name(m)} with other values",
                    )
                )
            if name == "attention_mask":
                host = nonzero
        else:
            wrong = ops.any(ops.logical_and(ops.not_equal(m, 0), ops.not_equal(m, 1)))
            bad = wrong if bad is None else ops.logical_or(bad, wrong)
        # Values on the host: the boolean mask is a constant (no op in a traced graph);
        # the attention mask stays NumPy until a full mask is needed (CallMasks).
        if on_host is None:
            out[name] = ops.not_equal(m, 0)
        else:
            out[name] = nonzero if name == "attention_mask" else ops.convert_to_tensor(nonzero)
    return out, bad, host


def fold(
    layout: F.Layout, masks: dict[str, Any], values: np.ndarray | None, query: Any, value: Any, num_heads: int
) -> CallMasks:
    """The boolean masks of ``read_masks`` in the layout the attention runs in
    (rank-3 tokens); ``values`` are kept, as 4-D, for unfolded inputs only.
    An unfolded attention mask keeps its Keras shape (``CallMasks``): no
    expand_dims unless it is read as a full mask."""
    attention_mask = masks["attention_mask"]
    if attention_mask is not None and layout.folded:
        attention_mask = layout.fold_attention_mask(attention_mask, query, value, num_heads)
    if values is not None and not layout.folded:
        while values.ndim < 4:  # as F.as_4d: (N, M) -> (1, 1, N, M), (B, N, M) -> (B, 1, N, M)
            values = values[..., None, :, :]
    else:
        values = None
    return CallMasks(
        layout.fold_mask(masks["query_mask"]),
        layout.fold_mask(masks["value_mask"]),
        layout.fold_mask(masks["key_mask"]),
        attention_mask,
        values,
    )


# --------------------------------------------------------------- planning


def kernel_plan(
    masks: CallMasks,
    n_static: int | None,
    m_static: int | None,
    *,
    use_causal_mask: bool,
    cache: Any,
    cache_update_index: Any,
    window: int | None,
) -> KernelPlan | None:
    """The fused kernel's masks when the call's masks allow them, else None.

    Masks that are causal and/or padding only reach the fused kernel as
    ``is_causal`` and a (B, 1, 1, M) key mask, never as an N x M mask
    (``F.kernel_masks``): ``use_causal_mask``, the query/value/key masks
    (Keras fills them from ``Embedding(mask_zero=True)``), and an
    ``attention_mask`` whose values are known on the host (``masks.values``)
    and are exactly causal and/or padding (``F.split_mask``:
    ``ops.tril(ops.ones((N, N)))``, a causal-and-padding mask). Such a mask
    of any other form (the only mask, with or without ``use_causal_mask``)
    reaches the kernel as it is, its empty rows read from its values
    (``_general_plan``). A decoding step's causal rule over the cache is one
    comparison against a cached (N, L) offset table. Anything else (an
    attention mask that is traced or beside other masks, a sliding window)
    needs the full boolean mask (``hook_mask``).
    """
    query_mask, value_mask, key_mask, attention_mask = masks[:4]
    # The query dim is the second to last in every Keras mask shape.
    over_queries = attention_mask is not None and static_shape(attention_mask)[-2] != 1
    if attention_mask is not None and not over_queries:
        attention_mask = F.as_4d(ops.convert_to_tensor(attention_mask))
    key_part, rows, causal = attention_mask, None, use_causal_mask
    if over_queries and masks.values is not None and cache is None and window is None:
        parts = F.split_mask(masks.values)
        if parts is not None:
            rows, key_part, split_causal = parts
            key_part = None if key_part is None else ops.convert_to_tensor(key_part)
            over_queries, causal = False, causal or split_causal
        elif (
            query_mask is None
            and value_mask is None
            and key_mask is None
            and (not causal or (n_static is not None and n_static == m_static))
        ):
            return _general_plan(attention_mask, masks.values, causal)
    if (
        cache is None
        and window is None
        and not over_queries
        and (not causal or (n_static is not None and n_static == m_static))
    ):
        keys = (
            key_mask
            if value_mask is None
            else (value_mask if key_mask is None else ops.logical_and(value_mask, key_mask))
        )
        key_side = F.key_side_mask(keys, key_part)
        return KernelPlan(key_side, causal, F.kernel_masks(query_mask, key_side, causal=causal, rows=rows))
    if (
        cache is not None
        and cache_update_index is not None
        and use_causal_mask
        and window is None
        and attention_mask is None
    ):
        # Query i of a step is token index + i: it sees its own slot, so no row is empty.
        slots = _cache.causal_slots(n_static, static_shape(cache)[2], cache_update_index)
        if slots is not None:
            return KernelPlan(slots, False, None if query_mask is None else query_mask[:, :, None, None])
    return None


def _general_plan(attention_mask: Any, values: np.ndarray, causal: bool) -> KernelPlan:
    """A mask of no causal/padding form whose values are on the host: the
    kernel takes it as it is (as MHA's takes it, with ``is_causal`` beside it),
    and which query rows see no key is read from the values, so the zeroing of
    such rows (the all-masked-row rule) costs no op when there are none, the
    usual case."""
    visible = values & F._tri(values.shape[-1]) if causal else values
    seen = visible.any(axis=-1)  # (B|1, H|1, N)
    keep = None if seen.all() else ops.convert_to_tensor(np.transpose(seen, (0, 2, 1))[..., None])
    return KernelPlan(F.as_4d(ops.convert_to_tensor(attention_mask)), causal, keep)


def hook_mask(
    masks: CallMasks,
    q_in: Any,
    v_in: Any,
    *,
    use_causal_mask: bool,
    cache: Any,
    cache_update_index: Any,
    window: int | None,
    overridden: bool,
) -> tuple[Any, bool]:
    """The mask for ``_compute_attention``: the full boolean visibility (None:
    all visible), and whether the call is causal alone, which then reaches the
    hook as ``use_causal_mask=True`` with no mask, as in MHA (not for a
    subclass that overrides the hook: it gets the full mask)."""
    n_static, m_static = static_shape(q_in)[1], static_shape(v_in)[1]
    if masks.attention_mask is not None:
        masks = masks._replace(attention_mask=ops.convert_to_tensor(masks.attention_mask))
    causal_only = (
        use_causal_mask
        and not overridden
        and cache is None
        and window is None
        and all(m is None for m in masks[:4])
        and n_static is not None
        and n_static == m_static
    )
    n, m = ops.shape(q_in)[1], ops.shape(v_in)[1]
    if causal_only:
        return None, True
    if cache is not None:
        visible = _cache.cache_visibility(
            n,
            m,
            cache,
            cache_update_index,
            query_mask=masks.query_mask,
            attention_mask=masks.attention_mask,
            use_causal_mask=use_causal_mask,
            window=window,
        )
    else:
        visible = F.visibility(
            n,
            m,
            query_mask=masks.query_mask,
            value_mask=masks.value_mask,
            key_mask=masks.key_mask,
            attention_mask=masks.attention_mask,
            causal=use_causal_mask,
            window=window,
        )
    return visible, False
