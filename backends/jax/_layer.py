"""``DamchaAttention``, the Flax NNX layer: a drop-in for ``nnx.MultiHeadAttention``.

The four projections are Flax's own ``LinearGeneral`` submodules (so
``dtype``, ``param_dtype``, ``precision``, the promote and dot-general hooks
and the sharding arguments act exactly as in ``nnx.MultiHeadAttention``); the
DAMCHA steps (generator, maps, masked attention) are ``_functional``'s.
Canonical I/O lives in ``_canonical``, the decoding cache in ``_cache``,
reading and folding the masks in ``_masks``, conversion from Flax's MHA in
``_convert``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, overload

import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as _flax_dtypes

import jax
import jax.numpy as jnp
from damcha_core import (
    DamchaConfig,
    DamchaTypeError,
    DamchaValueError,
    check_bool,
    check_int,
    check_keys,
    check_shapes,
    config_sizes,
    describe,
    invalid_argument,
    make_config,
    role_penalty,
    side_of,
)

from . import _functional as F
from ._cache import DecodeCache
from ._canonical import CanonicalIO
from ._convert import from_mha
from ._generator import CrossHeadMap, MetricGenerator, make_metric_generators, resolve_metric_generators
from ._masks import check_hint, check_hinted, fold_mask, read_mask, reshape_mask

Array = jax.Array
Initializer = Callable[..., Array]

# LinearGeneral initialises its kernel flattened to (fan_in, fan_out), so plain
# Glorot uniform gives damcha_core.init_params' fans: (E, S*d) and (H*d_v, E_o).
_glorot = nnx.initializers.glorot_uniform()
_zeros = nnx.initializers.zeros_init()
_EMPTY: Mapping[str, Any] = MappingProxyType({})

# DamchaConfig's fields under nnx.MultiHeadAttention's argument names (messages name these).
CONFIG_NAMES = {
    "query_dim": "in_features",
    "context_dim": "in_kv_features",
    "value_input_dim": "in_v_features",
    "output_dim": "out_features",
    "dropout": "dropout_rate",
}
# The reference's call arguments under the names of nnx.MultiHeadAttention.__call__.
CALL_NAMES = {
    "query": "inputs_q",
    "context": "inputs_k",
    "value": "inputs_v",
    "mask": "mask",
    "query_dim": "in_features",
    "context_dim": "in_kv_features",
    "value_input_dim": "in_v_features",
}


def attention_config(
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    in_v_features: int | None = None,
    key_dim: int | None = None,
    value_dim: int | None = None,
    metric: str = "heads",
    metric_rank: int | None = None,
    coupling: str | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    use_bias: bool = True,
) -> DamchaConfig:
    """The ``DamchaConfig`` of ``DamchaAttention`` built with these arguments
    (nnx.MultiHeadAttention naming); errors name these arguments."""
    if key_dim is None:
        H = check_int("num_heads", num_heads)
        E_q = check_int("in_features", in_features)
        qkv = E_q if qkv_features is None else check_int("qkv_features", qkv_features)
        if qkv % H:
            raise DamchaValueError(
                invalid_argument(
                    "qkv_features",
                    "a multiple of `num_heads` (d = qkv_features / num_heads)",
                    f"qkv_features={qkv}, num_heads={H}",
                )
            )
        key_dim = qkv // H
    elif qkv_features is not None:
        H = check_int("num_heads", num_heads)
        if check_int("qkv_features", qkv_features) != check_int("key_dim", key_dim) * H:
            raise DamchaValueError(
                invalid_argument(
                    "qkv_features",
                    "num_heads * key_dim when both are given (give one of qkv_features and key_dim)",
                    f"qkv_features={qkv_features}, key_dim={key_dim}, num_heads={num_heads}",
                )
            )
    return make_config(
        names=CONFIG_NAMES,
        query_dim=in_features,
        num_heads=num_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        num_kv_heads=num_kv_heads,
        context_dim=in_kv_features,
        value_input_dim=in_v_features,
        output_dim=out_features,
        use_bias=use_bias,
        metric=metric,
        metric_rank=metric_rank,
        coupling=coupling,
        scale=scale,
        dropout=dropout_rate,
    )


def _is_default_attention(fn: Any) -> bool:
    return fn is None or fn is nnx.dot_product_attention


def _project_unbiased(linear: nnx.LinearGeneral, inputs: Array, out_sharding: Any) -> tuple[Array, Array | None]:
    """``linear(inputs)`` as its product without the bias, and the bias, each
    as ``linear`` computes them (its promote_dtype, dot_general hooks,
    precision and sharding), for a LinearGeneral over the last axis.

    The query's map takes the bias in its own pass (``_functional.cross_head_maps``'
    ``q_bias``): added here it would cost a pass over q of its own, which
    XLA:CPU's library dot does not absorb (in MHA it rides in the
    attention's copy of q, which DAMCHA's map now sits before).
    """
    kernel = linear.kernel[...]
    bias = None if linear.bias is None else linear.bias[...]
    inputs, kernel, bias = linear.promote_dtype((inputs, kernel, bias), dtype=linear.dtype)
    if linear.dot_general_cls is not None:
        dot_general = linear.dot_general_cls()
    elif linear.dot_general is not None:
        dot_general = linear.dot_general
    else:
        dot_general = jax.lax.dot_general
    kwargs: dict[str, Any] = {"out_sharding": out_sharding}
    if linear.preferred_element_type is not None:
        kwargs["preferred_element_type"] = linear.preferred_element_type
    dims = (((inputs.ndim - 1,), (0,)), ((), ()))
    return dot_general(inputs, kernel, dims, precision=linear.precision, **kwargs), bias


def _mask_view(mask_shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The shape a mask is read as, for inputs whose full mask rank is
    ``rank`` (len(batch axes) + 3): size-1 axes that change nothing are
    dropped, so that the masks Flax broadcasts without ambiguity work. Extra
    leading size-1 axes go (a (1, 1, N, M) mask of unbatched inputs); a mask
    with fewer axes whose axes before the last two are all 1 is read as
    (N|1, M) (then no alignment of the axes can change its meaning). Any
    other shape is returned as it is and checked as given (a (B, N, M)
    mask stays refused: Flax would read its B as the heads). A scalar is
    read as (1, 1)."""
    n = len(mask_shape)
    if n == 0:
        return (1, 1)  # a scalar: every key or none, as Flax broadcasts it
    if n > rank and all(s == 1 for s in mask_shape[: n - rank]):
        return mask_shape[n - rank :]
    if 2 < n < rank and all(s == 1 for s in mask_shape[:-2]):
        return mask_shape[-2:]
    return mask_shape


def check_token_shape(
    name: str, shape: tuple[int, ...], features: int | None = None, features_arg: str = "in_features"
) -> None:
    """The rules on a token array's shape [batch..., length, features], named
    as the caller names the argument (the attention's ``inputs_q``/``inputs_k``/
    ``inputs_v``, the blocks' ``x``): rank >= 2, then, when ``features`` is
    given, that feature size (the constructor argument ``features_arg``). Batch
    and length axes may be 0, as in Flax's MHA (the empty output); keys without
    queries are ``check_keys``'s rule. One rule for all, so their refusals
    cannot drift apart."""
    received = f"{name}.shape={tuple(shape)}"
    if len(shape) < 2:
        raise DamchaValueError(invalid_argument(name, "shape [batch..., length, features] (rank >= 2)", received))
    if features is None:
        return
    if shape[-1] != features:
        raise DamchaValueError(invalid_argument(name, f"{features} features ({features_arg})", received))


def _check_inputs(
    config: DamchaConfig, x: Array, k: Array | None, v: Array | None, mask: Array | None, *, keys: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Flax's ``[batch..., length, features]`` shapes, checked as the user passed
    them; returns the batch axes and the shape the mask is read as
    (``_mask_view``). ``keys`` is the cache length when decoding (the mask
    then spans the cache)."""
    names = {"inputs_q": x, "inputs_k": k, "inputs_v": v}
    for name, t in names.items():
        if t is not None:
            check_token_shape(name, t.shape)
    lead = tuple(x.shape[:-2])
    for name in ("inputs_k", "inputs_v"):
        t = names[name]
        if t is not None and tuple(t.shape[:-2]) != lead:
            raise DamchaValueError(
                invalid_argument(
                    name,
                    f"the batch axes of `inputs_q`, {lead}",
                    f"inputs_q.shape={tuple(x.shape)}, {name}.shape={tuple(t.shape)}",
                )
            )
    if k is not None:
        # Here, on the shape as passed (check_shapes below may see it folded to (B, M, E)).
        check_keys("inputs_k", k.shape, x.shape[-2], k.shape[-2])
    mask_shape = None if mask is None else tuple(mask.shape)
    view = None if mask_shape is None else _mask_view(mask_shape, len(lead) + 3)
    if len(lead) == 1 and keys is None and view == mask_shape:
        # (B, N, E) with a mask read as given: the shared rules and messages, with Flax's names.
        check_shapes(
            config,
            x.shape,
            None if k is None else k.shape,
            mask_shape,
            value_shape=None if v is None else v.shape,
            names=CALL_NAMES,
        )
        return lead, view
    # Other batch axes, or a mask read without some size-1 axes: the same rules on the shapes as given.
    for name, t, features, arg in (
        ("inputs_q", x, config.query_dim, "in_features"),
        ("inputs_k", k, config.context_dim, "in_kv_features"),
        ("inputs_v", v, config.value_input_dim, "in_v_features"),
    ):
        if t is not None:
            check_token_shape(name, t.shape, features, arg)
    B = math.prod(lead)  # not int(): a symbolic batch size (jax.export) stays symbolic
    N = x.shape[-2]
    M = keys if keys is not None else (x if k is None else k).shape[-2]
    folded = lambda t: None if t is None else (B, *t.shape[-2:])  # noqa: E731
    check_shapes(config, (B, *x.shape[-2:]), folded(k), None, value_shape=folded(v), names=CALL_NAMES)
    if mask_shape is not None and view is not None:
        target = (*lead, config.num_heads, N, M)
        if len(view) == 2 or len(view) == len(target):
            if any(s not in (1, t) for s, t in zip(view[::-1], target[::-1])):
                raise DamchaValueError(
                    invalid_argument(
                        "mask",
                        f"a shape broadcastable to [batch..., H, N, M] = {target} (each dim equal or 1)",
                        f"mask.shape={mask_shape}",
                    )
                )
        else:
            raise DamchaValueError(
                invalid_argument(
                    "mask",
                    f"shape (N, M) or [batch..., H, N, M] = {target} with size-1 dims allowed (fewer "
                    "axes only when those before (N, M) are all 1)",
                    f"mask.shape={mask_shape}",
                )
            )
    return lead, view


@overload
def _fold(t: Array, lead: tuple[int, ...], keep: int) -> Array: ...


@overload
def _fold(t: None, lead: tuple[int, ...], keep: int) -> None: ...


def _fold(t: Array | None, lead: tuple[int, ...], keep: int) -> Array | None:
    """[batch..., *rest] -> (B, *rest) with ``keep`` trailing axes kept."""
    if t is None:
        return None
    B = math.prod(lead)  # not int(): a symbolic batch size (jax.export) stays symbolic
    return jnp.reshape(t, (B, *t.shape[t.ndim - keep :]))


class DamchaAttention(CanonicalIO, DecodeCache, nnx.Module):
    """Data-Adaptive Mahalanobis Cross-Head Attention, a drop-in for
    ``nnx.MultiHeadAttention``.

    ``nnx.MultiHeadAttention``'s constructor and call signatures (its
    arguments, defaults and submodules ``query``/``key``/``value``/``out``,
    ``LinearGeneral`` with kernels (E, S, d) and (H, d_v, E_o)), plus the
    DAMCHA options. With gates at 0 (the initial state) it computes exactly
    MHA; ``metric="none"`` is MHA.

    Args:
        num_heads: H.
        in_features: E_q, feature size of ``inputs_q``.
        qkv_features: H * d; default ``in_features``. Give this or ``key_dim``.
        out_features: E_o; default ``in_features``.
        num_kv_heads: G (GQA/MQA); default ``num_heads``.
        in_kv_features: E_kv, feature size of ``inputs_k``; default ``in_features``.
        dtype, param_dtype, broadcast_dropout, dropout_rate, deterministic,
            precision, kernel_init, out_kernel_init, bias_init, out_bias_init,
            use_bias, decode, normalize_qk, qkv_promote_dtype,
            out_promote_dtype, ln_promote_dtype, qkv_dot_general,
            out_dot_general, qkv_dot_general_cls, out_dot_general_cls, rngs,
            keep_rngs and the ``*_metadata`` arguments: as
            ``nnx.MultiHeadAttention`` (``kernel_init`` defaults to Glorot
            uniform, ``damcha_core.init_params``' distribution).
            ``normalize_qk`` applies the LayerNorms to the projected q and k,
            before the cross-head maps.
        attention_fn: ``None`` (default) is DAMCHA's own attention (a query
            that sees no key gets output 0); ``nnx.dot_product_attention``
            means the same. Any other function is called as Flax calls it,
            ``attention_fn(q~, k~, v, mask=..., dropout_rng=..., dropout_rate=...,
            broadcast_dropout=..., deterministic=..., dtype=..., precision=...,
            module=..., is_causal=...)``, with q~ and k~ the heads *after* the
            cross-head maps ([batch..., N, H, d], [batch..., M, G, d]), so any
            kernel computes DAMCHA. It must scale the logits by 1/sqrt(d); a
            ``scale`` other than that is applied to q~ beforehand.
        in_v_features: E_v, feature size of ``inputs_v`` when it differs from
            ``in_kv_features`` (its default).
        key_dim: d, per-head query/key size (overrides ``qkv_features``).
        value_dim: d_v; default ``key_dim``.
        metric, metric_rank, coupling, scale: as ``damcha_core.DamchaConfig``
            (defaults: "heads", None, automatic coupling: "tied" when
            num_kv_heads == num_heads and in_kv_features == in_features, else
            "separate"; 1/sqrt(d)).
        metric_generator: a ``MetricGenerator``, or a dict side -> generator,
            to share the generator with other layers; default fresh ones.
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
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: Any = None,
        kernel_init: Initializer = _glorot,
        out_kernel_init: Initializer | None = None,
        bias_init: Initializer = _zeros,
        out_bias_init: Initializer | None = None,
        use_bias: bool = True,
        attention_fn: Callable[..., Array] | None = None,
        decode: bool | None = None,
        normalize_qk: bool = False,
        qkv_promote_dtype: Any = _flax_dtypes.promote_dtype,
        out_promote_dtype: Any = _flax_dtypes.promote_dtype,
        ln_promote_dtype: Any = _flax_dtypes.promote_dtype,
        qkv_dot_general: Any = None,
        out_dot_general: Any = None,
        qkv_dot_general_cls: Any = None,
        out_dot_general_cls: Any = None,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
        kernel_metadata: Mapping[str, Any] = _EMPTY,
        out_kernel_metadata: Mapping[str, Any] = _EMPTY,
        bias_metadata: Mapping[str, Any] = _EMPTY,
        out_bias_metadata: Mapping[str, Any] = _EMPTY,
        query_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
        key_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
        in_v_features: int | None = None,
        key_dim: int | None = None,
        value_dim: int | None = None,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str | None = None,
        scale: float | None = None,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
    ) -> None:
        self.config = attention_config(
            num_heads,
            in_features,
            qkv_features,
            out_features,
            num_kv_heads,
            in_kv_features,
            in_v_features=in_v_features,
            key_dim=key_dim,
            value_dim=value_dim,
            metric=metric,
            metric_rank=metric_rank,
            coupling=coupling,
            scale=scale,
            dropout_rate=dropout_rate,
            use_bias=use_bias,
        )
        cfg = self.config
        if not isinstance(rngs, nnx.Rngs):
            raise DamchaTypeError(invalid_argument("rngs", "an nnx.Rngs", f"rngs={describe(rngs)}"))
        for name, value in (
            ("broadcast_dropout", broadcast_dropout),
            ("normalize_qk", normalize_qk),
            ("keep_rngs", keep_rngs),
        ):
            check_bool(name, value)
        for name, option in (("deterministic", deterministic), ("decode", decode)):
            if option is not None:
                check_bool(name, option)
        for name, value, optional in (("dtype", dtype, True), ("param_dtype", param_dtype, False)):
            if value is None and optional:
                continue
            if not F.is_real_floating_dtype(value):
                # Complex ones too: the maps and the softmax are defined on real numbers,
                # and the canonical parameters (to_canonical, save) are real.
                raise DamchaTypeError(
                    invalid_argument(
                        name,
                        "a real floating dtype (float16, bfloat16, float32, float64)"
                        + (" or None" if optional else ""),
                        f"{name}={describe(value)}",
                    )
                )
        for name, init, optional in (
            ("kernel_init", kernel_init, False),
            ("bias_init", bias_init, False),
            ("out_kernel_init", out_kernel_init, True),
            ("out_bias_init", out_bias_init, True),
        ):
            if not callable(init) and not (optional and init is None):
                raise DamchaTypeError(
                    invalid_argument(
                        name,
                        "an initializer (a callable)" + (" or None" if optional else ""),
                        f"{name}={describe(init)}",
                    )
                )
        F.check_precision("precision", precision)
        if attention_fn is not None and not callable(attention_fn):
            raise DamchaTypeError(
                invalid_argument("attention_fn", "a callable or None", f"attention_fn={describe(attention_fn)}")
            )
        # Checked before any allocation.
        given = resolve_metric_generators(
            metric_generator, cfg, names=CONFIG_NAMES, coupling_was_auto=coupling in (None, "auto")
        )
        H, d = cfg.num_heads, cfg.key_dim
        E_kv, E_v, E_o, G, d_v = config_sizes(cfg)
        # nnx.MultiHeadAttention's attribute names, so code reading them keeps working.
        self.num_heads, self.num_kv_heads, self.head_dim = H, G, d
        self.in_features, self.in_kv_features, self.in_v_features = cfg.query_dim, cfg.context_dim, cfg.value_input_dim
        self.out_features, self.qkv_features = cfg.output_dim, H * d
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.broadcast_dropout, self.dropout_rate, self.deterministic = (
            bool(broadcast_dropout),
            cfg.dropout,
            deterministic,
        )
        self.use_bias, self.attention_fn, self.decode = use_bias, attention_fn, decode
        self.normalize_qk = bool(normalize_qk)
        self.qkv_promote_dtype, self.out_promote_dtype, self.ln_promote_dtype = (
            qkv_promote_dtype,
            out_promote_dtype,
            ln_promote_dtype,
        )
        self.qkv_dot_general, self.out_dot_general = qkv_dot_general, out_dot_general
        self.qkv_dot_general_cls, self.out_dot_general_cls = qkv_dot_general_cls, out_dot_general_cls

        linear = dict(
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            bias_init=bias_init,
            use_bias=use_bias,
            precision=precision,
            promote_dtype=qkv_promote_dtype,
            dot_general=qkv_dot_general,
            dot_general_cls=qkv_dot_general_cls,
            kernel_metadata=kernel_metadata,
            bias_metadata=bias_metadata,
            rngs=rngs,
        )
        self.query = nnx.LinearGeneral(cfg.query_dim, (H, d), **linear)
        self.key = nnx.LinearGeneral(E_kv, (G, d), **linear)
        self.value = nnx.LinearGeneral(E_v, (G, d_v), **linear)
        self.query_ln: nnx.LayerNorm | None
        self.key_ln: nnx.LayerNorm | None
        if self.normalize_qk:
            ln = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, promote_dtype=ln_promote_dtype, rngs=rngs)
            self.query_ln = nnx.LayerNorm(d, scale_metadata=query_ln_scale_metadata, **ln)
            self.key_ln = nnx.LayerNorm(d, scale_metadata=key_ln_scale_metadata, **ln)
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self.out = nnx.LinearGeneral(
            (H, d_v),
            E_o,
            axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init,
            bias_init=out_bias_init or bias_init,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            promote_dtype=out_promote_dtype,
            dot_general=out_dot_general,
            dot_general_cls=out_dot_general_cls,
            rngs=rngs,
            kernel_metadata=out_kernel_metadata or kernel_metadata,
            bias_metadata=out_bias_metadata or bias_metadata,
        )

        # The dropout stream is kept where Flax's MHA keeps it, after the four
        # projections and before the generators draw: with one stream
        # (nnx.Rngs(0)) the same seed then gives Flax's dropout masks.
        kept = rngs.dropout.fork() if keep_rngs and cfg.dropout > 0 else None
        generators = given or make_metric_generators(cfg, param_dtype=param_dtype, rngs=rngs)
        self.metric = nnx.Dict({s: CrossHeadMap(generators[s], param_dtype=param_dtype) for s in cfg.metric_sides})

        self.rngs = kept
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
        coupling: str | None = None,
        rngs: nnx.Rngs,
    ) -> DamchaAttention:
        """A DAMCHA layer with ``mha``'s projections (and q/k norms) and gates
        at 0: ``mha``'s outputs, ready to fine-tune the metric, except in a
        query row that sees no key (fully masked), where ``mha`` outputs the
        projected mean of all the values and this layer the output bias (the
        spec's empty-row rule). The generator is fresh.

        Layers stacked by ``nnx.vmap``/``nnx.scan`` (built under
        ``nnx.split_rngs(splits=L)`` with ``out_axes=0``, nested or not: every
        parameter has the same leading axes in front of its one-layer shape,
        which ``mha``'s sizes give) convert to one ``DamchaAttention`` stacked
        the same way: the construction is vmapped over those axes, so every
        parameter (projections, norms, gates, generators) and the dropout
        stream it keeps carry them, each layer's generator is drawn from its
        own key, and a forward that scans or vmaps over the layers runs the
        converted ones unchanged. ``mha``'s parameters are taken whole, with
        their metadata (the partition names ``nnx.vmap``'s
        ``transform_metadata`` put in front included); the new ones carry none.
        Any other layout (the layer axes elsewhere, as ``out_axes=1`` puts
        them, or leading axes that differ between parameters) raises a
        ``DamchaValueError`` naming the shapes. As for one layer, a decoding
        cache is not copied: initialise the converted layer's (under
        ``nnx.vmap`` when stacked).

        Args:
            mha: the ``nnx.MultiHeadAttention`` to copy (with its sharding metadata),
                one layer or layers stacked on leading axes.
            metric: ``"heads"`` or ``"lowrank"``, as in the constructor.
            metric_rank: r for ``metric="lowrank"``; None otherwise.
            coupling: ``"tied"``, ``"separate"``, ``"query"``; None picks it from ``mha``'s
                shape (tied when num_kv_heads == num_heads and in_kv_features == in_features).
            rngs: the generator's initialisation keys (and dropout's, as in the
                constructor); for stacked layers every stream is split over the
                layer axes (``nnx.split_rngs``: one draw from each stream).
        """
        return from_mha(cls, mha, metric=metric, metric_rank=metric_rank, coupling=coupling, rngs=rngs)

    # ----------------------------------------------------------------- calls

    def _dropout_rng(self, deterministic: bool | None, rngs: Any) -> tuple[bool, Array | None]:
        """(deterministic, key) as nnx.MultiHeadAttention decides them."""
        # Checked before the rate: a non-bool is refused even where dropout is off (a truthy
        # "no" read as True would hide the mistake until dropout_rate > 0).
        if deterministic is not None:
            deterministic = check_bool("deterministic", deterministic)
        if self.dropout_rate == 0.0:
            return True, None
        if deterministic is None:
            deterministic = self.deterministic
        if deterministic is None:
            raise DamchaValueError(
                invalid_argument(
                    "deterministic",
                    f"a bool, given to __call__ or the constructor, when dropout_rate={self.dropout_rate} > 0",
                    "deterministic=None",
                )
            )
        if deterministic:
            return True, None
        if isinstance(rngs, nnx.Rngs):
            stream = rngs.dropout
        elif rngs is None or isinstance(rngs, nnx.RngStream):
            stream = rngs or self.rngs
        else:
            raise DamchaTypeError(
                invalid_argument("rngs", "an nnx.Rngs, an nnx.RngStream or None", f"rngs={describe(rngs)}")
            )
        if stream is None:
            raise DamchaValueError(
                invalid_argument(
                    "rngs",
                    "an nnx.Rngs passed to __call__ when dropout is active and the layer keeps no rngs (keep_rngs=False)",
                    "rngs=None",
                )
            )
        return False, stream()

    def _metric_params(self) -> dict[str, Array]:
        """The metric sides' canonical tensors (what ``_functional``'s map steps read)."""
        out: dict[str, Array] = {}
        for side in self.config.metric_sides:
            cross = self.metric[side]
            out[f"metric.{side}.gate"] = cross.gate[...]
            out.update({f"metric.{side}.{leaf}": var[...] for leaf, var in cross.generator.leaves().items()})
        return out

    def __call__(
        self,
        inputs_q: Array,
        inputs_k: Array | None = None,
        inputs_v: Array | None = None,
        *,
        mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        is_causal: bool = False,
        out_sharding: Any = None,
        qkv_sharding: Any = None,
        mask_hint: str | None = None,
    ) -> Array:
        """Attention of ``inputs_q`` [batch..., N, E_q] over ``inputs_k`` [batch..., M, E_kv].

        As ``nnx.MultiHeadAttention``: ``inputs_k=None`` is self-attention,
        ``inputs_v`` defaults to ``inputs_k``; inputs may be unbatched (N, E)
        or carry several batch axes. ``mask`` is True (or 1) = attend, shape
        (N, M) or [batch..., H|1, N|1, M], with extra leading size-1 axes or
        fewer axes when those before (N, M) are 1 (what Flax broadcasts
        unambiguously); bool, or numeric with only 0 and 1
        (``nnx.make_attention_mask``/``make_causal_mask`` give float 0/1
        masks). A numeric mask with other values (an additive 0/-inf mask,
        which Flax would read inverted) is refused, or under ``jit`` makes the
        output NaN. The key map is computed from ``inputs_k``'s tokens.
        ``sow_weights`` stores the attention probabilities in
        ``nnx.Intermediate`` as ``attention_weights``. With ``decode`` the new
        tokens (one or more) are appended to the cache (``init_cache``) and
        attend causally over it. ``is_causal`` overlays the causal rule on
        ``mask``, as in Flax. ``mask_hint`` says what ``mask`` is so that
        under ``jit`` the fused kernel gets the causal rule and a key mask
        [batch..., H|1, 1, M] instead of the (N, M) mask: ``"causal"`` (the
        causal rule and padding only, ``nnx.combine_masks(nnx.make_causal_mask(t),
        padding)``) or ``"padding"`` (``nnx.make_attention_mask`` of query and
        key padding only); checked on the device, a mask that is not what the
        hint says gives NaN under ``jit`` (a DamchaValueError, before any
        projection or dropout draw, when its values are concrete: a JAX bool
        mask is then read back for the check), never a wrong number.
        Concrete numeric masks need no hint.
        Returns [batch..., N, E_o].
        """
        if inputs_k is None and inputs_v is not None:
            raise DamchaValueError(
                invalid_argument(
                    "inputs_k",
                    "the key tokens when `inputs_v` is given (pass the key/value tokens as inputs_k)",
                    f"inputs_k=None, inputs_v={describe(inputs_v)}",
                )
            )
        x = F.check_float("inputs_q", inputs_q)
        k_in = None if inputs_k is None else F.check_float("inputs_k", inputs_k)
        v_in = None if inputs_v is None else F.check_float("inputs_v", inputs_v)
        is_causal = check_bool("is_causal", is_causal)
        sow_weights = check_bool("sow_weights", sow_weights)
        decode = self.decode if decode is None else check_bool("decode", decode)
        mask_hint = check_hint(mask_hint, mask)
        checked = read_mask(mask, "mask")
        cache_len = None
        if decode:
            if self.cached_key is None:
                raise DamchaValueError("The decoding cache is not initialised: call init_cache(input_shape) first.")
            cache_len = self.cached_key.shape[-3]
        lead, view = _check_inputs(self.config, x, k_in, v_in, checked.array, keys=cache_len)
        if view is not None:
            checked = reshape_mask(checked, view)
        if decode:
            # Every refusal comes before the dropout key is drawn: drawing advances the layer's (or
            # the caller's) rng stream, and a refused call must not change the next call's masks.
            self._check_step(lead, x.shape[-2], (x if k_in is None else k_in).shape[-2], "inputs_q")
        if mask_hint is not None:
            # A concrete mask that is not what its hint says: a DamchaValueError here (under jit, NaN).
            keys, offset = (x if k_in is None else k_in).shape[-2], None
            if cache_len is not None and self.cache_index is not None:  # decoding: the mask spans the cache
                keys, offset = cache_len, self.cache_index[...]
            checked = check_hinted(checked, x.shape[-2], keys, hint=mask_hint, offset=0 if offset is None else offset)
        deterministic, dropout_rng = self._dropout_rng(deterministic, rngs)

        ctx = x if k_in is None else k_in
        default = _is_default_attention(self.attention_fn) and not decode
        q_bias = None
        if default and self.query_ln is None and side_of(self.config, "q") and len(self.query.batch_axis) == 0:
            # The mapped query's bias goes into its map (mapped_attention's q_bias), not a pass of its own.
            q, q_bias = _project_unbiased(self.query, x, qkv_sharding)
        else:
            q = self.query(x, out_sharding=qkv_sharding)
        k = self.key(ctx, out_sharding=qkv_sharding)
        v = self.value(ctx if v_in is None else v_in, out_sharding=qkv_sharding)
        if self.query_ln is not None and self.key_ln is not None:
            q, k = self.query_ln(q), self.key_ln(k)
        if self.config.metric_sides and not default:
            folded_q, folded_k = F.cross_head_maps(
                self._metric_params(),
                self.config,
                _fold(x, lead, 2),
                _fold(k_in, lead, 2),
                _fold(q, lead, 3),
                _fold(k, lead, 3),
                precision=self.precision,
                terms=bool(decode) and isinstance(q, jax.core.Tracer),
            )
            q, k = jnp.reshape(folded_q, q.shape), jnp.reshape(folded_k, k.shape)

        bad = checked.flag
        if not _is_default_attention(self.attention_fn):
            o = self._custom_attention(
                q, k, v, checked.array, lead, decode, is_causal, deterministic, dropout_rng, sow_weights
            )
        elif decode:
            sown: list[jax.Array] | None = [] if sow_weights else None
            o, bad = self._decode(
                q,
                k,
                v,
                fold_mask(checked, lead),
                dropout_rng=dropout_rng,
                broadcast_dropout=self.broadcast_dropout,
                precision=self.precision,
                name="inputs_q",
                mask_hint=mask_hint,
                weights_out=sown,
            )
            if sown:
                # Flax records a decoding step's probabilities over the whole cache too,
                # and in the computation's dtype (its softmax may run in float32; the
                # cache, whose dtype o has, may be float32 under dtype=bfloat16).
                self.sow(nnx.Intermediate, "attention_weights", sown[0].astype(self.dtype or o.dtype))
        else:
            # The maps run here, under mapped_attention's checkpoint (training saves q and k, not q~ and k~).
            o, weights, bad = F.mapped_attention(
                self._metric_params(),
                self.config,
                _fold(x, lead, 2),
                _fold(k_in, lead, 2),
                _fold(q, lead, 3),
                _fold(k, lead, 3),
                _fold(v, lead, 3),
                q_bias=q_bias,
                mask=fold_mask(checked, lead),
                is_causal=is_causal,
                return_weights=sow_weights,
                dropout_rng=dropout_rng,
                broadcast_dropout=self.broadcast_dropout,
                precision=self.precision,
                mask_hint=mask_hint,
            )
            o = jnp.reshape(o, (*lead, *o.shape[1:]))
            if sow_weights:
                assert weights is not None  # attend returns them when asked
                # In the computation's dtype, as Flax records them (bfloat16 under dtype=bfloat16).
                sown_weights = jnp.reshape(weights, (*lead, *weights.shape[1:])).astype(o.dtype)
                self.sow(nnx.Intermediate, "attention_weights", sown_weights)
        return F._poison(self.out(o, out_sharding=out_sharding), bad)

    def _custom_attention(self, q, k, v, mask, lead, decode, is_causal, deterministic, dropout_rng, sow_weights):
        """``attention_fn`` on q~, k~ (after the maps) and v, called as Flax calls it."""
        if self.config.scale is not None:
            # A standard kernel scales by 1/sqrt(d): fold the configured scale into q~.
            q = q * jnp.asarray(self.config.scale * np.sqrt(self.config.key_dim), q.dtype)
        overflow = None
        if decode:
            cached_k, cached_v, index = self.cached_key, self.cached_value, self.cache_index
            assert cached_k is not None and cached_v is not None and index is not None  # init_cache set all three
            T = q.shape[-3]
            overflow = self._check_step(lead, T, k.shape[-3], "inputs_q")
            zero = jnp.zeros((), jnp.int32)
            start = (zero,) * len(lead) + (index[...].astype(jnp.int32), zero, zero)
            cached_k[...] = jax.lax.dynamic_update_slice(cached_k[...], k.astype(cached_k.dtype), start)
            cached_v[...] = jax.lax.dynamic_update_slice(cached_v[...], v.astype(cached_v.dtype), start)
            visible = self._decode_mask(T)
            mask = visible if mask is None else jnp.logical_and(mask, visible)
            k, v = cached_k[...], cached_v[...]
            index[...] = index[...] + T
        attention_fn = self.attention_fn
        assert attention_fn is not None  # __call__ comes here for a custom attention_fn only
        o = attention_fn(
            q,
            k,
            v,
            mask=mask,
            dropout_rng=dropout_rng,
            dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout,
            deterministic=deterministic,
            dtype=self.dtype,
            precision=self.precision,
            module=self if sow_weights else None,
            is_causal=is_causal,
        )
        return F._poison(o, overflow)

    def metric_penalty(self, inputs_q: Array, inputs_k: Array | None = None) -> Array:
        """The optional regulariser mean ||L(t) - I||_F^2 / (S*d) (``damcha_core.metric_penalty``)."""
        x = F.check_float("inputs_q", inputs_q)
        c = None if inputs_k is None else F.check_float("inputs_k", inputs_k)
        lead, _ = _check_inputs(self.config, x, c, None, None)
        x, c = _fold(x, lead, 2), _fold(c, lead, 2)
        params = self._metric_params()
        per_role = []
        for role, tokens in (("q", x), ("k", x if c is None else c)):
            side = side_of(self.config, role)
            if side is not None:
                coeff = F.generator(params, self.config, side, tokens)
                per_role.append(role_penalty(jnp, params, self.config, side, coeff))
        return jnp.mean(jnp.stack(per_role)) if per_role else jnp.zeros((), x.dtype)

    def set_view(
        self,
        deterministic: bool | None = None,
        decode: bool | None = None,
        batch_size: int | tuple[int, ...] | None = None,
        max_length: int | None = None,
    ) -> None:
        """As ``nnx.MultiHeadAttention.set_view`` (used by ``nnx.view``): set the
        call defaults, and allocate the cache for ``decode=True`` when it has
        none yet (``batch_size`` and ``max_length`` are then required)."""
        if deterministic is not None:
            self.deterministic = check_bool("deterministic", deterministic)
        if decode is not None:
            self.decode = check_bool("decode", decode)
            if self.decode and self.cached_key is None:
                if batch_size is None or max_length is None:
                    raise DamchaValueError(
                        invalid_argument(
                            "batch_size" if batch_size is None else "max_length",
                            "a value with decode=True to allocate the cache (both batch_size and max_length)",
                            f"batch_size={describe(batch_size)}, max_length={describe(max_length)}",
                        )
                    )
                batch = (batch_size,) if isinstance(batch_size, (int, np.integer)) else tuple(batch_size)
                self.init_cache((*batch, max_length, self.in_features), self.dtype or jnp.float32)


def replace_mha(
    model: nnx.Module,
    *,
    rngs: nnx.Rngs,
    metric: str = "heads",
    metric_rank: int | None = None,
    coupling: str | None = None,
) -> nnx.Module:
    """Swap every ``nnx.MultiHeadAttention`` inside ``model`` for
    ``DamchaAttention.from_mha``, in place; returns ``model``.

    The layers are found wherever Flax NNX holds modules: attributes,
    ``nnx.List``/``nnx.Dict`` and the lists, tuples and dicts a module keeps
    (``nnx.data``). A layer held in several places (an attribute aliasing a
    block's attention) stays one layer, held in all of them. Outputs are
    unchanged (gates at 0; a fully masked query row gives the output bias, the
    spec's rule, where Flax averages the values), and ``nnx.jit``, ``nnx.grad``
    and optimizers see the new parameters as any others.

    Every layer is converted before any is installed: one that cannot be (a
    subclass with its own ``__call__``, a ``coupling`` its sizes refuse, a
    stacked layer whose layer axes are not in front) raises a ``DamchaError``
    naming its path, and the model is left as it was. A model without
    ``nnx.MultiHeadAttention`` warns (most likely the wrong model, or one
    converted already) and is returned unchanged.

    Args:
        model: an ``nnx.Module`` holding ``nnx.MultiHeadAttention`` layers.
        rngs: the generators' initialisation keys (one draw per layer), and the
            dropout stream a layer with ``dropout_rate > 0`` keeps, as in
            ``from_mha``. Layers stacked by ``nnx.vmap``/``nnx.scan`` (the same
            leading layer axes on every parameter) are converted in one piece,
            stacked the same way, each layer with its own generator draw (see
            ``DamchaAttention.from_mha``), so the model's scan or vmap over its
            blocks runs the converted layers unchanged.
        metric, metric_rank, coupling: as in ``DamchaAttention.from_mha``
            (``coupling=None`` picks each layer's from its shape).
    """
    from ._convert import replace_mha as _replace

    return _replace(DamchaAttention, model, rngs=rngs, metric=metric, metric_rank=metric_rank, coupling=coupling)
