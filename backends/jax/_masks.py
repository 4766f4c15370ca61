"""The masks of the JAX functions and the NNX module: how their values are
read, how their batch axes fold, and what of their structure the fused kernel
can take instead of the mask itself.

At the boundary masks follow Flax's convention: bool, or integer/float with
values 0 and 1 (True / 1 = may attend); inside they are the reference's
boolean "True = may attend" (``read_mask``). ``_functional.plan_mask`` decides
what the attention kernel gets (it composes the spec step ``visibility``, so it
stays beside it); the structure it needs is found here: on the host when the
mask's values are known (``host_plan``), else under a ``mask_hint`` by counting
on the device (``traced_split``). This module imports nothing from
``_functional``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from damcha_core import DamchaValueError, check_choice, describe, invalid_argument, mask_dtype_error

Array = jax.Array

# What the masks of the JAX functions and the NNX module may hold (DECISIONS 5).
MASK_RULE = "boolean (True = may attend) or numeric with only 0 and 1 (non-zero = attend)"
# What ``mask_hint`` may say about a mask: "causal" = the causal rule and padding
# (key and query) only, "padding" = padding only (see ``_functional.plan_mask``).
MASK_HINTS = ("causal", "padding")


# ----------------------------------------------------------------- reading


def np_dtype(value: Any) -> np.dtype | None:
    """The NumPy dtype of an array-like (JAX, NumPy, tracer), None if it has none
    NumPy knows (a list, a torch tensor)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


class MaskArg(NamedTuple):
    """A checked mask: ``array`` the bool "may attend" mask the math takes,
    ``host`` the same values as NumPy when DAMCHA holds them anyway (a NumPy
    mask, or a concrete numeric mask read for the 0/1 rule), ``flag`` a traced
    bool scalar that turns the output into NaN (None when nothing needs it),
    ``rows`` whether each row of ``array`` shows a key (its ``any`` over the
    last axis, shape ``array.shape[:-1]``) when reading the mask gave it
    anyway (None: not known), ``raw`` the traced numeric mask as given when
    ``flag`` is its 0/1 rule (a hint's check then reads the values once for
    both, ``traced_split``; None otherwise), ``shape`` the mask's shape as
    the user passed it, for messages (None: ``host``'s shape, when it was
    not reshaped)."""

    array: Array | None
    host: np.ndarray | None
    flag: Array | None
    rows: Array | None = None
    raw: Array | None = None
    shape: tuple[int, ...] | None = None


def _traced_numeric(mask: Array) -> MaskArg:
    """A traced numeric mask read in one pass: per row, the largest of 0 (a
    zero), 1 (a one) and 2 (any other value, NaN included) gives both the
    0/1 rule's flag and which rows show a key (what ``plan_mask`` would
    otherwise reduce the mask again for). Measured on XLA:CPU: half the
    bytes of ``mask != 0`` and ``(mask != 0) & (mask != 1)`` reduced apart
    (two reads of the float mask and two bool copies, about 4% of a layer's
    forward bytes at N=1024)."""
    code = jnp.where(mask == 0, 0, jnp.where(mask == 1, 1, 2)).astype(jnp.int8)
    per_row = jnp.max(code, axis=-1)
    return MaskArg(mask != 0, None, jnp.any(per_row == 2), per_row != 0, mask, tuple(mask.shape))


def read_mask(mask: Any, name: str = "mask") -> MaskArg:
    """``mask`` checked and converted (see ``check_mask``), with its host values when known."""
    if mask is None:
        return MaskArg(None, None, None)
    dtype = np_dtype(mask)
    if dtype is None or not (
        dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise mask_dtype_error(mask, name, MASK_RULE)
    if dtype == np.bool_:
        # A bool JAX array is not read back here (a device sync; with a mask_hint check_hinted reads it);
        # a NumPy one is on the host already.
        host = mask if isinstance(mask, np.ndarray) else None
        return MaskArg(jnp.asarray(mask), host, None, shape=tuple(mask.shape))
    if isinstance(mask, jax.core.Tracer):
        return _traced_numeric(mask)
    values = np.asarray(mask)
    if not np.all((values == 0) | (values == 1)):
        raise DamchaValueError(
            invalid_argument(
                name,
                f"a mask that is {MASK_RULE} (an additive 0/-inf mask? pass `{name} == 0` for one, or a bool mask)",
                f"{name}={describe(mask)} that holds other values",
            )
        )
    host = values != 0
    return MaskArg(jnp.asarray(host), host, None, shape=tuple(values.shape))


def check_mask(mask: Any, name: str = "mask") -> tuple[Array | None, Array | None]:
    """``mask`` as the bool "may attend" array the math takes, and a flag.

    bool masks pass. Integer and floating masks are read as Flax and Keras
    read them (non-zero = attend) only when they hold nothing but 0 and 1: any
    other value (an additive 0/-inf mask would be read inverted) is a
    DamchaValueError when the values are concrete. Under ``jit`` they cannot
    be inspected; the returned flag (a traced bool scalar, None when nothing
    needs checking) is True when such a value is present, and the caller then
    turns its output into NaN.
    """
    checked = read_mask(mask, name)
    return checked.array, checked.flag


def check_hint(mask_hint: Any, mask: Any) -> str | None:
    """``mask_hint`` is None, "causal" or "padding", and needs a mask to describe."""
    if mask_hint is None:
        return None
    hint = check_choice("mask_hint", mask_hint, MASK_HINTS)
    if mask is None:
        raise DamchaValueError(
            invalid_argument(
                "mask_hint",
                "None without a `mask` (it describes the mask; use is_causal=True for causal attention without one)",
                f"mask=None, mask_hint={hint!r}",
            )
        )
    return hint


def fold_mask(mask: MaskArg, lead: tuple[int, ...]) -> MaskArg:
    """A Flax mask [batch..., H|1, N|1, M] broadcast over the batch axes and
    folded to (B, H|1, N|1, M) (its host values too, when known)."""
    array = mask.array
    if array is None or array.ndim != len(lead) + 3 or len(lead) == 1:
        return mask
    tail = tuple(array.shape[-3:])
    B = math.prod(lead)  # not int(): a symbolic batch size (jax.export) stays symbolic
    host = None if mask.host is None else np.reshape(np.broadcast_to(mask.host, (*lead, *tail)), (B, *tail))
    rows = mask.rows
    if rows is not None:
        rows = jnp.reshape(jnp.broadcast_to(rows, (*lead, *tail[:-1])), (B, *tail[:-1]))
    raw = mask.raw
    if raw is not None:
        raw = jnp.reshape(jnp.broadcast_to(raw, (*lead, *tail)), (B, *tail))
    return MaskArg(
        jnp.reshape(jnp.broadcast_to(array, (*lead, *tail)), (B, *tail)), host, mask.flag, rows, raw, mask.shape
    )


def reshape_mask(mask: MaskArg, shape: tuple[int, ...]) -> MaskArg:
    """``mask`` with size-1 axes dropped to ``shape`` (same values; ``shape``
    keeps the shape as passed, for messages)."""
    if mask.array is None or tuple(mask.array.shape) == shape:
        return mask
    host = None if mask.host is None else np.reshape(mask.host, shape)
    rows = None if mask.rows is None else jnp.reshape(mask.rows, shape[:-1])
    raw = None if mask.raw is None else jnp.reshape(mask.raw, shape)
    return MaskArg(jnp.reshape(mask.array, shape), host, mask.flag, rows, raw, mask.shape)


# ---------------------------------------------------------------- planning


def mask4(mask: Array | None) -> Array | None:
    if mask is None:
        return None
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def causal_grid(n: int, m: int, query_offset: Any) -> Array:
    """(N, M) bool: query i (at position offset + i) sees key j <= offset + i."""
    return jnp.arange(m)[None, :] <= jnp.arange(n)[:, None] + query_offset


class MaskPlan(NamedTuple):
    """How ``attend`` applies a mask.

    ``kernel_mask`` and ``kernel_causal`` are what the fused kernel gets
    (``jax.nn.dot_product_attention``'s ``mask`` and ``is_causal``), ``rows``
    (b, h, N|1) says which query rows see at least one key (None: all; the
    others get output 0), ``visible`` is the whole may-attend mask for the
    einsum path (None: all), ``flag`` turns the output into NaN when True.
    """

    kernel_mask: Array | None
    kernel_causal: bool
    rows: Array | None
    visible: Array | None
    flag: Array | None


def or_masks(a: Array | None, b: Array | None) -> Array | None:
    return b if a is None else a if b is None else a | b


def _host_split(v: np.ndarray, grid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(key_ok (b, h, M), rows (b, h, N)) when v (b, h, N, M) == grid & rows x key_ok, else None."""
    # np.asarray: NumPy types a reduction along an axis as array-or-scalar; v is 4-D.
    rows, keys = np.asarray(v.any(-1)), np.asarray(v.any(-2))
    recon = rows[..., :, None] & keys[..., None, :]
    if grid is not None:
        recon = recon & grid
    return (keys, rows) if np.array_equal(v, recon) else None


def _what_mask(full: np.ndarray, grid: np.ndarray) -> str:
    """What a mask (b, h, N, M) whose hint it contradicts is, for the message."""
    if _host_split(full, None) is not None:
        return "a mask that is padding only (mask_hint='padding'; is_causal=True adds the causal rule)"
    if _host_split(full, grid) is not None:
        return "a mask that is the causal rule and padding (mask_hint='causal')"
    return "a mask that is neither the causal rule and padding nor padding only (pass it without mask_hint)"


def host_plan(
    host: np.ndarray,
    n: int,
    m: int,
    *,
    is_causal: bool,
    offset: int,
    hint: str | None,
    name: str,
    shape: tuple[int, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """(key_ok, rows, kernel_causal) of a mask (b, h, N|1, M|1) whose values
    are on the host, or None when it is neither causal nor padding; a wrong
    ``hint`` raises (naming the mask's ``shape`` as passed; default ``host``'s,
    the hint and what the mask is)."""
    full = np.broadcast_to(host, host.shape[:2] + (n, m))
    grid = np.arange(m)[None, :] <= np.arange(n)[:, None] + offset
    if hint is not None:
        split = _host_split(full, grid if hint == "causal" else None)
        if split is None:
            received = tuple(host.shape) if shape is None else tuple(shape)
            raise DamchaValueError(
                invalid_argument(
                    name,
                    f"what mask_hint={hint!r} says, "
                    + (
                        "the causal rule and padding only (combine_masks(make_causal_mask, padding masks))"
                        if hint == "causal"
                        else "padding only (make_attention_mask of query and key padding)"
                    )
                    + "; drop mask_hint for any other mask",
                    f"{name}.shape={received}, mask_hint={hint!r}, {_what_mask(full, grid)}",
                )
            )
        keys, rows = split
        causal = is_causal or hint == "causal"
        if causal and hint == "padding":
            rows = np.asarray((full & grid).any(-1))
        return keys, rows, causal
    visible = full & grid if is_causal else full
    split = _host_split(visible, grid if is_causal else None)
    if split is not None:
        return split[0], split[1], is_causal
    if not is_causal and n > 1:  # the mask itself may be causal (make_causal_mask without is_causal)
        split = _host_split(full, grid)
        if split is not None:
            return split[0], split[1], True
    return None


def check_hinted(
    mask: MaskArg, n: int, m: int, *, hint: str | None, offset: Any, name: str = "mask", keep: bool = True
) -> MaskArg:
    """A hinted mask whose values are concrete, checked against its hint at the
    boundary, before any projection or dropout draw: one that is not what the
    hint says raises (``host_plan``'s DamchaValueError) where under ``jit``
    (values unknown) ``traced_split`` makes the output NaN.

    ``mask`` is [..., h|1, N|1, M|1] or fewer axes (its batch axes are
    flattened: each slice is checked apart); ``offset`` is the causal rule's
    query offset (the cache index when decoding; a traced one leaves the check
    to the device). A concrete JAX bool mask, which is otherwise never read
    back, is read here, only because a hint asks for the check: one transfer of
    the mask, eager calls (or a constant of a jitted function, while tracing)
    only; a traced mask costs nothing. With ``keep`` the values read are
    returned in ``host`` (``plan_mask`` then plans on the host, with no device
    reductions); ``keep=False`` returns ``mask`` as it was.
    """
    array = mask.array
    if hint is None or array is None or isinstance(offset, jax.core.Tracer):
        return mask
    host = mask.host
    if host is None:
        if isinstance(array, jax.core.Tracer) or not getattr(array, "is_fully_addressable", True):
            return mask
        host = np.asarray(array)
    shape = np.shape(host)
    if len(shape) < 4:
        shape = (1,) * (4 - len(shape)) + shape
    view = np.reshape(host, (int(np.prod(shape[:-3])), *shape[-3:]))  # not -1: the mask may be empty
    passed = mask.shape if mask.shape is not None else np.shape(host)
    host_plan(view, n, m, is_causal=False, offset=int(offset), hint=hint, name=name, shape=passed)
    return mask._replace(host=host) if keep else mask


def traced_split(
    a: Array, n: int, m: int, *, hint: str, offset: Any, raw: Array | None = None
) -> tuple[Array, Array, Array]:
    """(key_ok (b, h, M), rows (b, h, N), ok) for a traced mask a (b, h, N|1, M|1)
    under ``hint``: ok (a bool scalar) is whether a really is
    [causal &] rows x key_ok and, when ``raw`` (a's numeric values, same
    shape) is given, whether they are all 0 or 1 (so ok replaces the 0/1
    rule's flag).

    Two passes over the mask: key_ok is its ``any`` over the queries, and
    one reduction over the keys gives the rest, by counting. Each entry
    scores 1 for a one the reconstruction may hold (inside the causal
    grid), 0 for a zero, and at least M + 1 for anything else (a one
    outside the grid, a value other than 0 and 1, NaN), so a row's sum s
    says which rows show a key (s > 0) and, since a row's ones lie among
    key_ok's (a subset), s equal to the count the reconstruction gives the
    row means equal rows (anything else makes s > M or a different count).
    A numeric mask is scored by ``_float_counts``: arithmetic only, which
    XLA:CPU fuses into the reductions, so neither pass writes a copy of the
    mask.
    """
    if raw is not None and m < 2**24 and n < 2**24:
        values = jnp.broadcast_to(raw, raw.shape[:2] + (n, m))
        keys, sums = _float_counts(values, n, m, hint=hint, offset=offset)
    else:
        values = a if raw is None else raw
        values = jnp.broadcast_to(values, values.shape[:2] + (n, m))
        keys, sums = _int_counts(values, n, m, hint=hint, offset=offset, numeric=raw is not None)
    rows = sums > 0
    if hint == "padding":
        expected = jnp.sum(keys, axis=-1, dtype=jnp.int32)[..., None]
    else:
        # keys j <= i + offset that the reconstruction gives row i: a prefix count of key_ok.
        prefix = jnp.cumsum(keys, axis=-1, dtype=jnp.int32)
        last = jnp.minimum(jnp.arange(n) + offset, m - 1)
        expected = jnp.take(prefix, last, axis=-1)
    return keys, rows, jnp.all(sums == jnp.where(rows, expected, 0).astype(sums.dtype))


def _float_counts(values: Array, n: int, m: int, *, hint: str, offset: Any) -> tuple[Array, Array]:
    """``traced_split``'s key_ok and row sums of a numeric mask (b, h, N, M), N, M < 2**24.

    Floating sums in float32 (float64 for a float64 mask, which float32
    could round to 0 or 1), with no compare or select: XLA:CPU's fused
    reductions take abs, min, max, sign and products but not those, which
    made it write the mask's scores (int32) and its != 0 (bool) out for the
    reductions to read back: 73 MiB for a (4, 1, 1024, 1024) float mask,
    32 MiB (two reads) now (``tests/test_jax_compiled_cost.py``).

    Exact: an entry scores |v| * (1 + M * over) + (M + 1) * sign(d), with
    over = max(j - i - offset, 0) (> 0 outside the causal grid) and d =
    min(|v|, |v - 1|) (> 0 for any value but 0 and 1, NaN for NaN): 0 for
    a zero, 1 for a one in the grid, at least M + 1 (or inf, NaN) for
    anything else. Every score is >= 0, so a float sum, rounded in any
    order, is at least its largest term: a row with anything else sums to
    more than M, which no expected count reaches; rows of zeros and ones
    in the grid sum exactly (integers below 2**24). key_ok is the sum over
    the queries > 0, exact whenever every value is 0 or 1 (else ok is
    False and nothing reads it). XLA:CPU flushes subnormal floats to zero
    in these sums as in the compares that read the mask elsewhere, so
    both see such a value as 0.
    """
    dt = jnp.float64 if values.dtype == jnp.float64 else jnp.float32
    v = values.astype(dt)
    keys = jnp.sum(v, axis=-2) > 0
    mag = jnp.abs(v)
    score = mag + (m + 1.0) * jnp.sign(jnp.minimum(mag, jnp.abs(v - 1.0)))
    if hint != "padding":
        # Vectors, not causal_grid's compare: the product stays inside the fused reduction.
        over = jnp.maximum(jnp.arange(m, dtype=dt)[None, :] - (jnp.arange(n, dtype=dt) + offset)[:, None], 0.0)
        score = score + m * over * mag
    return keys, jnp.sum(score, axis=-1)


def _int_counts(values: Array, n: int, m: int, *, hint: str, offset: Any, numeric: bool) -> tuple[Array, Array]:
    """``traced_split``'s key_ok and row sums by compares: a bool mask (the
    float scores would convert it to a float copy first, measured 76 MiB
    against 41 at (4, 1, 1024, 1024)), or N or M too large for float32 counts."""
    one, zero = (values == 1, values == 0) if numeric else (values, ~values)
    keys = jnp.any(values != 0, axis=-2) if numeric else jnp.any(values, axis=-2)
    allowed = one if hint == "padding" else one & causal_grid(n, m, offset)
    if m * (m + 1) < 2**31:
        score = jnp.where(allowed, 1, jnp.where(zero, 0, m + 1)).astype(jnp.int32)
        return keys, jnp.sum(score, axis=-1, dtype=jnp.int32)
    # M * (M + 1) would overflow int32: count and flag apart
    sums = jnp.sum(allowed, axis=-1, dtype=jnp.int32)
    return keys, jnp.where(jnp.any(~allowed & ~zero, axis=-1), m + 1, sums)
