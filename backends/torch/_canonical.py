"""Canonical parameter I/O of the torch layer: ``to_canonical``,
``load_canonical``, ``from_canonical``, ``save``, ``load``, ``canonical_grads``.

The layer keeps nn.MultiheadAttention's parameter layout (so ``from_mha``
is a copy and MHA checkpoints load); ``canonical_views`` is the one map
between that layout and damcha_core's names and shapes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

import numpy as np
import torch
from torch import Tensor

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe

from ._generator import TORCH_LEAVES

if TYPE_CHECKING:  # pragma: no cover
    from ._layer import DamchaAttention

__all__ = ["CanonicalIO", "canonical_views"]

_Layer = TypeVar("_Layer", bound="CanonicalIO")


def canonical_views(config: DamchaConfig, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Canonical name -> view, from a layer's module name -> tensor (its
    parameters, or their gradients). Views share storage: writing into one
    writes the parameter."""
    E, Ekv, Eo = config.query_dim, config.context_dim, config.output_dim
    H, G, d, dv = config.num_heads, config.num_kv_heads, config.key_dim, config.value_dim
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
        out.update({"query.bias": bq.view(H, d), "key.bias": bk.view(G, d), "value.bias": bv.view(G, dv),
                    "output.bias": tensors["out_proj.bias"]})
    for side in config.metric_sides:
        dims = (config.side_heads(side), d, config.metric_rank or 0, config.side_features(side))
        out[f"metric.{side}.gate"] = tensors[f"metric_gates.{side}"]
        for leaf, layout in TORCH_LEAVES[config.metric].items():
            out[f"metric.{side}.{leaf}"] = layout.to_canonical(tensors[f"metric_generators.{side}.{layout.attribute}"], dims)
    return {name: out[name] for name in config.param_shapes()}


def _numpy(t: Tensor) -> np.ndarray:
    # detach() first: .numpy() refuses tensors that require grad. Every torch
    # float widens to float64 exactly.
    return t.detach().to("cpu", torch.float64).numpy().copy()


class CanonicalIO:
    """The canonical I/O protocol (DECISIONS 4) for a module with ``config``
    and nn.MultiheadAttention-named parameters; mixed into ``DamchaAttention``."""

    config: DamchaConfig

    def _canonical_views(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return canonical_views(self.config, tensors)

    def to_canonical(self) -> dict[str, np.ndarray]:
        """Canonical float64 NumPy params (exact: every torch float widens losslessly)."""
        params = dict(self.named_parameters(remove_duplicate=False))  # type: ignore[attr-defined]
        return {n: _numpy(t) for n, t in self._canonical_views(params).items()}

    def canonical_grads(self) -> dict[str, np.ndarray]:
        """``.grad`` of every parameter in canonical names/layout (zeros where unset)."""
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                 for n, p in self.named_parameters(remove_duplicate=False)}  # type: ignore[attr-defined]
        return {n: _numpy(t) for n, t in self._canonical_views(grads).items()}

    @torch.no_grad()
    def load_canonical(self: _Layer, params: Mapping[str, Any]) -> _Layer:
        """Copy canonical params (validated against ``self.config``, finite) into this layer; returns self."""
        checked = dc.validate_params(params, self.config)
        targets = self._canonical_views(dict(self.named_parameters(remove_duplicate=False)))  # type: ignore[attr-defined]
        for name, value in checked.items():
            target = targets[name]
            # The views share storage with the parameters, so copy_ writes through.
            target.copy_(torch.from_numpy(value).to(target.dtype).reshape(target.shape))
        return self

    @classmethod
    def from_canonical(cls, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> Any:
        """A layer with ``config`` whose parameters are the canonical ``params``.

        Keyword arguments are the constructor's that a config does not hold:
        ``batch_first``, ``device``, ``dtype``, ``metric_generator``, ``recompute``.
        """
        if not isinstance(config, DamchaConfig):
            raise DamchaTypeError(f"`config` must be a DamchaConfig. Received: config={describe(config)}")
        layer = cls._from_config(config, **kwargs)  # type: ignore[attr-defined]
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
