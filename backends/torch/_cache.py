"""DamchaKVCache: the key/value cache for incremental decoding."""

from __future__ import annotations

from typing import Any

import torch
from damcha_core import DamchaTypeError, DamchaValueError, describe
from torch import Tensor

__all__ = ["DamchaKVCache"]


def _check_heads(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise DamchaTypeError(
            f"`{name}` must be a real floating tensor of heads (B, G, M, d). Received: {name}={describe(value)}"
        )
    if value.dim() != 4:
        raise DamchaValueError(f"`{name}` must have rank 4, (B, G, M, d). Received: {name}.shape={tuple(value.shape)}")
    return value


class DamchaKVCache:
    """Key/value cache for incremental decoding.

    It stores the *transformed* keys k~ = L_k(c) k (B, G, P, d) and the values
    (B, G, P, d_v) of the P tokens seen so far: the same size as an MHA cache,
    and the keys never need their map again. Pass one cache per layer as
    ``layer(x, x, x, is_causal=True, need_weights=False, kv_cache=cache)``;
    the layer appends the new tokens and attends over all of them, query i of
    the call sitting at position P + i (bottom-right causal alignment).
    """

    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.value: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.key is None else int(self.key.shape[2])

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Append key (B, G, M, d) and value (B, G, M, d_v); return the full cache.

        Everything is checked before anything is appended: a failed call
        leaves the cache as it was.
        """
        ck, cv = self.key, self.value
        if (
            ck is not None
            and cv is not None
            and type(key) is Tensor
            and type(value) is Tensor
            and key.dim() == 4
            and value.dim() == 4
            and key.shape[:2] == ck.shape[:2] == value.shape[:2]
            and key.shape[2] == value.shape[2]
            and key.shape[3] == ck.shape[3]
            and value.shape[3] == cv.shape[3]
            and key.dtype == ck.dtype == value.dtype
            and key.device == ck.device == value.device
        ):
            # What every decoding step passes: the checks below in one expression.
            self.key, self.value = torch.cat([ck, key], dim=2), torch.cat([cv, value], dim=2)
            return self.key, self.value
        key, value = _check_heads("key", key), _check_heads("value", value)
        if key.shape[:3] != value.shape[:3]:
            raise DamchaValueError(
                "`key` and `value` must have the same batch, head count and length (B, G, M). "
                f"Received: key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
            )
        if key.dtype != value.dtype or key.device != value.device:
            raise DamchaValueError(
                "`key` and `value` must have one dtype and device. "
                f"Received: key {key.dtype} on {key.device}, value {value.dtype} on {value.device}"
            )
        if self.key is None or self.value is None:
            self.key, self.value = key, value
            return key, value
        if (
            key.shape[:2] != self.key.shape[:2]
            or key.shape[3:] != self.key.shape[3:]
            or (value.shape[3:] != self.value.shape[3:])
        ):
            raise DamchaValueError(
                "`kv_cache` holds a different batch, head count or head size than this call "
                "(call kv_cache.reset() to start a new sequence). "
                f"Received: cached key shape {tuple(self.key.shape)}, new key shape {tuple(key.shape)}"
            )
        if key.dtype != self.key.dtype or key.device != self.key.device:
            # torch.cat would silently promote the dtype, or fail later in SDPA.
            raise DamchaValueError(
                "`kv_cache` holds keys of another dtype or device than this call "
                "(call kv_cache.reset() to start a new sequence). "
                f"Received: cached {self.key.dtype} on {self.key.device}, new {key.dtype} on {key.device}"
            )
        self.key = torch.cat([self.key, key], dim=2)
        self.value = torch.cat([self.value, value], dim=2)
        return self.key, self.value

    def _extend(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """``update`` for the flat decoding step, whose key and value are plain
        4-D tensors cut from one projection (one dtype and device, the same
        B, G and M): only what they share with the cache is compared here."""
        ck, cv = self.key, self.value
        if (
            ck is not None
            and cv is not None
            and ck.dtype is key.dtype
            and ck.shape[:2] == key.shape[:2]
            and ck.shape[3] == key.shape[3]
            and cv.shape[3] == value.shape[3]
            and ck.get_device() == key.get_device()
        ):
            self.key, self.value = torch.cat([ck, key], dim=2), torch.cat([cv, value], dim=2)
            return self.key, self.value
        return self.update(key, value)

    def reset(self) -> None:
        """Forget every cached token."""
        self.key = self.value = None
