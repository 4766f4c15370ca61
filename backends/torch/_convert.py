"""Converting nn.MultiheadAttention: ``from_mha`` (one layer) and ``replace_mha`` (a whole model)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from damcha_core import DamchaTypeError, DamchaValueError, describe, invalid_argument
from damcha_core._validators import unknown_fields
from torch import nn

from ._blocks import DamchaTransformerEncoderLayer
from ._generator import MetricGenerator
from ._layer import DamchaAttention

__all__ = ["from_mha", "replace_mha"]


def _class_path(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _callable_name(f: Any) -> str:
    """``f``'s qualified name (a partial's function's), not its repr, which for
    a bound method prints the whole module."""
    inner = getattr(f, "func", f)
    return getattr(inner, "__qualname__", type(f).__name__)


def check_own_forward(mha: nn.Module, where: str = "mha") -> None:
    """Refuse an ``nn.MultiheadAttention`` subclass that computes something else.

    ``from_mha`` copies the attributes ``nn.MultiheadAttention.forward`` reads;
    a subclass with its own ``forward`` (e.g. torch.ao.nn.quantizable's, whose
    weights live in ``linear_Q/K/V`` while ``in_proj_weight`` is stale) would be
    swapped for a layer with different outputs. Subclasses that only add
    attributes or methods keep MHA's forward and convert exactly. A
    ``forward`` set on the instance is refused too: the copy would not run it.
    """
    if type(mha).forward is not nn.MultiheadAttention.forward:
        raise DamchaValueError(
            invalid_argument(
                where,
                "an nn.MultiheadAttention whose forward is nn.MultiheadAttention.forward (a subclass with its own "
                "forward computes something from_mha cannot copy; convert the plain layer, or rewrite the subclass "
                "around DamchaAttention)",
                f"{where}={_class_path(mha)}, which overrides forward",
            )
        )
    if "forward" in mha.__dict__:
        # Set on the instance by a wrapper (accelerate's dispatch hooks, a
        # profiler, a monkeypatch): the new layer would silently drop it.
        raise DamchaValueError(
            invalid_argument(
                where,
                "an nn.MultiheadAttention that runs nn.MultiheadAttention.forward (remove the wrapper that replaced "
                "its forward, convert, then wrap the converted layer; forward hooks are kept by replace_mha)",
                f"{where}={_class_path(mha)} with a forward set on the instance ({_callable_name(mha.__dict__['forward'])})",
            )
        )


def _taken_parameters(mha: nn.Module) -> list[str]:
    """The tensors ``nn.MultiheadAttention.forward`` reads off ``mha`` that
    are set but no longer its own parameters (a weight tool holds them)."""
    names = ("in_proj_weight",) if mha._qkv_same_embed_dim else ("q_proj_weight", "k_proj_weight", "v_proj_weight")
    return [
        name
        for name in (*names, "in_proj_bias", "bias_k", "bias_v")
        if name not in mha._parameters and getattr(mha, name, None) is not None
    ]


def check_replaceable(mha: nn.Module, where: str) -> None:
    """``check_own_forward``, and refuse an ``nn.MultiheadAttention`` whose
    own parameters a weight tool holds: swapping it in place for a layer with
    a copy of their values would silently train without the tool."""
    check_own_forward(mha, where)
    taken = _taken_parameters(mha)
    if taken:
        # parametrize, prune, weight_norm and spectral_norm each move the
        # parameter elsewhere and compute it per call.
        raise DamchaValueError(
            invalid_argument(
                where,
                "an nn.MultiheadAttention whose own parameters are plain (remove the weight tool first, e.g. "
                "parametrize.remove_parametrizations(mha, name) or prune.remove(mha, name), convert, then apply it to "
                "the DamchaAttention, which takes the same tools on the same names; tools on out_proj are kept)",
                f"{where}={_class_path(mha)} whose {', '.join(taken)} a weight tool has taken over",
            )
        )


# Every hook registry an nn.Module instance holds, read off torch's own
# constructor so that registries a later torch adds are carried too.
_HOOK_ATTRIBUTES = tuple(name for name in vars(nn.Module()) if "hook" in name)


def _carry_hooks(mha: nn.Module, layer: nn.Module) -> None:
    """Give ``layer`` the very hook registries of ``mha``: its hooks run on the
    layer (whose forward takes MHA's arguments and returns MHA's outputs), and
    the handles the user got when registering them still remove them."""
    for name in _HOOK_ATTRIBUTES:
        if name in mha.__dict__:
            layer.__dict__[name] = mha.__dict__[name]


_FROM_MHA_KEYS = ("metric", "metric_rank", "coupling", "metric_generator", "recompute")


@torch.no_grad()
def from_mha(
    cls: type[DamchaAttention],
    mha: nn.MultiheadAttention,
    *,
    metric: str = "heads",
    metric_rank: int | None = None,
    coupling: str | None = None,
    metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
    recompute: bool = True,
) -> DamchaAttention:
    """``cls.from_mha``: a layer computing exactly what ``mha`` computes (gates at 0).

    ``coupling=None`` is automatic: "tied" when kdim == embed_dim, else "separate".
    """
    if not isinstance(mha, nn.MultiheadAttention):
        raise DamchaTypeError(invalid_argument("mha", "an nn.MultiheadAttention", f"mha={describe(mha)}"))
    check_own_forward(mha)
    ref = mha.out_proj.weight
    layer = cls(
        mha.embed_dim,
        mha.num_heads,
        dropout=mha.dropout,
        bias=mha.in_proj_bias is not None,
        add_bias_kv=mha.bias_k is not None,
        add_zero_attn=mha.add_zero_attn,
        kdim=mha.kdim,
        vdim=mha.vdim,
        batch_first=mha.batch_first,
        device=ref.device,
        dtype=ref.dtype,
        metric=metric,
        metric_rank=metric_rank,
        coupling=coupling,
        metric_generator=metric_generator,
        recompute=recompute,
    )
    if mha._qkv_same_embed_dim:
        w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    for dst, src in zip(layer._proj_weights(), (w_q, w_k, w_v)):
        dst.copy_(src)
    if mha.in_proj_bias is not None:
        assert layer.in_proj_bias is not None  # built with bias=True above
        layer.in_proj_bias.copy_(mha.in_proj_bias)
        layer.out_proj.bias.copy_(mha.out_proj.bias)
    layer.out_proj.weight.copy_(mha.out_proj.weight)
    if mha.bias_k is not None:
        # Both built with add_bias_kv=True above; MHA sets bias_k and bias_v together.
        assert layer.bias_k is not None and layer.bias_v is not None and mha.bias_v is not None
        layer.bias_k.copy_(mha.bias_k)
        layer.bias_v.copy_(mha.bias_v)
    _carry_requires_grad(layer, mha)
    layer.train(mha.training)
    return layer


def _carry_requires_grad(layer: DamchaAttention, mha: nn.MultiheadAttention) -> None:
    """Frozen stays frozen: each copied parameter keeps the ``requires_grad`` of
    the MHA parameter it was copied from (a model frozen before conversion
    would otherwise train its attention projections again). Both layers pack
    q/k/v in one ``in_proj_weight`` exactly when the sizes allow, so the names
    match one to one. The new DAMCHA parameters (gates, generators) are trainable."""
    for dst_module, src_module in ((layer, mha), (layer.out_proj, mha.out_proj)):
        for name, src in src_module._parameters.items():
            dst = dst_module._parameters.get(name)
            if dst is not None and src is not None:
                dst.requires_grad_(src.requires_grad)


def replace_mha(model: nn.Module, **kwargs: Any) -> nn.Module:
    """Swap every ``nn.MultiheadAttention`` inside ``model`` for ``DamchaAttention.from_mha``.

    In place; returns ``model``. Outputs are unchanged (gates start at 0). A
    module instance used in several places stays shared. ``kwargs`` go to
    ``from_mha`` (metric, coupling, ...).

    A subclass of ``nn.MultiheadAttention`` with its own ``forward`` (e.g.
    ``torch.ao.nn.quantizable.MultiheadAttention``, or a user class that
    rescales the output) cannot be converted exactly: ``replace_mha`` raises a
    ``DamchaValueError`` naming its module path and class, and replaces nothing
    (skipping it would leave plain attention that the caller believes is
    DAMCHA). Subclasses that keep MHA's ``forward`` are converted. An instance
    whose ``forward`` a wrapper replaced (accelerate's dispatch hooks, a
    monkeypatch) is refused the same way: the new layer would drop the wrapper.

    Hooks registered on a converted layer (forward, pre-forward, backward,
    state-dict) are moved to its replacement: they run on the DAMCHA layer,
    and the handles ``register_*_hook`` returned still remove them. So is its
    ``out_proj`` module, with whatever hooks or weight tools it carries. A
    layer whose own projection weights or biases a weight tool (parametrize,
    prune, weight_norm, spectral_norm) holds is refused, naming them: remove
    the tool, convert, then apply it to the DamchaAttention (same names).

    An ``nn.TransformerEncoderLayer`` (the class itself, not a subclass) whose
    ``self_attn`` is converted becomes a ``DamchaTransformerEncoderLayer``
    (same modules, parameters and outputs): in inference torch runs the MHA
    layer as one native kernel, which a DAMCHA layer cannot use, and the class
    keeps the feed-forward's memory to that kernel's by running its ReLU or
    GELU in place when no gradient is recorded.
    """
    if not isinstance(model, nn.Module):
        raise DamchaTypeError(invalid_argument("model", "a torch.nn.Module", f"model={describe(model)}"))
    if isinstance(model, nn.MultiheadAttention):
        raise DamchaValueError(
            invalid_argument(
                "model",
                "a model that contains nn.MultiheadAttention layers; it is itself one (use DamchaAttention.from_mha(model))",
                f"model={describe(model)}",
            )
        )
    unknown = sorted(set(kwargs) - set(_FROM_MHA_KEYS))
    if unknown:
        raise DamchaTypeError(
            unknown_fields(unknown, _FROM_MHA_KEYS, "the arguments replace_mha passes to from_mha", "keyword argument")
        )
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            check_replaceable(module, f"model.{path}")
    done = build_replacements(model, kwargs)
    install_replacements(model, done)
    if not done:
        # Most likely the wrong model (or one converted already): training it
        # would silently train plain attention, not DAMCHA.
        already = sum(isinstance(m, DamchaAttention) for m in model.modules())
        warnings.warn(
            f"replace_mha found no nn.MultiheadAttention in {type(model).__name__}: nothing was replaced"
            + (f" (it holds {already} DamchaAttention layers already)." if already else "."),
            UserWarning,
            stacklevel=2,
        )
    return model


def build_replacements(
    model: nn.Module, kwargs: Mapping[str, Any], overrides: Mapping[int, Mapping[str, Any]] | None = None
) -> dict[int, DamchaAttention]:
    """``id(mha)`` -> its ``DamchaAttention.from_mha``, for every ``nn.MultiheadAttention``
    of ``model`` (a shared instance once), all built before any is installed: a
    layer that cannot be converted (a coupling its sizes do not allow, a shared
    generator of other sizes) leaves the model as it was, and the error names
    the layer's path. ``overrides``: ``id(mha)`` -> arguments of its own."""
    done: dict[int, DamchaAttention] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and id(module) not in done:
            try:
                own = {**kwargs, **(overrides or {}).get(id(module), {})}
                done[id(module)] = DamchaAttention.from_mha(module, **own)
            except (DamchaValueError, DamchaTypeError) as exc:
                # Named at the end: the message keeps its "Invalid argument `x`: ..." form.
                raise type(exc)(f"{exc} (in layer `{path}`, an nn.MultiheadAttention)") from None
    return done


def install_replacements(model: nn.Module, done: Mapping[int, DamchaAttention]) -> None:
    """Put each layer of ``build_replacements`` in its MHA's place(s), with the MHA's
    hooks and ``out_proj`` module, and adapt the torch containers that held them."""
    carried: set[int] = set()

    def visit(parent: nn.Module) -> None:
        # _modules, not named_children(): that lists a module once per parent, so a second name
        # for one MHA in the same parent (ModuleList([mha] * k)) was left unconverted.
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if isinstance(child, nn.MultiheadAttention) and id(child) in done:
                layer = done[id(child)]
                if id(child) not in carried:
                    carried.add(id(child))
                    _carry_hooks(child, layer)
                    # The module itself, not from_mha's copy of its values: its
                    # hooks, parametrizations or pruning stay in force.
                    layer.out_proj = child.out_proj
                setattr(parent, name, layer)
            else:
                visit(child)

    visit(model)
    if done:
        for module in model.modules():
            # nn.TransformerEncoder decided at construction, while it still held
            # nn.MultiheadAttention, that it may pack padded batches into nested
            # tensors under no_grad; DamchaAttention takes dense tensors only.
            if isinstance(module, nn.TransformerEncoder):
                module.use_nested_tensor = False
            # A plain encoder layer that now holds DAMCHA is what build_encoder builds:
            # its class runs the feed-forward's activation in place in inference, as
            # torch's native kernel did for the MHA layer (a subclass keeps its class).
            if type(module) is nn.TransformerEncoderLayer and isinstance(module.self_attn, DamchaAttention):
                module.__class__ = DamchaTransformerEncoderLayer
