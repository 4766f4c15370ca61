"""Converting a trained ``nnx.MultiHeadAttention`` into a ``DamchaAttention``."""

from __future__ import annotations

from typing import Any

from flax import nnx

import jax.numpy as jnp
from damcha_core import DamchaTypeError, DamchaValueError, describe, invalid_argument

# Bound once: code that swaps nnx.MultiHeadAttention for DamchaAttention
# (e.g. to run Flax's own tests against it) still converts real Flax layers.
_FlaxMHA = nnx.MultiHeadAttention


def _metadata(variable: Any) -> dict[str, Any]:
    """What a variable's constructor was given as ``*_metadata`` (or by
    ``nnx.with_partitioning``): its metadata less the entries every fresh
    variable has (the sharding names are what matters: a converted layer keeps
    its parameters' sharding, and under an explicit-sharding mesh the copy of a
    sharded kernel into an unsharded one is a JAX type error)."""
    defaults = nnx.Param(jnp.zeros(())).get_metadata()
    return {k: v for k, v in variable.get_metadata().items() if k not in defaults or defaults[k] != v}


def from_mha(cls: Any, mha: Any, *, metric: str, metric_rank: int | None, coupling: str | None, rngs: nnx.Rngs) -> Any:
    """``cls`` (``DamchaAttention``) with ``mha``'s projections (and q/k norms)
    and every option it has, gates at 0: ``mha``'s outputs (except in rows
    that see no key, see ``DamchaAttention.from_mha``), ready to fine-tune
    the metric. The generator is fresh; ``coupling=None`` is automatic."""
    if not isinstance(mha, _FlaxMHA):
        raise DamchaTypeError(invalid_argument("mha", "an nnx.MultiHeadAttention", f"mha={describe(mha)}"))
    if type(mha).__call__ is not _FlaxMHA.__call__:
        # The copy reproduces nnx.MultiHeadAttention.__call__ only: a subclass
        # with its own __call__ would convert to a layer with other outputs.
        raise DamchaValueError(
            invalid_argument(
                "mha",
                "an nnx.MultiHeadAttention whose __call__ is nnx.MultiHeadAttention.__call__ (a subclass with its "
                "own __call__ computes something from_mha cannot copy)",
                f"mha={type(mha).__module__}.{type(mha).__qualname__}, which overrides __call__",
            )
        )
    kernel_shape = tuple(mha.query.kernel.shape)
    if len(kernel_shape) != 3:
        # nnx.vmap/nnx.scan over layers stacks each parameter with a leading layer axis.
        raise DamchaValueError(
            invalid_argument(
                "mha",
                "an nnx.MultiHeadAttention of one layer, its query kernel (in_features, num_heads, head_dim); "
                "layers stacked by nnx.vmap or nnx.scan are not converted (convert each layer before stacking)",
                f"mha.query.kernel.shape={kernel_shape}",
            )
        )
    if mha.rngs is not None and mha.dropout_rate > 0:
        try:
            rngs.dropout  # noqa: B018 - the stream the layer keeps for its dropout, as mha kept one
        except AttributeError:
            raise DamchaValueError(
                invalid_argument(
                    "rngs",
                    f"an nnx.Rngs with a 'dropout' (or default) stream: mha has dropout_rate={mha.dropout_rate} "
                    "and keeps its rngs, so the converted layer keeps a dropout stream too",
                    f"rngs with streams {sorted(k for k in vars(rngs) if not k.startswith('_'))}",
                )
            ) from None
    attention_fn = None if mha.attention_fn is nnx.dot_product_attention else mha.attention_fn
    metadata = dict(kernel_metadata=_metadata(mha.query.kernel), out_kernel_metadata=_metadata(mha.out.kernel))
    if mha.use_bias:
        metadata.update(bias_metadata=_metadata(mha.query.bias), out_bias_metadata=_metadata(mha.out.bias))
    if mha.normalize_qk:
        assert mha.query_ln is not None and mha.key_ln is not None  # built by normalize_qk
        metadata.update(
            query_ln_scale_metadata=_metadata(mha.query_ln.scale), key_ln_scale_metadata=_metadata(mha.key_ln.scale)
        )
    layer = cls(
        mha.num_heads,
        mha.in_features,
        mha.qkv_features,
        mha.out_features,
        mha.num_kv_heads,
        mha.in_kv_features,
        metric=metric,
        metric_rank=metric_rank,
        coupling=coupling,
        dtype=mha.dtype,
        param_dtype=mha.param_dtype,
        broadcast_dropout=mha.broadcast_dropout,
        dropout_rate=mha.dropout_rate,
        deterministic=mha.deterministic,
        precision=mha.precision,
        use_bias=mha.use_bias,
        attention_fn=attention_fn,
        decode=mha.decode,
        normalize_qk=mha.normalize_qk,
        qkv_promote_dtype=mha.qkv_promote_dtype,
        out_promote_dtype=mha.out_promote_dtype,
        ln_promote_dtype=mha.ln_promote_dtype,
        qkv_dot_general=mha.qkv_dot_general,
        out_dot_general=mha.out_dot_general,
        qkv_dot_general_cls=mha.qkv_dot_general_cls,
        out_dot_general_cls=mha.out_dot_general_cls,
        keep_rngs=mha.rngs is not None,
        rngs=rngs,
        **metadata,
    )
    for name in ("query", "key", "value", "out"):
        source, target = getattr(mha, name), getattr(layer, name)
        target.kernel[...] = source.kernel[...]
        if layer.use_bias:
            target.bias[...] = source.bias[...]
    if mha.normalize_qk:
        # normalize_qk builds both LayerNorms, with a scale (as the layer's, built from mha's flags).
        for ln in ("query_ln", "key_ln"):
            source_ln, target_ln = getattr(mha, ln), getattr(layer, ln)
            assert source_ln.scale is not None and target_ln.scale is not None
            target_ln.scale[...] = source_ln.scale[...]
    return layer


# --------------------------------------------------------------- whole models

_REPLACE_KEYS = ("metric", "metric_rank", "coupling")


def _children(node: Any) -> list[tuple[Any, Any]]:
    """(key, child) of a graph node whose children may hold attention layers:
    a Module's attributes, a list's or tuple's items, a dict's values."""
    # The containers first: nnx.List and nnx.Dict are Modules too, whose attributes are their items.
    if isinstance(node, (list, tuple, nnx.List)):
        return list(enumerate(node))
    if isinstance(node, (dict, nnx.Dict)):
        return list(node.items())
    if isinstance(node, nnx.Module):
        return list(vars(node).items())
    return []


def _label(path: tuple[Any, ...]) -> str:
    return "model" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def _find_mhas(model: Any) -> dict[int, tuple[str, Any]]:
    """id -> (first path, layer) of every nnx.MultiHeadAttention in ``model``'s graph."""
    found: dict[int, tuple[str, Any]] = {}
    seen: set[int] = set()

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, _FlaxMHA):
            found.setdefault(id(node), (_label(path), node))
            return
        if id(node) in seen:
            return
        seen.add(id(node))
        for key, child in _children(node):
            walk(child, (*path, key))

    walk(model, ())
    return found


def _install(node: Any, done: dict[int, Any], seen: dict[int, Any]) -> Any:
    """``node`` with every reference to a converted layer replaced (in place;
    a tuple, immutable, comes back rebuilt for its parent to hold). ``seen``:
    id -> what a node visited before became, so a tuple held twice is rebuilt
    once and both holders get the rebuilt one."""
    if isinstance(node, _FlaxMHA):
        return done[id(node)]
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = node  # (a cycle back to a tuple being rebuilt finds the old one: tuples hold no cycle)
    replaced = [(key, child, _install(child, done, seen)) for key, child in _children(node)]
    changed = [(key, new) for key, child, new in replaced if new is not child]
    if not changed:
        return node
    if isinstance(node, tuple):
        items = list(node)
        for key, new in changed:
            items[key] = new
        rebuilt = type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
        seen[id(node)] = rebuilt
        return rebuilt
    for key, new in changed:
        if isinstance(node, (list, dict, nnx.List, nnx.Dict)):
            node[key] = new
        else:
            setattr(node, key, new)
    return node


def replace_mha(cls: Any, model: Any, *, rngs: nnx.Rngs, **kwargs: Any) -> Any:
    """Swap every ``nnx.MultiHeadAttention`` in ``model`` for ``cls.from_mha``; see
    ``damcha_jax.replace_mha``."""
    from damcha_core._validators import unknown_fields

    if not isinstance(model, nnx.Module):
        raise DamchaTypeError(invalid_argument("model", "a flax.nnx.Module", f"model={describe(model)}"))
    if isinstance(model, _FlaxMHA):
        raise DamchaValueError(
            invalid_argument(
                "model",
                "a model that contains nnx.MultiHeadAttention layers; it is itself one (use "
                "DamchaAttention.from_mha(model, rngs=...))",
                f"model={describe(model)}",
            )
        )
    unknown = sorted(set(kwargs) - set(_REPLACE_KEYS))
    if unknown:
        raise DamchaTypeError(
            unknown_fields(unknown, _REPLACE_KEYS, "the arguments replace_mha passes to from_mha", "keyword argument")
        )
    if not isinstance(rngs, nnx.Rngs):
        raise DamchaTypeError(invalid_argument("rngs", "an nnx.Rngs", f"rngs={describe(rngs)}"))
    found = _find_mhas(model)
    done: dict[int, Any] = {}
    # Every layer is built before any is installed: one that cannot be converted
    # (a subclass with its own __call__, a coupling its sizes refuse) leaves the
    # model as it was, and the error names its path.
    for key, (path, mha) in found.items():
        try:
            done[key] = cls.from_mha(mha, rngs=rngs, **kwargs)
        except (DamchaValueError, DamchaTypeError) as exc:
            raise type(exc)(f"{exc} (at {path})") from None
    if not done:
        import warnings

        already = sum(isinstance(node, cls) for _, node in nnx.iter_graph(model))
        warnings.warn(
            f"replace_mha found no nnx.MultiHeadAttention in {type(model).__name__}: nothing was replaced"
            + (f" (it holds {already} DamchaAttention layers already)." if already else "."),
            UserWarning,
            stacklevel=3,
        )
        return model
    _install(model, done, {})
    return model
