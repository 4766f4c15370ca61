"""Canonical parameter I/O of the torch layer: ``to_canonical``,
``load_canonical``, ``from_canonical``, ``save``, ``load``, ``canonical_grads``.

The layer keeps nn.MultiheadAttention's parameter layout (so ``from_mha``
is a copy and MHA checkpoints load); ``canonical_views`` is the one map
between that layout and damcha_core's names and shapes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import numpy as np

import damcha_core as dc
import torch
from damcha_core import DamchaConfig, DamchaValueError, config_sizes, describe
from torch import Tensor
from torch.nn.utils import parametrize

from ._generator import TORCH_LEAVES, generator_shapes
from ._weight_tools import write_initial

if TYPE_CHECKING:  # pragma: no cover
    from ._layer import DamchaAttention

__all__ = ["CanonicalIO", "canonical_views"]

_Layer = TypeVar("_Layer", bound="CanonicalIO")


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


def effective_tensors(module: torch.nn.Module, config: DamchaConfig) -> dict[str, Tensor]:
    """Name -> the tensor the forward uses: the parameter, or under a weight tool (parametrize,
    prune, the old weight_norm/spectral_norm) its effective weight, which the module's attribute
    shows (its parameters are then the tool's: ``*_orig``, ``parametrizations.*.original``)."""
    return {name: getattr(*_owner(module, name)) for name in _torch_names(module, config)}


def _plain_parameter(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str, torch.nn.Parameter | None]:
    """``(owner, attribute, parameter)`` of ``name``; the parameter is None under a weight tool."""
    owner, attribute = _owner(module, name)
    plain = owner._parameters.get(attribute)
    return owner, attribute, (None if parametrize.is_parametrized(owner, attribute) else plain)


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
        uses (as ``from_mha`` reads them)."""
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
            DamchaValueError: bad params, a value past a float16/bfloat16 parameter's range, or a
                layer on the meta device (which holds no storage to copy into).
        """
        checked = dc.validate_params(params, self.config)
        module = cast(torch.nn.Module, self)
        effective = effective_tensors(module, self.config)
        for t in effective.values():
            if t.is_meta:  # copy_ into a meta tensor does nothing, silently
                raise _meta_error(t)
        # The new values in the torch layout: a copy of each effective tensor, written through views.
        staged = {n: t.detach().clone() for n, t in effective.items()}
        targets = self._canonical_views(staged)
        for name, value in checked.items():  # all checked before any is copied
            dc.check_params_fit({name: value}, *_fit(targets[name].dtype))
        for name, value in checked.items():
            target = targets[name]
            target.copy_(torch.from_numpy(value).to(target.dtype).reshape(target.shape))
        for name, new in staged.items():
            owner, attribute, plain = _plain_parameter(module, name)
            if plain is not None:
                plain.copy_(new)
            else:
                write_initial(owner, attribute, new)
        return self

    @classmethod
    def from_canonical(cls, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> Any:
        """A layer with ``config`` whose parameters are the canonical ``params``.

        Keyword arguments are the constructor's that a config does not hold:
        ``batch_first``, ``device``, ``dtype``, ``metric_generator``, ``recompute``.
        """
        dc.check_config(config)
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


def encoder_config(encoder: Any, *, causal: bool = False) -> dc.EncoderConfig:
    """The ``damcha_core.EncoderConfig`` a ``DamchaTransformerEncoder`` computes,
    or a DamchaValueError listing what does not fit the stack format."""
    from torch import nn

    causal = dc.check_bool("causal", causal)
    layers = list(encoder.layers)
    first = layers[0]
    eps, act = first.norm1.eps, _activation_name(first.activation)
    problems = []
    if encoder.norm is not None and (not isinstance(encoder.norm, nn.LayerNorm) or encoder.norm.eps != eps):
        problems.append("no final norm, or a final LayerNorm with the layers' epsilon")
    for i, layer in enumerate(layers):
        name = _activation_name(layer.activation)
        if name is None:
            problems.append(
                f"ReLU or GELU (layer {i} has activation={getattr(layer.activation, '__name__', layer.activation)})"
            )
        elif name != act or layer.norm_first != first.norm_first:
            problems.append(f"one activation and norm placement (layer {i} differs)")
        if layer.linear1.bias is None or layer.norm1.bias is None:
            problems.append(f"biases in the feed-forward and norms (layer {i} has bias=False)")
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


def _block_tensors(layer: Any) -> dict[str, Tensor]:
    """Stack names of one block's norm and feed-forward tensors -> views of its parameters."""
    return {
        "norm1.scale": layer.norm1.weight,
        "norm1.bias": layer.norm1.bias,
        "norm2.scale": layer.norm2.weight,
        "norm2.bias": layer.norm2.bias,
        "ffn.in.kernel": layer.linear1.weight.T,
        "ffn.in.bias": layer.linear1.bias,
        "ffn.out.kernel": layer.linear2.weight.T,
        "ffn.out.bias": layer.linear2.bias,
    }


def encoder_to_canonical(encoder: Any, *, causal: bool = False) -> tuple[dict[str, np.ndarray], dc.EncoderConfig]:
    """``(params, EncoderConfig)`` of an encoder stack in damcha_core's stack format."""
    config = encoder_config(encoder, causal=causal)
    shapes = config.param_shapes()
    params: dict[str, np.ndarray] = {}
    for i, layer in enumerate(encoder.layers):
        for key, value in layer.self_attn.to_canonical().items():
            name = f"layers.{i}.attention.{key}"
            if name in shapes:
                params[name] = value
            else:  # a generator the stack shares: stored once, under "shared." (damcha_core's stack format)
                params.setdefault(f"shared.{key}", value)
        params.update({f"layers.{i}.{key}": _numpy(t) for key, t in _block_tensors(layer).items()})
    if encoder.norm is not None:
        params["final_norm.scale"], params["final_norm.bias"] = _numpy(encoder.norm.weight), _numpy(encoder.norm.bias)
    return {name: params[name] for name in shapes}, config  # the core's order: files and diffs agree


def _fit(dtype: torch.dtype) -> tuple[str, float]:
    """``check_params_fit``'s dtype name and largest finite value for a torch dtype."""
    return str(dtype).removeprefix("torch."), float(torch.finfo(dtype).max)


@torch.no_grad()
def encoder_load_canonical(encoder: Any, params: Mapping[str, Any]) -> Any:
    """Copy stack params (validated, finite) into ``encoder``; returns it."""
    config = encoder_config(encoder)
    checked = dc.validate_stack_params(params, config)
    # Every tensor is checked against its target dtype before anything is copied: a
    # refusal must not leave the first layers loaded and the rest as they were.
    targets: dict[str, torch.dtype] = {}
    for i, layer in enumerate(encoder.layers):
        views = layer.self_attn._canonical_views(effective_tensors(layer.self_attn, layer.self_attn.config))
        for key, value in config.layer_params(checked, i).items():
            name = f"layers.{i}.attention.{key}"
            name = name if name in checked else f"shared.{key}"  # the stack's one generator
            dc.check_params_fit({name: value}, *_fit(views[key].dtype))
        targets.update({f"layers.{i}.{key}": t.dtype for key, t in _block_tensors(layer).items()})
    if encoder.norm is not None:
        targets.update({"final_norm.scale": encoder.norm.weight.dtype, "final_norm.bias": encoder.norm.bias.dtype})
    for name, dtype in targets.items():
        dc.check_params_fit({name: checked[name]}, *_fit(dtype))
    for i, layer in enumerate(encoder.layers):
        layer.self_attn.load_canonical(config.layer_params(checked, i))
        for key, target in _block_tensors(layer).items():
            target.copy_(torch.from_numpy(checked[f"layers.{i}.{key}"]).to(target.dtype))
    if encoder.norm is not None:
        encoder.norm.weight.copy_(torch.from_numpy(checked["final_norm.scale"]).to(encoder.norm.weight.dtype))
        encoder.norm.bias.copy_(torch.from_numpy(checked["final_norm.bias"]).to(encoder.norm.bias.dtype))
    return encoder
