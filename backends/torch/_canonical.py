"""Canonical parameter I/O of the torch layer: ``to_canonical``,
``load_canonical``, ``from_canonical``, ``save``, ``load``, ``canonical_grads``.

The layer keeps nn.MultiheadAttention's parameter layout (so ``from_mha``
is a copy and MHA checkpoints load); ``canonical_views`` is the one map
between that layout and damcha_core's names and shapes.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import numpy as np

import damcha_core as dc
import torch
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, config_sizes, describe
from damcha_core._params import check_no_config_kwargs
from damcha_core._validators import unknown_fields
from torch import Tensor
from torch.nn.utils import parametrize

from . import _functional as fn
from ._generator import TORCH_LEAVES, generator_shapes
from ._weight_tools import write_initial

if TYPE_CHECKING:  # pragma: no cover
    from ._layer import DamchaAttention

__all__ = ["CanonicalIO", "canonical_views"]

_Layer = TypeVar("_Layer", bound="CanonicalIO")

# The constructor's arguments that a DamchaConfig sets (``_from_config`` passes them).
_CONFIG_KWARGS = (
    "embed_dim",
    "num_heads",
    "dropout",
    "bias",
    "kdim",
    "vdim",
    "key_dim",
    "value_dim",
    "num_kv_heads",
    "output_dim",
    "metric",
    "metric_rank",
    "coupling",
    "scale",
)


def canonical_views(config: DamchaConfig, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Canonical name -> view, from a layer's module name -> tensor (its
    parameters, or their gradients). Views share storage: writing into one
    writes the parameter."""
    E, H, d = config.query_dim, config.num_heads, config.key_dim
    Ekv, _, Eo, G, dv = config_sizes(config)
    sizes = (H * d, G * d, G * dv)
    if "in_proj_weight" in tensors:
        Wq, Wk, Wv = tensors["in_proj_weight"].split(sizes)
    else:
        Wq, Wk, Wv = tensors["q_proj_weight"], tensors["k_proj_weight"], tensors["v_proj_weight"]
    out = {
        "query.kernel": Wq.T.reshape(E, H, d),
        "key.kernel": Wk.T.reshape(Ekv, G, d),
        "value.kernel": Wv.T.reshape(Wv.shape[1], G, dv),
        "output.kernel": tensors["out_proj.weight"].T.reshape(H, dv, Eo),
    }
    if config.use_bias:
        bq, bk, bv = tensors["in_proj_bias"].split(sizes)
        out.update(
            {
                "query.bias": bq.view(H, d),
                "key.bias": bk.view(G, d),
                "value.bias": bv.view(G, dv),
                "output.bias": tensors["out_proj.bias"],
            }
        )
    for side in config.metric_sides:
        out[f"metric.{side}.gate"] = tensors[f"metric_gates.{side}"]
        shapes = generator_shapes(
            config.metric, config.side_features(side), config.side_heads(side), d, config.metric_rank
        )
        for leaf, layout in TORCH_LEAVES[config.metric].items():
            t = tensors[f"metric_generators.{side}.{layout.attribute}"]
            out[f"metric.{side}.{leaf}"] = layout.to_canonical(t, shapes[leaf])
    return {name: out[name] for name in config.param_shapes()}


def _meta_error(t: Tensor) -> DamchaValueError:
    return DamchaValueError(
        "The parameters are on the meta device and hold no values; materialise them first "
        "(module.to_empty(device=...) and load or initialise). Received: a tensor on device 'meta' "
        f"of shape {tuple(t.shape)}"
    )


def _numpy(t: Tensor) -> np.ndarray:
    # detach() first: .numpy() refuses tensors that require grad. Every torch
    # float widens to float64 exactly.
    if t.is_meta:
        raise _meta_error(t)
    return t.detach().to("cpu", torch.float64).numpy().copy()


def _torch_names(module: torch.nn.Module, config: DamchaConfig) -> list[str]:
    """The nn.MultiheadAttention-style names ``canonical_views`` reads for ``config``."""
    packed = getattr(module, "in_proj_weight", None) is not None
    names = ["in_proj_weight"] if packed else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    names.append("out_proj.weight")
    if config.use_bias:
        names += ["in_proj_bias", "out_proj.bias"]
    for side in config.metric_sides:
        names.append(f"metric_gates.{side}")
        names += [f"metric_generators.{side}.{layout.attribute}" for layout in TORCH_LEAVES[config.metric].values()]
    return names


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attribute


# ---------------------------------------------------------------- PEFT


def _is_peft(module: torch.nn.Module) -> bool:
    """A module of PEFT's in the place of the layer's own: a tuner layer (LoRA's ``Linear``, ...)
    or a ``modules_to_save`` wrapper. Its ``weight`` attribute reads the base layer's (the
    original module's), not what its forward computes with."""
    return type(module).__module__.partition(".")[0] == "peft"


def _is_lora_linear(module: torch.nn.Module) -> bool:
    """PEFT's LoRA ``Linear``, whose forward is the base layer's output plus, for each active adapter,
    ``lora_B(lora_A(x)) * scaling`` (its subclasses, such as the quantized bitsandbytes ones, excluded)."""
    forward = getattr(type(module), "forward", None)
    return (getattr(forward, "__module__", None), getattr(forward, "__qualname__", None)) == (
        "peft.tuners.lora.layer",
        "Linear.forward",
    )


def _peft_refusal(path: str, module: torch.nn.Module, expected: str) -> DamchaValueError:
    return DamchaValueError(
        dc.invalid_argument(
            path,
            f"{expected}; call merge_and_unload() on the PEFT model first (it writes into the base weights "
            "what the forward uses)",
            f"{path}={describe(module)}",
        )
    )


def _unreadable(path: str, module: torch.nn.Module, why: str) -> DamchaValueError:
    return _peft_refusal(
        path,
        module,
        f"a module whose effective weight canonical I/O can read (a PEFT LoRA Linear without variants); "
        f"{describe(type(module))}: {why}",
    )


def _lora_adapters(module: torch.nn.Module, path: str) -> list[str]:
    """The adapters whose update ``module`` (a PEFT LoRA layer) adds to its base layer's output in its
    forward (none when merged, the update then being in the base weight, or disabled); refused where
    the effective weight is not base + sum of B @ A * scaling."""
    if not _is_lora_linear(module):
        raise _unreadable(path, module, "this PEFT module's weight attribute is not the weight its forward uses")
    lora: Any = module
    if lora.merged:
        if lora.disable_adapters:  # its forward unmerges first: the base weight holds an update it will not use
            raise _unreadable(path, module, "its adapters are merged and disabled (its forward unmerges them)")
        return []
    if lora.disable_adapters:
        return []
    adapters = [a for a in lora.active_adapters if a in lora.lora_A]
    variants = [a for a in adapters if a in getattr(lora, "lora_variant", {}) or getattr(lora, "use_dora", {}).get(a)]
    if variants:
        raise _unreadable(path, module, f"adapter {variants[0]!r} is a LoRA variant (DoRA, ...)")
    return adapters


def _lora_effective(module: torch.nn.Module, attribute: str, path: str) -> Tensor | None:
    """The ``weight`` or ``bias`` that a PEFT LoRA layer's forward computes with: its base layer's
    (under a weight tool its effective one) plus each active adapter's update, in float64."""
    lora: Any = module
    adapters = _lora_adapters(module, path)
    base = lora.get_base_layer()
    value = getattr(base, attribute)
    biased = [a for a in adapters if getattr(lora, "lora_bias", {}).get(a)]  # lora_bias: B has a bias too
    if attribute == "weight":
        if biased and getattr(base, "bias", None) is None:
            raise _unreadable(path, module, f"adapter {biased[0]!r} adds a bias (lora_bias) to a layer without one")
        updates = [lora.lora_B[a].weight.double() @ lora.lora_A[a].weight.double() * lora.scaling[a] for a in adapters]
    else:
        updates = [lora.lora_B[a].bias.double() * lora.scaling[a] for a in biased]
    if not updates or value is None:
        return value
    return value.double() + sum(updates)


def _effective(module: torch.nn.Module, name: str, where: str = "") -> Any:
    """The tensor the forward uses for ``module``'s ``name`` (``out_proj.weight``): the parameter, its
    effective weight under a weight tool (the attribute shows it), or a PEFT LoRA layer's base weight
    plus its adapters' update. ``where`` prefixes module paths in errors."""
    owner, attribute = _owner(module, name)
    if _is_peft(owner):
        return _lora_effective(owner, attribute, where + name.rpartition(".")[0])
    return fn.tool_entry(owner, attribute, power_iteration=False)  # what the next forward uses


def effective_tensors(module: torch.nn.Module, config: DamchaConfig, where: str = "") -> dict[str, Tensor]:
    """Name -> the tensor the forward uses: the parameter, or under a weight tool (parametrize,
    prune, the old weight_norm/spectral_norm) its effective weight, which the module's attribute
    shows (its parameters are then the tool's: ``*_orig``, ``parametrizations.*.original``), or
    under PEFT LoRA the base weight plus the active adapters' update (float64)."""
    return {name: _effective(module, name, where) for name in _torch_names(module, config)}


def _check_writable(module: torch.nn.Module, names: Iterable[str], where: str = "") -> None:
    """Refuse a load into ``names`` before anything is written: a PEFT layer (its value is its base
    weight plus its adapters', which a load cannot split) or storage on the meta device."""
    for name in names:
        owner, attribute = _owner(module, name)
        if _is_peft(owner):
            raise _peft_refusal(
                where + name.rpartition(".")[0],
                owner,
                f"a module that load_canonical can write, not a PEFT layer ({describe(type(owner))} computes with "
                "its adapters as well as its base weight, which a load cannot split)",
            )
        t = getattr(owner, attribute)
        if t.is_meta:  # copy_ into a meta tensor does nothing, silently
            raise _meta_error(t)


def _plain_parameter(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str, torch.nn.Parameter | None]:
    """``(owner, attribute, parameter)`` of ``name``; the parameter is None under a weight tool."""
    owner, attribute = _owner(module, name)
    plain = owner._parameters.get(attribute)
    return owner, attribute, (None if parametrize.is_parametrized(owner, attribute) else plain)


def _write(module: torch.nn.Module, name: str, value: Tensor) -> None:
    """Write ``value`` (torch layout) as ``module``'s ``name``: into the parameter, or under a weight
    tool through it (``write_initial``), as ``reset_parameters`` writes. Under ``torch.no_grad()``."""
    owner, attribute, plain = _plain_parameter(module, name)
    if plain is not None:
        plain.copy_(value)
    else:
        write_initial(owner, attribute, value)


class CanonicalIO:
    """The canonical I/O protocol (DECISIONS 4) for a module with ``config``
    and nn.MultiheadAttention-named parameters; mixed into ``DamchaAttention``."""

    config: DamchaConfig

    if TYPE_CHECKING:
        # Given by the classes this is mixed into: nn.Module and the layer.
        def named_parameters(
            self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
        ) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

        _from_config: ClassVar[Callable[..., Any]]

    def _canonical_views(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if getattr(self, "bias_k", None) is not None or getattr(self, "add_zero_attn", False):
            # Refused rather than dropped: a file without bias_k would load as another layer.
            raise DamchaValueError(
                "A layer with add_bias_kv or add_zero_attn has no canonical form: damcha_core's format (v1) "
                "has no appended bias or zero key. Use the layer's state_dict. Received: "
                f"add_bias_kv={getattr(self, 'bias_k', None) is not None}, "
                f"add_zero_attn={getattr(self, 'add_zero_attn', False)}"
            )
        return canonical_views(self.config, tensors)

    def to_canonical(self) -> dict[str, np.ndarray]:
        """Canonical float64 NumPy params (exact: every torch float widens losslessly). Under a
        weight tool (parametrize, prune, weight_norm) the effective weights, the ones the forward
        uses (as ``from_mha`` reads them); under PEFT LoRA (``out_proj``) the base weight plus the
        active adapters' update, B @ A * scaling (a LoRA variant such as DoRA is refused by name)."""
        tensors = effective_tensors(cast(torch.nn.Module, self), self.config)
        return {n: _numpy(t) for n, t in self._canonical_views(tensors).items()}

    def canonical_grads(self) -> dict[str, np.ndarray]:
        """``.grad`` of every parameter in canonical names/layout (zeros where unset).

        Raises:
            DamchaValueError: a weight tool is on a canonical weight: the gradients are then the
                tool's parameters' (``*_orig``, ``original0``, ...), not the canonical weight's.
        """
        module = cast(torch.nn.Module, self)
        plain = {n: _plain_parameter(module, n)[2] for n in _torch_names(module, self.config)}
        tooled = [n for n, p in plain.items() if p is None]
        if tooled:
            raise DamchaValueError(
                "canonical_grads reads the canonical weights' .grad; a weight tool (parametrize, prune, "
                "weight_norm, spectral_norm) trains its own tensors instead, so the canonical weight has no "
                f"gradient of its own. Remove the tool first. Received: a tool on {', '.join(tooled)}"
            )
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in plain.items() if p is not None}
        return {n: _numpy(t) for n, t in self._canonical_views(grads).items()}

    @torch.no_grad()
    def load_canonical(self: _Layer, params: Mapping[str, Any]) -> _Layer:
        """Copy canonical params (validated against ``self.config``, finite) into this layer; returns self.

        Under a weight tool the value is written as ``reset_parameters`` writes it: through the
        parametrization's ``right_inverse``, into ``*_orig`` (pruning: the mask kept), ``*_g``/``*_v``;
        the tool then applies on top (a pruned entry reads 0, spectral_norm rescales), as it does to
        any weight written under it.

        Raises:
            DamchaValueError: bad params, a value past a float16/bfloat16 parameter's range, a
                layer on the meta device (which holds no storage to copy into), or a PEFT layer on a
                canonical weight (call ``merge_and_unload()`` first: a load cannot split a value
                into base weight and adapters).
        """
        checked = dc.validate_params(params, self.config)
        module = cast(torch.nn.Module, self)
        _check_writable(module, _torch_names(module, self.config))
        effective = effective_tensors(module, self.config)
        # The new values in the torch layout: a copy of each effective tensor, written through views.
        staged = {n: t.detach().clone() for n, t in effective.items()}
        targets = self._canonical_views(staged)
        for name, value in checked.items():  # all checked before any is copied
            dc.check_params_fit({name: value}, *_fit(targets[name].dtype))
        for name, value in checked.items():
            target = targets[name]
            target.copy_(torch.from_numpy(value).to(target.dtype).reshape(target.shape))
        for name, new in staged.items():
            _write(module, name, new)
        return self

    @classmethod
    def from_canonical(cls, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> Any:
        """A layer with ``config`` whose parameters are the canonical ``params``.

        Keyword arguments are the constructor's that a config does not hold:
        ``batch_first``, ``device``, ``dtype``, ``metric_generator``, ``recompute``; one the
        config sets (``num_heads``, ``metric``, ...) is a DamchaTypeError, as in the other ports.
        """
        dc.check_config(config)
        check_no_config_kwargs(kwargs, _CONFIG_KWARGS)
        accepted = [n for n in inspect.signature(cls._from_config).parameters if n != "config"]
        unknown = [n for n in kwargs if n not in accepted]
        if unknown:  # as Python's TypeError, naming from_canonical's own keywords (not _from_config's)
            raise DamchaTypeError(
                unknown_fields(
                    unknown, accepted, "the keywords from_canonical takes besides the config", "keyword argument"
                )
            )
        layer = cls._from_config(config, **kwargs)
        return layer.load_canonical(params)

    def save(self, path: str | os.PathLike) -> None:
        """Save canonical params and config as safetensors (``damcha_core.save_params``)."""
        dc.save_params(path, self.to_canonical(), self.config)

    @classmethod
    def load(cls, path: str | os.PathLike, **kwargs: Any) -> Any:
        """Load a file written by ``save`` (or any backend); kwargs go to ``from_canonical``."""
        params, config = dc.load_params(path)
        return cls.from_canonical(params, config, **kwargs)


def check_config_rebuilt(layer: DamchaAttention, config: DamchaConfig) -> None:
    if layer.config != config:  # the constructor resolves defaults exactly as DamchaConfig does
        raise DamchaValueError(f"internal: rebuilt config {layer.config} != {config}")


# ------------------------------------------------------------------ stacks


def _activation_name(fn: Any) -> str | None:
    from torch import nn
    from torch.nn import functional as F

    if fn is F.relu or isinstance(fn, nn.ReLU):
        return "relu"
    if fn is F.gelu:
        return "gelu"
    if isinstance(fn, nn.GELU):
        return "gelu" if fn.approximate == "none" else "gelu_tanh"
    return None


def _quantized(module: Any) -> bool:
    """A quantized module (torch.ao's dynamic or static ``Linear``): packed weights behind a method."""
    weight = getattr(module, "weight", None)
    return ".quantized" in type(module).__module__ or (callable(weight) and not isinstance(weight, Tensor))


def _missing(module: Any, attributes: tuple[str, ...]) -> list[str]:
    """The ``attributes`` of ``module`` that hold no tensor (``bias=False``, ``elementwise_affine=False``)."""
    return [a for a in attributes if not isinstance(getattr(module, a, None), Tensor)]


def encoder_config(encoder: Any, *, causal: bool = False) -> dc.EncoderConfig:
    """The ``damcha_core.EncoderConfig`` a ``DamchaTransformerEncoder`` computes,
    or a DamchaValueError listing what does not fit the stack format."""
    from torch import nn

    causal = dc.check_bool("causal", causal)
    layers = list(encoder.layers)
    norms = [(f"layers.{i}.{n}", getattr(layer, n)) for i, layer in enumerate(layers) for n in ("norm1", "norm2")]
    for path, module in norms + ([("norm", encoder.norm)] if encoder.norm is not None else []):
        # A PEFT wrapper on a norm (LN tuning): its forward uses the adapter's copy of the
        # norm, and it has none of the norm's attributes read below.
        if _is_peft(module):
            raise _peft_refusal(
                path,
                module,
                f"a LayerNorm, not a PEFT wrapper ({describe(type(module))} computes with its adapter's copy)",
            )
    first = layers[0]
    eps, act = first.norm1.eps, _activation_name(first.activation)
    problems = []
    if encoder.norm is not None:
        if not isinstance(encoder.norm, nn.LayerNorm) or encoder.norm.eps != eps:
            problems.append("no final norm, or a final LayerNorm with the layers' epsilon")
        elif missing := _missing(encoder.norm, ("weight", "bias")):
            problems.append(
                f"a final LayerNorm with a scale and a bias (norm has {', '.join(f'{a}=None' for a in missing)})"
            )
    for i, layer in enumerate(layers):
        name = _activation_name(layer.activation)
        if name is None:
            problems.append(
                f"ReLU or GELU (layer {i} has activation={getattr(layer.activation, '__name__', layer.activation)})"
            )
        elif name != act or layer.norm_first != first.norm_first:
            problems.append(f"one activation and norm placement (layer {i} differs)")
        missing = []
        for module in ("linear1", "linear2", "norm1", "norm2"):
            if module.startswith("linear") and _quantized(getattr(layer, module)):
                problems.append(
                    f"float feed-forward layers (quantized feed-forward layers.{i}.{module}, "
                    f"{describe(type(getattr(layer, module)))}: take canonical weights before quantizing)"
                )
                continue
            missing += [f"{module}.{a}=None" for a in _missing(getattr(layer, module), ("weight", "bias"))]
        if missing:
            problems.append(
                "a weight and a bias in every feed-forward layer and LayerNorm, as the format stores them "
                f"(layers.{i} has {', '.join(missing)})"
            )
        if layer.norm1.eps != eps or layer.norm2.eps != eps:
            problems.append(f"one LayerNorm epsilon (layer {i} differs)")
        if layer.self_attn.config != first.self_attn.config:
            problems.append(f"one attention config (layer {i} differs)")
    if problems:
        raise DamchaValueError(
            dc.invalid_argument(
                "encoder",
                "a stack that fits the stack format (damcha_core.EncoderConfig), with "
                + "; ".join(dict.fromkeys(problems)),
                f"encoder={describe(encoder)}",
            )
        )
    return dc.EncoderConfig(
        first.self_attn.config,
        num_layers=len(layers),
        ffn_dim=first.linear1.out_features,
        share_metric=encoder.share_metric,  # damcha_core's rule: shared.* whenever True, one layer too
        norm_eps=eps,
        causal=causal,
        norm_first=bool(first.norm_first),
        activation=act,  # type: ignore[arg-type]
        final_norm=encoder.norm is not None,
    )


# One block's norm and feed-forward tensors: stack name -> the torch name in the block. A kernel is
# the transpose of nn.Linear's (out, in) weight.
_BLOCK_NAMES = {
    "norm1.scale": "norm1.weight",
    "norm1.bias": "norm1.bias",
    "norm2.scale": "norm2.weight",
    "norm2.bias": "norm2.bias",
    "ffn.in.kernel": "linear1.weight",
    "ffn.in.bias": "linear1.bias",
    "ffn.out.kernel": "linear2.weight",
    "ffn.out.bias": "linear2.bias",
}


def _stack_tensors(encoder: Any) -> list[tuple[str, torch.nn.Module, str, str]]:
    """The stack's tensors other than the attention's: ``(stack name, module, its torch name, the
    module's path in the stack)``, in the stack's order (layer by layer, then the final norm)."""
    out = []
    for i, layer in enumerate(encoder.layers):
        out += [(f"layers.{i}.{key}", layer, name, f"layers.{i}.") for key, name in _BLOCK_NAMES.items()]
    if encoder.norm is not None:
        out += [("final_norm.scale", encoder, "norm.weight", ""), ("final_norm.bias", encoder, "norm.bias", "")]
    return out


def _stack_layout(name: str, t: Tensor) -> Tensor:
    """The canonical layout of a stack tensor from the torch one (and back: a transpose)."""
    return t.T if name.endswith(".kernel") else t


def encoder_to_canonical(encoder: Any, *, causal: bool = False) -> tuple[dict[str, np.ndarray], dc.EncoderConfig]:
    """``(params, EncoderConfig)`` of an encoder stack in damcha_core's stack format."""
    config = encoder_config(encoder, causal=causal)
    shapes = config.param_shapes()
    params: dict[str, np.ndarray] = {}
    for i, layer in enumerate(encoder.layers):
        attention = layer.self_attn
        tensors = effective_tensors(attention, attention.config, f"layers.{i}.self_attn.")
        for key, t in attention._canonical_views(tensors).items():
            name = f"layers.{i}.attention.{key}"
            if name in shapes:
                params[name] = _numpy(t)
            elif f"shared.{key}" not in params:  # a generator the stack shares: stored once (the stack format)
                params[f"shared.{key}"] = _numpy(t)
    for name, module, torch_name, where in _stack_tensors(encoder):
        params[name] = _numpy(_stack_layout(name, _effective(module, torch_name, where)))
    return {name: params[name] for name in shapes}, config  # the core's order: files and diffs agree


def _fit(dtype: torch.dtype) -> tuple[str, float]:
    """``check_params_fit``'s dtype name and largest finite value for a torch dtype."""
    return str(dtype).removeprefix("torch."), float(torch.finfo(dtype).max)


@torch.no_grad()
def encoder_load_canonical(encoder: Any, params: Mapping[str, Any]) -> Any:
    """Copy stack params (validated, finite) into ``encoder``; returns it. Written as the layer's
    ``load_canonical`` writes: under a weight tool through the tool (``write_initial``)."""
    config = encoder_config(encoder)
    checked = dc.validate_stack_params(params, config)
    # Everything is checked before anything is written (PEFT layers, the meta device, each value
    # against its target's dtype): a refusal must not leave the first layers loaded and the rest as they were.
    for i, layer in enumerate(encoder.layers):
        attention = layer.self_attn
        _check_writable(attention, _torch_names(attention, attention.config), f"layers.{i}.self_attn.")
        views = attention._canonical_views(effective_tensors(attention, attention.config))
        for key, value in config.layer_params(checked, i).items():
            name = f"layers.{i}.attention.{key}"
            name = name if name in checked else f"shared.{key}"  # the stack's one generator
            dc.check_params_fit({name: value}, *_fit(views[key].dtype))
    stack = _stack_tensors(encoder)
    for name, module, torch_name, where in stack:
        _check_writable(module, [torch_name], where)
        dc.check_params_fit({name: checked[name]}, *_fit(getattr(*_owner(module, torch_name)).dtype))
    for i, layer in enumerate(encoder.layers):
        layer.self_attn.load_canonical(config.layer_params(checked, i))
    for name, module, torch_name, _ in stack:
        target = getattr(*_owner(module, torch_name))
        new = torch.from_numpy(checked[name]).to(device=target.device, dtype=target.dtype)
        _write(module, torch_name, _stack_layout(name, new))
    return encoder
