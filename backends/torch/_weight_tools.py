"""Initialising a parameter that one of torch's weight tools has taken over."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize


def write_initial(module: nn.Module, name: str, value: Tensor) -> None:
    """Make ``value`` the initial value of ``module.<name>``, also under a weight tool.

    Parametrized: assigned through the parametrizations' ``right_inverse``
    (weight_norm splits it into norm and direction), or, where one of them has
    none, written into the original, as registering it would have done.
    Pruning and the old spectral_norm train ``<name>_orig``, the old
    weight_norm ``<name>_g`` and ``<name>_v``; their forward pre-hook is run
    once so that the attribute shows the new effective weight at once.
    Called under ``torch.no_grad()``.
    """
    if parametrize.is_parametrized(module, name):
        chain: parametrize.ParametrizationList = module.get_submodule(f"parametrizations.{name}")  # type: ignore[assignment]
        if all(hasattr(p, "right_inverse") for p in chain):
            setattr(module, name, value)
        else:
            chain.original.copy_(value)
        return
    params = module._parameters
    hooks = [
        h
        for h in module._forward_pre_hooks.values()
        if name in (getattr(h, "name", None), getattr(h, "_tensor_name", None))
    ]
    orig, v, g = params.get(name + "_orig"), params.get(name + "_v"), params.get(name + "_g")
    if orig is not None:
        orig.copy_(value)
    elif v is not None and g is not None:
        dim = next(h.dim for h in hooks if hasattr(h, "dim"))
        v.copy_(value)
        g.copy_(torch.norm_except_dim(value, 2, dim))
    else:
        own = params[name]
        assert own is not None  # every name this layer resets is registered unless a tool took it
        own.copy_(value)
        return
    for hook in hooks:
        hook(module, ())
