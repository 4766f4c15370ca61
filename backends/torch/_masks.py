"""The masks of a ``DamchaAttention`` call: their checks and how they are merged.

At the boundary masks follow ``nn.MultiheadAttention``'s convention: bool
True = masked out, or an additive float mask (-inf = masked out), as a
``key_padding_mask`` (B, M) and an ``attn_mask`` (N, M), (B*H, N, M) or
(B|1, H|1, N|1, M). ``merge_masks`` makes them one mask for the functional
core: bool True = may attend (the reference's convention) when every mask is
bool, else one additive float mask.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import damcha_core as dc
import torch
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe
from torch import Tensor

from ._functional import check_mask_values


def check_torch_mask(name: str, value: Any) -> None:
    if not isinstance(value, Tensor) or not (value.dtype == torch.bool or value.is_floating_point()):
        # torch's convention, not the reference's: the error says which one applies here.
        raise DamchaTypeError(
            dc.invalid_argument(
                name,
                "a bool tensor (True = masked out, as in nn.MultiheadAttention) or a float additive mask "
                "(-inf = masked out)",
                f"{name}={describe(value)}",
            )
        )


def _check_device(name: str, mask: Tensor, device: torch.device | None) -> None:
    """A mask that applies is on the inputs' device (torch's own error names neither)."""
    if device is not None and mask.device != device:
        raise DamchaValueError(
            dc.invalid_argument(name, f"a tensor on the inputs' device ({device})", f"{name}.device={mask.device}")
        )


def as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool *visible* mask (True = may attend) as an additive float mask."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def merge_masks(
    config: DamchaConfig,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    B: int,
    N: int,
    M: int,
    dtype: torch.dtype,
    *,
    names: Mapping[str, str],
    causal_hint: bool = False,
    device: torch.device | None = None,
) -> Tensor | None:
    """One mask broadcastable to (B, H, N, M): bool True = may attend, or additive float.

    ``names``: the forward's argument names, for ``dc.check_shapes``'s errors.
    ``causal_hint``: ``is_causal`` was passed. A validated 2-D (N, M)
    ``attn_mask`` is then taken to be the causal mask, as
    nn.MultiheadAttention takes it, and left out (the caller applies the
    causal rule, SDPA's fused causal kernel where it can). Only its shape
    is checked, never its values: no device sync, and eager, compiled and
    exported calls agree. A mask of any other shape (per batch, per head)
    carries more than the causal rule and still applies. ``device``: the
    inputs' device, where a mask that applies must be (the hint's is not read).
    """
    H = config.num_heads
    masks: list[Tensor] = []
    if key_padding_mask is not None:
        check_torch_mask("key_padding_mask", key_padding_mask)
        if tuple(key_padding_mask.shape) != (B, M):
            raise DamchaValueError(
                dc.invalid_argument(
                    "key_padding_mask",
                    f"shape (B, M) = {(B, M)}",
                    f"key_padding_mask.shape={tuple(key_padding_mask.shape)}",
                )
            )
        _check_device("key_padding_mask", key_padding_mask, device)
        check_mask_values("key_padding_mask", key_padding_mask)
        masks.append(key_padding_mask[:, None, None, :])
    if attn_mask is not None:
        check_torch_mask("attn_mask", attn_mask)
        if key_padding_mask is not None and key_padding_mask.dtype != attn_mask.dtype:
            # Where nn.MultiheadAttention warns (both still apply); the message starts with
            # MHA's whole message, so a warning filter written for MHA's matches it too.
            warnings.warn(
                "Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both "
                "instead. (nn.MultiheadAttention's deprecation, which DamchaAttention follows.) Received: "
                f"key_padding_mask.dtype={key_padding_mask.dtype}, attn_mask.dtype={attn_mask.dtype}",
                UserWarning,
                stacklevel=3,  # the caller of the layer's forward, as before
            )
        if attn_mask.dim() == 3:
            # nn.MultiheadAttention's (B*H, N, M) layout, batch-major.
            if tuple(attn_mask.shape) != (B * H, N, M):
                raise DamchaValueError(
                    dc.invalid_argument(
                        "attn_mask",
                        f"shape (B*H, N, M) = {(B * H, N, M)} for a 3-D mask",
                        f"attn_mask.shape={tuple(attn_mask.shape)}",
                    )
                )
            attn_mask = attn_mask.view(B, H, N, M)
        else:
            Ekv, Ev = dc.config_sizes(config)[:2]
            try:
                dc.check_shapes(
                    config,
                    (B, N, config.query_dim),
                    (B, M, Ekv),
                    tuple(attn_mask.shape),
                    value_shape=(B, M, Ev),
                    names=names,
                )
            except DamchaValueError as exc:
                # The rule's message, with nn.MultiheadAttention's third layout among the expected ones.
                raise DamchaValueError(
                    str(exc).replace(". Received:", " (or (B*H, N, M) as in nn.MultiheadAttention). Received:", 1)
                ) from None
        if not (causal_hint and attn_mask.dim() == 2 and tuple(attn_mask.shape) == (N, M)):
            # The hint's mask is never read, so only a mask that applies has its values checked.
            _check_device("attn_mask", attn_mask, device)
            check_mask_values("attn_mask", attn_mask)
            masks.append(attn_mask)
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        visible = ~masks[0]
        for m in masks[1:]:
            visible = visible & ~m
        return visible
    out = None
    for m in masks:
        add = as_additive(~m, dtype) if m.dtype == torch.bool else m.to(dtype)
        out = add if out is None else out + add
    return out
