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


def _unstacked_shapes(mha: Any) -> dict[tuple[str, str], tuple[int, ...]]:
    """(submodule, leaf) -> shape of one layer's copy of that parameter, from
    ``mha``'s static attributes (as nnx.MultiHeadAttention builds them): the
    shapes every leading axis of a stacked ``mha`` sits in front of."""
    H, G, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
    E_q, E_kv, E_o = mha.in_features, mha.in_kv_features, mha.out_features
    shapes: dict[tuple[str, str], tuple[int, ...]] = {
        ("query", "kernel"): (E_q, H, d),
        ("key", "kernel"): (E_kv, G, d),
        ("value", "kernel"): (E_kv, G, d),
        ("out", "kernel"): (H, d, E_o),
    }
    if mha.use_bias:
        shapes.update(
            {("query", "bias"): (H, d), ("key", "bias"): (G, d), ("value", "bias"): (G, d), ("out", "bias"): (E_o,)}
        )
    if mha.normalize_qk:
        shapes.update({("query_ln", "scale"): (d,), ("key_ln", "scale"): (d,)})
    return shapes


def _layer_axes(mha: Any) -> tuple[int, ...]:
    """The leading axes ``nnx.vmap``/``nnx.scan`` (``out_axes=0``, nested or
    not) put in front of every parameter of ``mha``: () for one layer.
    Refuses a layout with the layer axes elsewhere (``out_axes=1``), or
    leading axes that differ between parameters: no vmap over them rebuilds
    the layers."""
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
        f"{name}.{leaf}": (tuple(getattr(getattr(mha, name), leaf).shape), one)
        for (name, leaf), one in _unstacked_shapes(mha).items()
    }
    if mha.rngs is not None:
        # The dropout stream mha keeps: the converted layer's is split over the layer axes like
        # its parameters, so a forward that slices every variable of the block (scan or vmap with
        # in_axes=0) must have found mha's stacked the same way.
        shapes["rngs.count"] = (tuple(mha.rngs.count.shape), ())
    leads: dict[str, tuple[int, ...] | None] = {
        path: shape[: len(shape) - len(one)]
        if len(shape) >= len(one) and shape[len(shape) - len(one) :] == one
        else None
        for path, (shape, one) in shapes.items()
    }
    distinct = set(leads.values())
    if len(distinct) == 1 and None not in distinct:
        lead = leads[next(iter(leads))]
        assert lead is not None
        return lead
    # Name what breaks the rule: the shapes that do not end with their one-layer shape, or else
    # one shape for each leading axes found.
    shown = [path for path, lead in leads.items() if lead is None]
    if not shown:
        first: dict[tuple[int, ...] | None, str] = {}
        for path, lead in leads.items():
            first.setdefault(lead, path)
        shown = list(first.values())
    raise DamchaValueError(
        invalid_argument(
            "mha",
            "an nnx.MultiHeadAttention whose parameters have the one-layer shapes its sizes give ("
            + ", ".join(f"{path} {shapes[path][1]}" for path in shown)
            + "), all behind the same leading layer axes when the layers are stacked (nnx.vmap or nnx.scan "
            "with the layer axis first, out_axes=0, nested or not; a dropout stream it keeps, rngs.count, too)",
            ", ".join(f"mha.{path}.shape={shapes[path][0]}" for path in shown),
        )
    )


def _options(mha: Any, *, metric: str, metric_rank: int | None, coupling: str | None) -> dict[str, Any]:
    """``cls``'s constructor arguments that rebuild ``mha`` (less ``rngs`` and the metadata)."""
    return dict(
        num_heads=mha.num_heads,
        in_features=mha.in_features,
        qkv_features=mha.qkv_features,
        out_features=mha.out_features,
        num_kv_heads=mha.num_kv_heads,
        in_kv_features=mha.in_kv_features,
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
        attention_fn=None if mha.attention_fn is nnx.dot_product_attention else mha.attention_fn,
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
    )


def _metadata_options(mha: Any) -> dict[str, Any]:
    """The ``*_metadata`` constructor arguments that give the copies ``mha``'s metadata."""
    metadata = dict(kernel_metadata=_metadata(mha.query.kernel), out_kernel_metadata=_metadata(mha.out.kernel))
    if mha.use_bias:
        metadata.update(bias_metadata=_metadata(mha.query.bias), out_bias_metadata=_metadata(mha.out.bias))
    if mha.normalize_qk:
        assert mha.query_ln is not None and mha.key_ln is not None  # built by normalize_qk
        metadata.update(
            query_ln_scale_metadata=_metadata(mha.query_ln.scale), key_ln_scale_metadata=_metadata(mha.key_ln.scale)
        )
    return metadata


def _own_copy(variable: Any) -> Any:
    """``variable`` copied with its metadata and a buffer of its own.

    ``Variable.copy`` shares the array: a jitted step that donates one layer's
    state (``donate_argnums``) would then delete the other's weights ("Array
    has been deleted") when a user trains the converted layer and keeps the
    original. ``jnp.copy`` keeps the array's dtype and sharding.
    """
    return variable.copy(jnp.copy(variable[...]))


def _from_stacked(cls: Any, mha: Any, axes: tuple[int, ...], options: dict[str, Any], rngs: nnx.Rngs) -> Any:
    """``from_mha`` of layers stacked on leading ``axes``: the constructor
    vmapped over them, each layer with its own keys (so its own generator
    draws and dropout stream), then ``mha``'s parameters installed whole."""

    def build(layer_rngs: nnx.Rngs) -> Any:
        return cls(**options, rngs=layer_rngs)

    # One layer built abstractly first: what the constructor refuses (a coupling the sizes
    # refuse, a missing metric_rank) is refused before the split below draws from rngs.
    nnx.eval_shape(lambda: build(nnx.Rngs(0)))

    for _ in axes:  # nested vmaps stack nested axes, outermost first
        build = nnx.vmap(build, in_axes=0, out_axes=0)
    # Every stream split to the layer axes, then restored, each advanced by one draw (so two
    # stacks converted with one rngs draw differently, as two single layers do).
    with nnx.split_rngs(rngs, splits=axes):
        layer = build(rngs)
    for name, leaf in _unstacked_shapes(mha):
        # The variable itself, not its value copied into the one built: built under vmap it has
        # no metadata, while mha's carries the partition names nnx.vmap's transform_metadata may
        # have put in front (and its arrays their shardings), which a scan over the layers reads.
        setattr(getattr(layer, name), leaf, _own_copy(getattr(getattr(mha, name), leaf)))
    return layer


def from_mha(cls: Any, mha: Any, *, metric: str, metric_rank: int | None, coupling: str | None, rngs: nnx.Rngs) -> Any:
    """``cls`` (``DamchaAttention``) with ``mha``'s projections (and q/k norms)
    and every option it has, gates at 0: ``mha``'s outputs (except in rows
    that see no key, see ``DamchaAttention.from_mha``), ready to fine-tune
    the metric. The generator is fresh; ``coupling=None`` is automatic. Layers
    stacked by ``nnx.vmap``/``nnx.scan`` give a layer stacked the same way."""
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
    axes = _layer_axes(mha)
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
    options = _options(mha, metric=metric, metric_rank=metric_rank, coupling=coupling)
    if axes:
        return _from_stacked(cls, mha, axes, options, rngs)
    layer = cls(**options, rngs=rngs, **_metadata_options(mha))
    for name, leaf in _unstacked_shapes(mha):
        # The variable itself (a copy), as _from_stacked installs it: its arrays keep
        # their dtype (an MHA cast to bfloat16 after construction stays bfloat16, where
        # writing into the new variable cast them to param_dtype) and their metadata.
        setattr(getattr(layer, name), leaf, _own_copy(getattr(getattr(mha, name), leaf)))
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
