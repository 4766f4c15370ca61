"""Initialising a parameter that one of torch's weight tools has taken over."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize


def write_initial(module: nn.Module, name: str, value: Tensor) -> None:
    """Make ``value`` the initial value of ``module.<name>``, also under a weight tool.

    Parametrized: the original(s) get what registering the parametrizations
    on a fresh weight leaves there: the first one's ``right_inverse`` of
    ``value`` (weight_norm splits it into norm and direction), ``value``
    itself where it has none; parametrizations registered after the first
    leave the original alone, as in ``register_parametrization``.
    Pruning and the old spectral_norm train ``<name>_orig``, the old
    weight_norm ``<name>_g`` and ``<name>_v``; their forward pre-hook is run
    once so that the attribute shows the new effective weight at once.
    Called under ``torch.no_grad()``.
    """
    if parametrize.is_parametrized(module, name):
        chain: parametrize.ParametrizationList = module.get_submodule(f"parametrizations.{name}")  # type: ignore[assignment]
        # What registering the chain on a fresh weight leaves in the original:
        # the first parametrization's right_inverse of it (the value itself
        # without one); parametrizations registered later never touch it.
        first: Any = chain[0]
        stored = value
        if hasattr(first, "right_inverse"):
            with contextlib.suppress(NotImplementedError):  # as ParametrizationList takes it at registration
                stored = first.right_inverse(value)
        if isinstance(stored, (tuple, list)):
            for i, part in enumerate(stored):
                getattr(chain, f"original{i}").copy_(part)
        else:
            chain.original.copy_(stored)
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
