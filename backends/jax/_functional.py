"""DAMCHA as pure JAX functions over the canonical flat parameter dict.

Every function here is jit-compatible with the ``DamchaConfig`` static (it is a
frozen, hashable dataclass), differentiable, and vmap-able over extra leading
axes. Shapes use the spec's names: B batch, N query length, M key length, H
query heads, G key/value heads, d key size, d_v value size, E feature size.

The spec's steps carry the reference's names: ``rms_normalise``,
``generator``, ``apply_map``, ``visibility``, ``softmax_attend``,
``damcha_attention`` and ``metric_penalty``; the metric structures' math is
``damcha_core``'s table (``config.metric_structure``) evaluated with
``jax.numpy``.
"""

from __future__ import annotations

import functools
import numbers
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from damcha_core import (
    METRIC_STRUCTURES,
    RMS_EPS,
    DamchaConfig,
    DamchaTypeError,
    DamchaValueError,
    MetricStructure,
    check_bool,
    check_choice,
    check_config,
    check_offset,
    check_params,
    check_shapes,
    describe,
    float_dtype_error,
    invalid_argument,
    role_penalty,
    side_of,
)
from jax.ad_checkpoint import checkpoint_name

from ._masks import (
    MaskArg,
    MaskPlan,
    check_hint,
    check_hinted,
    host_plan,
    mask4,
    np_dtype,
    or_masks,
    read_mask,
    traced_split,
)

Array = jax.Array
Params = Mapping[str, Any]

# float64 attention runs as einsums (the fused kernel's softmax is float32).
# Tests set this False to hold the fused path itself to float64 inputs.
EINSUM_FOR_FLOAT64 = True

# --------------------------------------------------------------------- checks


def _check_config(config: Any) -> DamchaConfig:
    return check_config(config)


def _is_float(dtype: np.dtype | None) -> bool:
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def check_float(name: str, value: Any) -> Array:
    """A real floating array (float16/32/64, bfloat16) as a JAX array; anything
    else (ints, lists, other frameworks' tensors) is a DamchaTypeError naming ``name``."""
    if not _is_float(np_dtype(value)):
        raise float_dtype_error(name, value)
    return jnp.asarray(value)


def _poison(y: Array, flag: Array | None) -> Array:
    """NaN outputs when a traced mask held values other than 0 and 1 (see ``_masks.check_mask``)."""
    return y if flag is None else jnp.where(flag, jnp.asarray(jnp.nan, y.dtype), y)


def _check_offset(query_offset: Any) -> Any:
    """A Python int >= 0, or an integer scalar array (a decode cache index)."""
    if (
        isinstance(query_offset, numbers.Integral)
        and not isinstance(query_offset, (bool, np.bool_))
        and int(query_offset) >= 0
    ):
        return int(query_offset)
    dtype = np_dtype(query_offset)
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer) and getattr(query_offset, "shape", None) == ():
        if isinstance(query_offset, jax.core.Tracer) or int(query_offset) >= 0:
            return query_offset  # a traced offset cannot be checked (as a traced cache index)
        raise DamchaValueError(
            invalid_argument(
                "query_offset", "an int >= 0", f"query_offset={int(query_offset)} ({describe(query_offset)})"
            )
        )
    return check_offset("query_offset", query_offset)  # raises: the reference's error for the same value


def _check_key(name: str, key: Any) -> Any:
    """A JAX PRNG key: a typed key array, or a raw uint32 key (shape (2,) for threefry)."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = np_dtype(key) == np.uint32 and getattr(key, "ndim", 0) >= 1
    if not (typed or raw):
        raise DamchaTypeError(
            invalid_argument(
                name, "a JAX PRNG key (jax.random.key(...) or jax.random.PRNGKey(...))", f"{name}={describe(key)}"
            )
        )
    return key


def _one_precision(p: Any) -> bool:
    if p is None or isinstance(p, (jax.lax.Precision, jax.lax.DotAlgorithm, jax.lax.DotAlgorithmPreset)):
        return True
    if isinstance(p, str):
        try:
            jax.lax.Precision(p)
        except ValueError:
            return False
        return True
    return False


def check_precision(name: str, value: Any) -> Any:
    """What ``jax.lax.dot_general`` takes as ``precision``: None, a
    ``jax.lax.Precision`` or its name ("highest", "float32", ...), a
    ``DotAlgorithm``/``DotAlgorithmPreset``, or a pair of precisions (one per
    operand). Checked here so that a bad one names the argument, not a JAX
    internal at the first product."""
    pair = isinstance(value, (tuple, list)) and len(value) == 2
    if _one_precision(value) or (pair and all(p is not None and _one_precision(p) for p in value)):
        return value
    expected = (
        "None, a jax.lax.Precision or its name ('default', 'high', 'highest', 'bfloat16', 'tensorfloat32', "
        "'float32'), a jax.lax.DotAlgorithm(Preset), or a pair of precisions"
    )
    bad_name = isinstance(value, str) or (pair and any(isinstance(p, str) for p in value))
    error = DamchaValueError if bad_name else DamchaTypeError
    raise error(invalid_argument(name, expected, f"{name}={describe(value)}"))


def is_real_floating_dtype(dtype: Any) -> bool:
    """A real floating dtype (float16/32/64, bfloat16), given as anything
    ``jnp.issubdtype`` reads; False for complex, integer, bool and non-dtypes."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def _compute_dtype(dtype: Any, *arrays: Any) -> Any:
    if dtype is not None:
        if not is_real_floating_dtype(dtype):
            raise DamchaTypeError(invalid_argument("dtype", "a floating dtype or None", f"dtype={describe(dtype)}"))
        return jnp.dtype(dtype)
    # Like flax's promote_dtype: the widest of inputs and parameters.
    return jnp.result_type(*[a.dtype for a in arrays])


# ----------------------------------------------------------------------- math


def _acc(dtype: Any) -> Any:
    """Accumulation dtype: at least float32, as mixed-precision matmuls do."""
    return jnp.promote_types(dtype, jnp.float32)


@functools.cache
def _xp(precision: Any) -> Any:
    """``jax.numpy`` for the metric table's math, its einsums at ``precision``."""
    if precision is None:
        return jnp
    return types.SimpleNamespace(
        einsum=functools.partial(jnp.einsum, precision=precision),
        eye=jnp.eye,
        sum=jnp.sum,
        mean=jnp.mean,
        reshape=jnp.reshape,
    )


def _structure(config: DamchaConfig) -> MetricStructure:
    """``config.metric_structure`` for a config with metric sides (the only
    ones whose maps are computed); metric "none" has no structure."""
    structure = config.metric_structure
    if structure is None:
        raise DamchaValueError(
            invalid_argument(
                "config.metric",
                f"one of {tuple(METRIC_STRUCTURES)} to compute a cross-head map",
                f"config.metric={config.metric!r}",
            )
        )
    return structure


def _leaves(params: Params, config: DamchaConfig, side: str) -> dict[str, Array]:
    return {leaf: params[f"metric.{side}.{leaf}"] for leaf in _structure(config).leaf_names}


def rms_normalise(t: Array) -> Array:
    """phi(t) = t / sqrt(mean(t^2 over features) + 1e-6), in at least float32."""
    t = t.astype(_acc(t.dtype))
    return t * _rms_scale(t)


def _rms_scale(t: Array) -> Array:
    """1 / sqrt(mean(t^2) + 1e-6) per token, (B, T, 1), for t already in at least float32."""
    return jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + RMS_EPS)


def _affine_coefficients(
    structure: MetricStructure,
    tokens: Array,
    leaves: Mapping[str, Array],
    precision: Any,
    scale: Array | None = None,
) -> Array:
    """phi(t) W + b of the table's generator, evaluated as rsqrt(mean t^2 + eps) * (t W) + b.

    Both structures' generators are affine in phi (A = phi W_A + b_A, u = phi
    W_u + b_u), so the token's RMS scale can multiply the small GEMM output
    (S*S or r values per token) instead of the tokens (E values): the GEMM
    reads the raw tokens, as the projections do, and phi is never written out.
    ``scale`` is ``_rms_scale`` of these tokens when the caller has it already
    (two generators reading the same tokens compute it once).
    """
    t = tokens.astype(_acc(tokens.dtype))
    linear = structure.coefficients(_xp(precision), t, {**leaves, "bias": 0.0})
    scale = _rms_scale(t) if scale is None else scale
    scale = scale.reshape(t.shape[:-1] + (1,) * (linear.ndim - t.ndim + 1))
    return linear * scale + leaves["bias"]


def coefficients(metric: str, kernel: Array, bias: Array, tokens: Array, *, precision: Any = None) -> Array:
    """phi(tokens) (B, T, E) through a generator: A(t) (B, T, S, S) for metric
    "heads", u(t) (B, T, r) for "lowrank", in at least float32 (16-bit inputs
    keep float32 intermediates: rounding q and k twice would double their error)."""
    metric = check_choice("metric", metric, tuple(METRIC_STRUCTURES))
    structure = METRIC_STRUCTURES[metric]
    # The leaves' shapes in the table's symbols (E, S, r), bound by what is given:
    # a bias of another size would broadcast, a kernel of another one give other coefficients.
    dims = {leaf.name: leaf.dims for leaf in structure.leaves}
    sizes: dict[str, int] = {}
    for name, value, symbols in (
        ("tokens", tokens, ("...", "E")),
        ("kernel", kernel, dims["kernel"]),
        ("bias", bias, dims["bias"]),
    ):
        shape = getattr(value, "shape", None)
        if shape is None or not is_real_floating_dtype(getattr(value, "dtype", None)):
            raise DamchaTypeError(
                invalid_argument(name, f"a real floating array ({', '.join(symbols)})", f"{name}={describe(value)}")
            )
        fixed = symbols[1:] if symbols[0] == "..." else symbols
        known = ", ".join(f"{k}={v}" for k, v in sizes.items() if k in fixed)  # from the arguments before
        ok = len(shape) >= len(fixed) if symbols[0] == "..." else len(shape) == len(fixed)
        if ok:
            for symbol, n in zip(fixed, shape[len(shape) - len(fixed) :]):
                ok = ok and sizes.setdefault(symbol, int(n)) == int(n)
        if not ok:
            written = ", ".join(symbols) + ("," if len(symbols) == 1 else "")
            raise DamchaValueError(
                invalid_argument(
                    name,
                    f"shape ({written}) for metric {metric!r}" + (f" with {known}" if known else ""),
                    f"{name}.shape={tuple(shape)}",
                )
            )
    return _affine_coefficients(structure, tokens, {"kernel": kernel, "bias": bias}, precision)


def generator(params: Params, config: DamchaConfig, side: str, tokens: Array, *, precision: Any = None) -> Array:
    """The data-adaptive coefficients of ``side`` for tokens (B, T, E)."""
    return _affine_coefficients(_structure(config), tokens, _leaves(params, config, side), precision)


def apply_map(
    params: Params, config: DamchaConfig, side: str, y: Array, coeff: Array, *, precision: Any = None
) -> Array:
    """L(t) y for stacked heads y (B, T, S, d) given ``generator``'s coefficients,
    in at least float32."""
    return _apply_maps(config, _leaves(params, config, side), coeff, [y], precision)[0]


def _apply_maps(
    config: DamchaConfig,
    leaves: Mapping[str, Array],
    coeff: Array,
    ys: list[Array],
    precision: Any,
    biases: list[Array | None] | None = None,
    terms: bool = False,
) -> list[Array]:
    """L(t) y for each y of ``ys`` (same tokens, same side), in at least float32;
    a y with a bias in ``biases`` is the query without its projection bias
    (S, d), mapped as L(t) (y + b) by ``_mix_query``. ``terms``: the others
    as S multiply-adds too (``_mix_terms``), see ``cross_head_maps``.

    A compact structure ("heads": L(t) = l(t) (x) I_d with l = I + diag(g) A)
    maps y with one (S, S) @ (S, d) product per token (``_mix_heads``), the
    gate and the identity folded into l (no y + g * delta passes over
    (B, T, S, d)). Batched products run at HIGHEST precision unless one is
    given, so that the identity part of l leaves y unrounded (gates at 0
    stay exactly MHA on every platform; DEFAULT would round y to
    bfloat16/TF32 on TPU/GPU); it costs S*S*d per token.
    """
    structure = _structure(config)
    ys = [y.astype(_acc(y.dtype)) for y in ys]
    bs = [None if b is None else b.astype(y.dtype) for y, b in zip(ys, biases or [None] * len(ys), strict=True)]
    if not structure.compact_head_map:
        return [structure.apply(_xp(precision), coeff, y if b is None else y + b, leaves) for y, b in zip(ys, bs)]
    head_map = structure.head_map(jnp, coeff, leaves)
    prec = jax.lax.Precision.HIGHEST if precision is None else precision
    # One product per side: stacking q and k (tied) would copy both (measured: more bytes on CPU).
    if terms:
        return [_mix_terms(head_map, y) if b is None else _mix_query(head_map, y, b, prec) for y, b in zip(ys, bs)]
    return [_mix_heads(head_map, y, prec) if b is None else _mix_query(head_map, y, b, prec) for y, b in zip(ys, bs)]


def _mix_terms(head_map: Array, y: Array) -> Array:
    """l(t) y as S multiply-adds (``_mix_query`` without a bias): under ``jit``
    XLA fuses them, with l's own elementwise steps, into the consumer of y~."""
    terms = [head_map[..., :, a, None] * y[..., a, None, :] for a in range(head_map.shape[-1])]
    return functools.reduce(jnp.add, terms)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _mix_heads(head_map: Array, y: Array, precision: Any) -> Array:
    """l(t) y per token: (B, T, S, S) x (B, T, S, d) -> (B, T, S, d), one
    batched product at ``precision``; its derivative is ``_mix_heads_jvp``.

    Under ``jit`` XLA:CPU runs the product as one library fusion over all
    tokens (a few ms for a (4096, 8, 8) x (4096, 8, 64) map) and the
    attention's transposes of q~ and k~ stay plain copies, as in MHA. Writing
    l(t) y as S elementwise multiply-adds instead (the previous form) let XLA
    fuse the map into those transposes: fewer bytes, but k's transpose to the
    (B, H, d, M) layout of the logits product then gathered S strided values
    per element, measured 4-10x the plain transpose's time, the largest part
    of what the maps added to a whole model's inference at N=1024
    (``tests/test_jax_compiled_cost.py`` pins the plain transposes).
    """
    return jnp.einsum("btha,btad->bthd", head_map, y, precision=precision)


@_mix_heads.defjvp
def _mix_heads_jvp(precision: Any, primals: tuple[Array, Array], tangents: tuple[Array, Array]) -> tuple[Array, Array]:
    """d(l y) = dl y + l dy, with l dy written as l^T's transpose.

    Reverse mode transposes this rule. Plain autodiff would get y's cotangent
    as l^T g, a product contracting l's *row* axis per token, which XLA:CPU
    leaves as a per-token loop of tiny matrix products (measured: 7x the time
    of the forward product, the largest cost the maps added to a training
    step). With l^T materialised (an (S, S) transpose per token, 1/d of y's
    size) and the tangent written as l^T's contraction over its minor axis,
    the transpose is the same kind of product as the forward one. The
    barrier keeps XLA from folding the transpose back into the product.
    Forward mode (``jax.jvp``) evaluates the same rule.
    """
    head_map, y = primals
    d_map, dy = tangents
    head_map_t = jax.lax.optimization_barrier(jnp.swapaxes(head_map, -1, -2))
    out = _mix_heads(head_map, y, precision)
    d_out = jnp.einsum("btha,btad->bthd", d_map, y, precision=precision) + jnp.einsum(
        "btah,btad->bthd", head_map_t, dy, precision=precision
    )
    return out, d_out


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _mix_query(head_map: Array, y: Array, bias: Array, precision: Any) -> Array:
    """l(t) (y + b) per token for the query without its projection bias b
    (S, d): (B, T, S, S) x (B, T, S, d) -> (B, T, S, d), written as S
    multiply-adds (exact float arithmetic, as a HIGHEST product); its
    derivative is ``_mix_query_jvp``.

    XLA:CPU fuses this, the bias add included, into the attention's copy of
    q~ to its (B, H, N, d) layout, which reads each token's (S, d) block
    contiguously: one pass over q where the bias add, the map's product and
    the copy were three (measured at B=4, N=1024, E=512, H=8: 17 MiB against
    49 MiB, and a shorter time). The library dot cannot absorb the bias add
    (MHA's rides in that copy). The keys keep ``_mix_heads``: fused into
    k's (B, H, d, M) copy the same sum gathers S strided values per element
    (7x that copy's time).
    """
    yb = y + bias
    terms = [head_map[..., :, a, None] * yb[..., a, None, :] for a in range(head_map.shape[-1])]
    return functools.reduce(jnp.add, terms)


@_mix_query.defjvp
def _mix_query_jvp(
    precision: Any, primals: tuple[Array, Array, Array], tangents: tuple[Array, Array, Array]
) -> tuple[Array, Array]:
    """d(l (y + b)) = dl y + dl b + l (dy + db), products as in ``_mix_heads_jvp``.

    dl b is its own small product (not dl (y + b)): y + b written out for
    the product would be a residual of q's size under ``mapped_attention``'s
    checkpoint. b's cotangent is the sum over tokens of y's.
    """
    head_map, y, bias = primals
    d_map, dy, d_bias = tangents
    head_map_t = jax.lax.optimization_barrier(jnp.swapaxes(head_map, -1, -2))
    out = _mix_query(head_map, y, bias, precision)
    d_out = (
        jnp.einsum("btha,btad->bthd", d_map, y, precision=precision)
        + jnp.einsum("btha,ad->bthd", d_map, bias, precision=precision)
        + jnp.einsum("btah,btad->bthd", head_map_t, dy + d_bias, precision=precision)
    )
    return out, d_out


def cross_head_maps(
    params: Params,
    config: DamchaConfig,
    x: Array,
    c: Array | None,
    q: Array,
    k: Array,
    *,
    precision: Any = None,
    q_bias: Array | None = None,
    terms: bool = False,
) -> tuple[Array, Array]:
    """q~ = L_q(x) q (B, N, H, d) and k~ = L_k(c) k (B, M, G, d), in the dtypes of
    q and k; ``c=None`` means the keys come from ``x`` (self-attention).

    ``q_bias`` (H, d): q is given without its projection's bias and the
    spec's q is q + q_bias; the map takes the bias in its own pass
    (``_mix_query``) instead of a pass of its own over q.

    ``terms``: both maps as S multiply-adds (``_mix_terms``), for a decoding
    step under ``jit``: XLA fuses them, l's own elementwise steps included,
    into the cache update of k~ and the copy of q~, where the batched
    products were a library call each plus the bias adds and l before them
    (B=8, E=512, H=8: 24 fusions against MHA's 17, now 20). Eager, they
    would be ~2S dispatches each where the product is one."""
    sq, sk = side_of(config, "q"), side_of(config, "k")
    if not sq:
        q = q if q_bias is None else (q + q_bias).astype(q.dtype)
        q_bias = None
    if not sq and not sk:
        return q, k  # metric "none": no maps
    structure = _structure(config)
    if sq and sk and sq == sk and c is None:
        # Tied self-attention: one generator on the same tokens, so one l(t) maps q and k.
        leaves = _leaves(params, config, sq)
        coeff = _affine_coefficients(structure, x, leaves, precision)
        q_out, k_out = _apply_maps(config, leaves, coeff, [q, k], precision, [q_bias, None], terms)
        return q_out.astype(q.dtype), k_out.astype(k.dtype)
    # Two generators reading the same tokens (separate coupling, self-attention) share their RMS scale.
    shared = _rms_scale(x.astype(_acc(x.dtype))) if sq and sk and c is None else None
    q_out, k_out = q, k
    if sq:
        leaves = _leaves(params, config, sq)
        coeff_q = _affine_coefficients(structure, x, leaves, precision, shared)
        q_out = _apply_maps(config, leaves, coeff_q, [q], precision, [q_bias], terms)[0].astype(q.dtype)
    if sk:
        leaves = _leaves(params, config, sk)
        coeff_k = _affine_coefficients(structure, x if c is None else c, leaves, precision, shared)
        k_out = _apply_maps(config, leaves, coeff_k, [k], precision, None, terms)[0].astype(k.dtype)
    return q_out, k_out


# The names of q~ and k~ (the mapped heads) for jax.checkpoint policies.
MAPPED_NAMES = ("damcha_q_mapped", "damcha_k_mapped")
# dot_general's dimension numbers of the maps' per-token products ("btha,btad->bthd").
_MAP_DIMS = (((3,), (2,)), ((0, 1), (0, 1)))


def mapped_attention(
    params: Params,
    config: DamchaConfig,
    x: Array,
    c: Array | None,
    q: Array,
    k: Array,
    v: Array,
    *,
    precision: Any = None,
    q_bias: Array | None = None,
    **attend_kwargs: Any,
) -> tuple[Array, Array | None, Array | None]:
    """``cross_head_maps`` then ``attend`` (same arguments and result), with q~
    and k~ recomputed from q, k and the maps in the backward pass.

    The attention's backward needs q~ and k~, the maps' backward needs the
    unmapped q and k (for the maps' gradient): saving all four kept one
    (B, T, S, d) tensor per side more than MHA does (XLA's memory estimate
    of a 6-layer training step: 1.04x MHA's at N=1024). Under this
    checkpoint training keeps q and k and the small (S, S) maps, and the
    backward pass runs the two map products again (about 0.05% of a
    6-layer encoder's training FLOPs), not the projections. Without
    differentiation the checkpoint changes nothing in the compiled program.

    The policy saves everything except q~, k~ and the values that are only
    other names for them: ``save_anything_except_these_names`` alone still
    saved them, as the output of the maps' product (``checkpoint_name`` is an
    alias of it) and as ``jax.nn.dot_product_attention``'s grouped reshape of
    q~. ``tests/test_jax_compiled_cost.py`` holds the training step's temp
    bytes to MHA's and its FLOPs to MHA's plus the maps' (recompute included).

    The attention's softmax takes ``jax.nn.softmax``'s own derivative rule
    (``jax.softmax_custom_jvp``: dy = y (dx - sum(y dx)), the same math),
    not JAX's default autodiff of exp / sum, which saved the exp:
    ``jax.checkpoint`` puts a no-op ``reduce_precision`` on the producer of
    every saved value, which XLA:CPU keeps, and on the exp (a library
    fusion that cannot take it) that was a pass of its own over the
    (B, H, N, M) scores. Under the rule the backward recomputes y from the
    masked logits (custom_jvp outputs are not saved, see the policy).
    Measured (XLA cost analysis, one layer's value-and-grad, B=4, E=512,
    H=8, is_causal): bytes 1.056x MHA's -> 0.865x at N=1024.
    """
    if not (side_of(config, "q") or side_of(config, "k")) or q.dtype not in (jnp.float32, jnp.float64):
        # No maps (metric "none"), or 16-bit heads: under the checkpoint
        # XLA:CPU refused the attention's float16 product (its precision
        # F16_F16_F32), so they keep q~ and k~ as before.
        q, k = cross_head_maps(params, config, x, c, q, k, precision=precision, q_bias=q_bias)
        return attend(config, q, k, v, precision=precision, **attend_kwargs)

    def run(p: Params, x: Array, c: Array | None, q: Array, k: Array, v: Array, q_bias: Array | None) -> Any:
        q, k = cross_head_maps(p, config, x, c, q, k, precision=precision, q_bias=q_bias)
        q = checkpoint_name(q, MAPPED_NAMES[0])
        k = checkpoint_name(k, MAPPED_NAMES[1])
        with jax.softmax_custom_jvp(True):  # see above
            return attend(config, q, k, v, precision=precision, **attend_kwargs)

    B, N, H, d = q.shape
    grouped = (B, N, H // config.group_size, config.group_size, d)

    def policy(prim: Any, *avals: Any, **kw: Any) -> bool:
        """Save this primitive's output for the backward pass?"""
        if prim.name == "name":
            return kw.get("name") not in MAPPED_NAMES
        if prim.name == "custom_jvp_call":
            return False
        if prim.name == "dot_general":
            return kw.get("dimension_numbers") != _MAP_DIMS
        if prim.name == "reshape":
            return not (avals[0].shape == q.shape and tuple(kw.get("new_sizes", ())) == grouped)
        return True

    args = (params, x, c, q, k, v, q_bias)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
        # Concrete arrays: no transformation is running, so nothing differentiates this
        # call and the checkpoint has nothing to save; called eagerly, jax.checkpoint
        # traces its body again on every call (about 70% of an eager module call).
        return run(*args)
    return jax.checkpoint(run, policy=policy)(*args)


def _project(
    params: Params, config: DamchaConfig, name: str, tokens: Array, precision: Any, bias: bool = True
) -> Array:
    """tokens (B, T, E) -> heads (B, T, S, d), accumulated in at least float32;
    ``bias=False`` leaves the bias out (the caller adds it)."""
    y = jnp.einsum(
        "bte,ehd->bthd",
        tokens,
        params[f"{name}.kernel"],
        precision=precision,
        preferred_element_type=_acc(tokens.dtype),
    )
    if config.use_bias and bias:
        y = y + params[f"{name}.bias"]
    return y


def _qkv(
    params: Params,
    config: DamchaConfig,
    x: Array,
    c: Array | None,
    v_tokens: Array | None,
    precision: Any = None,
    *,
    bias_in_map: bool = False,
    terms: bool = False,
) -> tuple[Array, Array, Array]:
    """q~ (B, N, H, d), k~ (B, M, G, d), v (B, M, G, d_v) in x's dtype; c=None is self-attention.

    ``bias_in_map``: a mapped query's bias goes into its map (cross_head_maps'
    ``q_bias``), for q~ that the attention copies. ``terms``: cross_head_maps'.
    """
    ctx = x if c is None else c
    q_bias = params["query.bias"] if bias_in_map and config.use_bias and side_of(config, "q") else None
    q = _project(params, config, "query", x, precision, bias=q_bias is None)
    k = _project(params, config, "key", ctx, precision)
    v = _project(params, config, "value", ctx if v_tokens is None else v_tokens, precision)
    q, k = cross_head_maps(params, config, x, c, q, k, precision=precision, q_bias=q_bias, terms=terms)
    dt = x.dtype
    return q.astype(dt), k.astype(dt), v.astype(dt)


def visibility(mask: Array | None, n: int, m: int, *, is_causal: bool = False, query_offset: Any = 0) -> Array | None:
    """The boolean may-attend mask, broadcastable to (B, H, N, M): the user's
    mask and, with ``is_causal``, query i (at position offset + i) sees keys
    j <= offset + i. ``None`` means every key is visible."""
    if not is_causal:
        return mask
    rows = jnp.arange(n)[:, None] + query_offset
    causal = (jnp.arange(m)[None, :] <= rows)[None, None]
    return causal if mask is None else mask & causal


def plan_mask(
    mask: MaskArg | None,
    n: int,
    m: int,
    *,
    is_causal: bool,
    query_offset: Any = 0,
    mask_hint: str | None = None,
    name: str = "mask",
) -> MaskPlan:
    """What the attention kernel gets for this mask, causal rule and hint.

    A mask that is the causal rule and padding only (``combine_masks`` of
    ``make_causal_mask`` and ``make_attention_mask``), or padding only, is
    given to the kernel as ``is_causal`` and a key mask (b, h, 1, M), and
    the query rows it hides are zeroed: no (N, M) operand. That needs to
    know what the mask is:

    * its values, where DAMCHA holds them anyway (NumPy masks, concrete
      numeric masks read for the 0/1 rule): found exactly on the host;
    * under ``jit``, ``mask_hint`` ("causal" or "padding"), checked on the
      device by counting (two reductions over the mask); a mask that is not
      what the hint says makes the output NaN, never a wrong number (a
      concrete one was refused at the boundary: ``check_hinted``).

    Any other mask goes to the kernel as it is (as Flax's MHA does). The
    mask's structure is read by ``_masks.host_plan``/``traced_split``; this
    function stays here, beside ``visibility`` which it composes, so that
    ``_masks`` imports nothing from this module.
    """
    arr = None if mask is None else mask4(mask.array)
    flag = None if mask is None else mask.flag
    static0 = isinstance(query_offset, int) and query_offset == 0
    if arr is None:
        visible = visibility(None, n, m, is_causal=is_causal, query_offset=query_offset)
        if is_causal and not static0:
            # jax.nn.dot_product_attention's causal rule is top-left (offset 0): give it the offset one.
            return MaskPlan(visible, False, None, visible, flag)
        return MaskPlan(None, is_causal, None, visible, flag)
    assert mask is not None  # arr is its array
    keys: Array | None
    found: tuple[np.ndarray, np.ndarray, bool] | bool | None = None
    concrete_offset = not isinstance(query_offset, jax.core.Tracer)
    if mask.host is not None and concrete_offset:
        # Messages give the shape as passed, not the (b, h, N, M) view.
        shape = mask.shape if mask.shape is not None else tuple(np.shape(mask.host))
        host = np.asarray(mask.host).reshape(arr.shape)
        found = host_plan(
            host, n, m, is_causal=is_causal, offset=int(query_offset), hint=mask_hint, name=name, shape=shape
        )
        if found is not None:
            keys, rows, causal = (jnp.asarray(found[0]), None if found[1].all() else jnp.asarray(found[1]), found[2])
            if found[0].all():
                keys = None
    if found is None and mask_hint is not None:
        raw = mask4(mask.raw)
        keys, rows, ok = traced_split(arr, n, m, hint=mask_hint, offset=query_offset, raw=raw)
        causal = is_causal or mask_hint == "causal"
        if causal and mask_hint == "padding":
            first = jnp.argmax(keys, axis=-1)[..., None]  # rows already require some key
            rows = rows & (first <= jnp.arange(n) + query_offset)
        # With the raw values ok holds the 0/1 rule too: the flag's own pass over the mask is dropped.
        flag = ~ok if raw is not None else or_masks(flag, ~ok)
        found = True
    if found is None:
        # Any other mask: to the kernel as it is; a row sees a key iff the mask shows it one.
        visible = visibility(arr, n, m, is_causal=is_causal, query_offset=query_offset)
        if arr.shape[-2] == 1 and is_causal:
            first = jnp.argmax(arr, axis=-1)  # a key mask: O(M), row i sees the first key iff it is <= i
            rows = jnp.any(arr, axis=-1) & (first <= jnp.arange(n) + query_offset)
        elif mask.rows is not None and not is_causal:
            rows = mask.rows.reshape(arr.shape[:-1])  # found while reading the mask (one pass over it)
        else:
            assert visible is not None  # visibility() of a mask is an array
            rows = jnp.any(visible, axis=-1)
        if is_causal and static0:
            return MaskPlan(arr, True, rows, visible, flag)
        return MaskPlan(visible, False, rows, visible, flag)
    key_mask = None if keys is None else keys[..., None, :]
    # The einsum path (weights, dropout, float64) builds the logits anyway: it takes the mask as given.
    visible = visibility(arr, n, m, is_causal=causal, query_offset=query_offset)
    if causal and not static0:
        return MaskPlan(
            visibility(key_mask, n, m, is_causal=True, query_offset=query_offset), False, rows, visible, flag
        )
    return MaskPlan(key_mask, causal, rows, visible, flag)


def softmax_attend(logits: Array, visible: Array) -> Array:
    """Masked softmax in float32 where rows with no visible key get probabilities 0."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    # A finite fill (not -inf) keeps every gradient finite in hidden rows;
    # NaN logits at visible keys stay NaN.
    filled = jnp.where(visible, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(filled, axis=-1)
    return jnp.where(jnp.any(visible, axis=-1, keepdims=True), probs, 0.0)


def attend(
    config: DamchaConfig,
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | MaskArg | None,
    is_causal: bool,
    query_offset: Any = 0,
    return_weights: bool = False,
    dropout_rng: Array | None = None,
    broadcast_dropout: bool = False,
    precision: Any = None,
    mask_hint: str | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """Scaled dot-product attention on transformed heads: o (B, N, H, d_v) in
    q's dtype, the probabilities (B, H, N, M) (before dropout) when asked, and
    the NaN flag of the mask (``plan_mask``; None when there is none).

    Without weights or dropout this is ``jax.nn.dot_product_attention`` (no
    N x M tensor is built here; XLA's kernel builds what it needs), given the
    causal rule and a key mask instead of the mask where ``plan_mask`` can.
    float64 uses the equivalent einsum path, see below. ``broadcast_dropout``
    drops the same (N, M) entries in every batch row and head, as Flax does.
    """
    N, d = q.shape[1], q.shape[-1]
    M, d_v = k.shape[1], v.shape[-1]
    if mask is not None and not isinstance(mask, MaskArg):
        mask = MaskArg(mask, None, None)
    plan = plan_mask(mask, N, M, is_causal=is_causal, query_offset=query_offset, mask_hint=mask_hint)
    # jax.nn.dot_product_attention always takes its softmax in float32
    # (its XLA path builds the logits too), so float64 gets the einsum path.
    explicit = return_weights or dropout_rng is not None or (q.dtype == jnp.float64 and EINSUM_FOR_FLOAT64)

    if explicit:
        k_h = jnp.repeat(k, config.group_size, axis=2)  # head h reads kv head h // (H/G)
        v_h = jnp.repeat(v, config.group_size, axis=2)
        logits = config.softmax_scale * jnp.einsum(
            "bnhd,bmhd->bhnm", q, k_h, precision=precision, preferred_element_type=_acc(q.dtype)
        )
        full = jnp.ones((1, 1, 1, 1), bool) if plan.visible is None else plan.visible
        probs = softmax_attend(logits, jnp.broadcast_to(full, logits.shape))
        weights = probs
        if dropout_rng is not None:
            keep_prob = 1.0 - config.dropout
            shape = (1, 1) + probs.shape[2:] if broadcast_dropout else probs.shape
            keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
            # A product, not a select: a NaN probability stays NaN where it is dropped.
            probs = probs * (keep.astype(probs.dtype) / keep_prob)
        o = jnp.einsum("bhnm,bmhd->bnhd", probs.astype(v.dtype), v_h, precision=precision)
        return _zero_empty_rows(o, plan.rows).astype(q.dtype), (weights if return_weights else None), plan.flag

    # jax.nn.dot_product_attention needs d == d_v; zero-padding the narrower
    # side changes neither the logits (explicit scale) nor the kept channels.
    width = max(d, d_v)
    if d < width:
        pad = ((0, 0), (0, 0), (0, 0), (0, width - d))
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    if d_v < width:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, width - d_v)))
    o = jax.nn.dot_product_attention(
        q, k, v, mask=plan.kernel_mask, scale=config.softmax_scale, is_causal=plan.kernel_causal
    )[..., :d_v]
    return _zero_empty_rows(o, plan.rows), None, plan.flag


def _zero_empty_rows(o: Array, rows: Array | None) -> Array:
    """Attention output 0 for the query rows that see no key (v1's rule).

    The fused kernel would give such a row the mean of the values, the einsum
    path 0 x v, which is NaN when a hidden value is NaN: a select makes it 0
    on both paths (and zeroes its gradients), as the row reads no value.
    """
    if rows is None:
        return o
    keep = jnp.moveaxis(rows, 1, 2)[..., None]  # (b, N, h, 1)
    return jnp.where(keep, o, jnp.zeros((), o.dtype))


def _output(params: Params, config: DamchaConfig, o: Array, precision: Any = None) -> Array:
    """o (B, N, H, d_v) -> y (B, N, E_o) in o's dtype.

    One dot_general contracting (h, d) in the kernel's own axis order, as
    Flax's LinearGeneral does: ``jnp.einsum("bnhd,hde->bne")`` contracts its
    sorted names (d, h), for which XLA:CPU copied the whole (H, d_v, E_o)
    kernel (and o) to a (d_v, H) layout on every call, 1 MiB per decode
    step at E=512, 10% of a B=1 step's bytes.
    """
    kernel = params["output.kernel"]
    dt = jnp.result_type(o.dtype, kernel.dtype)
    y = jax.lax.dot_general(
        o.astype(dt),
        kernel.astype(dt),
        (((o.ndim - 2, o.ndim - 1), (0, 1)), ((), ())),
        precision=precision,
        preferred_element_type=_acc(dt),
    )
    if config.use_bias:
        y = y + params["output.bias"]
    return y.astype(o.dtype)


def _head_map(params: Params, config: DamchaConfig, side: str, tokens: Array) -> Array:
    """The per-token factor the reference's ``return_metric`` gives: l(t) (B, T, S, S)
    for a compact structure ("heads"), the dense L(t) (B, T, S, d, S, d) otherwise."""
    structure = _structure(config)
    coeff = generator(params, config, side, tokens)
    leaves = _leaves(params, config, side)
    if structure.compact_head_map:
        return structure.head_map(jnp, coeff, leaves).astype(tokens.dtype)
    S, d = config.side_heads(side), config.key_dim
    delta = structure.dense_delta(jnp, coeff, leaves, d)
    identity = jnp.eye(S * d, dtype=coeff.dtype).reshape(S, d, S, d)
    return (identity + leaves["gate"][:, None, None, None] * delta).astype(tokens.dtype)


def _prepare(params, config, query, context, value, mask, dtype, *, mask_hint=None, query_offset=0):
    """Validate everything once and cast to the computation dtype (a concrete
    mask against its ``mask_hint`` too: ``check_hinted``)."""
    config = _check_config(config)
    # Values may be tracers: names, shapes and dtypes only, no finiteness check.
    check_params(params, config)
    x = check_float("query", query)
    c = None if context is None else check_float("context", context)
    v_tokens = None if value is None else check_float("value", value)
    mask = read_mask(mask)
    check_shapes(
        config,
        x.shape,
        None if c is None else c.shape,
        None if mask.array is None else mask.array.shape,
        value_shape=None if v_tokens is None else v_tokens.shape,
    )
    mask = check_hinted(mask, x.shape[1], (x if c is None else c).shape[1], hint=mask_hint, offset=query_offset)
    # Arrays pass as they are (no per-call conversion of every parameter when eager).
    as_arrays = {n: p if isinstance(p, jax.Array) else jnp.asarray(p) for n, p in params.items()}
    arrays = [x] + [t for t in (c, v_tokens) if t is not None] + list(as_arrays.values())
    dt = _compute_dtype(dtype, *arrays)
    cast = {n: p if p.dtype == dt else p.astype(dt) for n, p in as_arrays.items()}
    x = x.astype(dt)
    c = None if c is None else c.astype(dt)
    v_tokens = None if v_tokens is None else v_tokens.astype(dt)
    return cast, config, x, c, v_tokens, mask


# ------------------------------------------------------------------ public API


def damcha_attention(
    params: Params,
    config: DamchaConfig,
    query: Array,
    context: Array | None = None,
    *,
    value: Array | None = None,
    mask: Array | None = None,
    is_causal: bool = False,
    query_offset: int | Array = 0,
    return_weights: bool = False,
    return_metric: bool = False,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    broadcast_dropout: bool = False,
    precision: Any = None,
    dtype: Any = None,
    mask_hint: str | None = None,
) -> Any:  # y, or a tuple with the weights and/or maps (see Returns), as the reference's
    """DAMCHA forward pass: cross-head maps, then ``jax.nn.dot_product_attention``.

    Args:
        params: canonical parameters, name -> array (see ``config.param_shapes()``).
        config: the layer's ``damcha_core.DamchaConfig``; pass it as a static
            argument under ``jax.jit``.
        query: x (B, N, E_q).
        context: c (B, M, E_kv); ``None`` for self-attention (c = x).
        value: value tokens (B, M, E_v) when they are not the context
            (``config.value_input_dim``), as ``nnx.MultiHeadAttention``'s
            ``inputs_v``; default the context.
        mask: True = may attend, shape (N, M) or (B, H, N, M) with size-1
            dims allowed; bool, or integer/floating with only 0 and 1
            (non-zero = attend, as Flax and Keras read them). Any other value
            (an additive 0/-inf mask) raises when concrete and makes the
            output NaN under ``jit``. 3-D masks are rejected (use ``mask[:, None]``).
        is_causal: hide key j from query i when j > i + query_offset
            (top-left aligned when query_offset = 0).
        query_offset: position of query 0, the number of cached keys before
            these queries; an int or an integer scalar array (a cache index).
        return_weights: also return the probabilities (B, H, N, M); this
            builds the N x M tensor, so use it for inspection only.
        return_metric: also return the per-token map factors
            ``{"q": ..., "k": ...}`` like the reference (l(t) (B, T, S, S) for
            "heads", dense L(t) (B, T, S, d, S, d) for "lowrank").
        dropout_rng: PRNG key for attention-probability dropout with rate
            ``config.dropout``; used only when ``deterministic`` is False.
        deterministic: no dropout when True (inference).
        broadcast_dropout: drop the same (N, M) entries in every batch row
            and head (Flax's default in its MHA); default elementwise.
        precision: ``jax.lax.Precision`` of the einsums (projections, maps,
            the einsum attention path).
        dtype: computation dtype; default promotes inputs and params.
        mask_hint: what ``mask`` is, so that under ``jit`` the fused kernel
            can take the causal rule and a key mask instead of the (N, M)
            mask: ``"causal"`` (the causal rule and padding only, e.g.
            ``nnx.combine_masks(nnx.make_causal_mask(t), padding)``; implies
            ``is_causal``) or ``"padding"`` (query and key padding only, e.g.
            ``nnx.make_attention_mask(valid_q, valid_k)``). Checked on the
            device by counting (two reductions over the mask): a mask that is
            not what the hint says makes the output NaN under ``jit``, never
            a wrong number; a concrete one (any kind, a JAX bool array
            included, read back for this) raises a DamchaValueError before
            any computation. Concrete numeric and NumPy masks need no hint
            (their values are read anyway).

    Returns:
        y (B, N, E_o), or ``(y, weights?, metric?)`` with the asked-for extras
        in that order. A query with no visible key gets attention output 0, so
        y = output.bias there, with finite gradients.
    """
    is_causal = check_bool("is_causal", is_causal)
    return_weights = check_bool("return_weights", return_weights)
    return_metric = check_bool("return_metric", return_metric)
    deterministic = check_bool("deterministic", deterministic)
    broadcast_dropout = check_bool("broadcast_dropout", broadcast_dropout)
    query_offset = _check_offset(query_offset)
    precision = check_precision("precision", precision)
    mask_hint = check_hint(mask_hint, mask)
    p, config, x, c, v_tokens, mask = _prepare(
        params, config, query, context, value, mask, dtype, mask_hint=mask_hint, query_offset=query_offset
    )
    use_dropout = not deterministic and config.dropout > 0.0
    if use_dropout and dropout_rng is None:
        raise DamchaValueError(
            invalid_argument(
                "dropout_rng",
                f"a JAX PRNG key when deterministic=False and config.dropout={config.dropout} > 0",
                "dropout_rng=None",
            )
        )
    if use_dropout:
        _check_key("dropout_rng", dropout_rng)
    q, k, v = _qkv(p, config, x, c, v_tokens, precision, bias_in_map=True)
    o, weights, bad = attend(
        config,
        q,
        k,
        v,
        mask=mask,
        is_causal=is_causal,
        query_offset=query_offset,
        return_weights=return_weights,
        dropout_rng=dropout_rng if use_dropout else None,
        broadcast_dropout=broadcast_dropout,
        precision=precision,
        mask_hint=mask_hint,
    )
    y = _poison(_output(p, config, o, precision), bad)
    extras: list[Any] = []
    if return_weights:
        assert weights is not None  # attend returns them when asked
        extras.append(_poison(weights, bad))
    if return_metric:
        metric = {}
        for role, tokens in (("q", x), ("k", x if c is None else c)):
            side = side_of(config, role)
            if side:
                metric[role] = _head_map(p, config, side, tokens)
        extras.append(metric)
    return (y, *extras) if extras else y


def transformed_qkv(
    params: Params,
    config: DamchaConfig,
    query: Array,
    context: Array | None = None,
    *,
    value: Array | None = None,
    precision: Any = None,
    dtype: Any = None,
) -> tuple[Array, Array, Array]:
    """q~ (B, N, H, d), k~ (B, M, G, d) and v (B, M, G, d_v) after the cross-head maps.

    Plain scaled dot-product attention on these (scale
    ``config.softmax_scale``, kv head h // (H/G) for query head h) followed by
    the output projection is DAMCHA: feed them to any fused kernel, or cache
    k~ and v for decoding.
    """
    precision = check_precision("precision", precision)
    p, config, x, c, v_tokens, _ = _prepare(params, config, query, context, value, None, dtype)
    return _qkv(p, config, x, c, v_tokens, precision)


def metric_penalty(
    params: Params, config: DamchaConfig, query: Array, context: Array | None = None, *, value: Array | None = None
) -> Array:
    """Mean over adapted roles of mean_t ||L(t) - I||_F^2 / (S*d), as the reference.

    A scalar array (0 for metric "none"), differentiable, for the training
    loss; ``value`` is checked as in ``damcha_attention`` but never mapped.
    """
    p, config, x, c, _, _ = _prepare(params, config, query, context, value, None, None)
    c = x if c is None else c
    per_role = []
    for role, tokens in (("q", x), ("k", c)):
        side = side_of(config, role)
        if side is not None:
            per_role.append(role_penalty(jnp, p, config, side, generator(p, config, side, tokens)))
    return jnp.mean(jnp.stack(per_role)) if per_role else jnp.zeros((), x.dtype)
