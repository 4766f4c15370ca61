"""DamchaKVCache: the key/value cache for incremental decoding."""

from __future__ import annotations

from typing import Any

import torch
from damcha_core import DamchaTypeError, DamchaValueError, check_bool, check_int, describe, invalid_argument
from torch import Tensor

__all__ = ["DamchaKVCache"]


def _check_heads(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise DamchaTypeError(
            invalid_argument(name, "a real floating tensor of heads (B, G, M, d)", f"{name}={describe(value)}")
        )
    if value.dim() != 4:
        raise DamchaValueError(invalid_argument(name, "rank 4, (B, G, M, d)", f"{name}.shape={tuple(value.shape)}"))
    return value


class DamchaKVCache:
    """Key/value cache for incremental decoding.

    It stores the *transformed* keys k~ = L_k(c) k (B, G, P, d) and the values
    (B, G, P, d_v) of the P tokens seen so far: the same size as an MHA cache,
    and the keys never need their map again. Pass one cache per layer as
    ``layer(x, x, x, is_causal=True, need_weights=False, kv_cache=cache)``;
    the layer appends the new tokens and attends over all of them, query i of
    the call sitting at position P + i (bottom-right causal alignment).

    Without autograd (``torch.no_grad`` / ``torch.inference_mode``) the tokens
    live in preallocated storage (B, G, C, d) that grows geometrically
    (C at least doubles) and is written in place, so a step copies only its
    new tokens; ``key`` and ``value`` are views of the first P positions.
    With autograd on, an append concatenates as a plain ``torch.cat`` (a
    write into storage that an earlier step's graph saved would break its
    backward).

    Args:
        capacity: positions to reserve when the storage is allocated (the
            first call without autograd, or the first after ``reset``);
            ``None`` reserves twice the first call's tokens. A longer
            sequence still fits: the storage grows to twice what it holds,
            so it holds up to ``max(capacity, 2 P)`` positions rather than P.
        static: never reallocate: the storage holds exactly ``capacity``
            positions (required), is allocated by the first call and then
            only written in place (``reset`` keeps it), so its address stays
            fixed for CUDA graphs (``torch.compile(mode="reduce-overhead")``).
            A call that would go past ``capacity`` raises a
            ``DamchaValueError`` before appending anything; so does a call
            with autograd recording (an in-place write would break the
            backward of earlier steps): decode under ``torch.no_grad()`` or
            ``torch.inference_mode()``.
        fixed_shape: with ``static=True``, a step that is compiled
            (``torch.compile``) or captured in a CUDA graph reads the whole
            ``capacity`` with a mask of the cached positions, and writes at a
            position kept in a device tensor: its graph has one shape at
            every length, so ``mode="reduce-overhead"`` records one CUDA
            graph for all lengths rather than one per length. Eager steps
            still read only the cached positions. Such a step costs
            O(capacity) whatever the length, and under compilation a write
            past ``capacity`` cannot be checked in Python: the indexed write
            fails instead (an index error; a device-side assert on CUDA).
            Steps with masks, ``need_weights=True``, ``add_bias_kv`` or
            ``add_zero_attn`` read the cached positions as without it.
    """

    def __init__(self, capacity: int | None = None, *, static: bool = False, fixed_shape: bool = False) -> None:
        self._reserve = check_int("capacity", capacity, optional=True)
        self._static = check_bool("static", static)
        self._fixed = check_bool("fixed_shape", fixed_shape)
        if self._fixed and not self._static:
            raise DamchaValueError(
                invalid_argument(
                    "fixed_shape",
                    "False unless static=True (the fixed-shape read needs the fixed storage)",
                    f"fixed_shape=True, static={self._static}",
                )
            )
        if self._static and self._reserve is None:
            raise DamchaValueError(
                invalid_argument(
                    "capacity",
                    "an int >= 1 with static=True (the positions the fixed storage holds)",
                    "capacity=None, static=True",
                )
            )
        # The cached positions are the first _length of _kbuf/_vbuf (B, G, C, d).
        # Only those two tensors and an int are state, never views of them:
        # torch.compile then sees one input per storage (views of one storage
        # as separate inputs cost recompiles) and marks _length dynamic.
        self._kbuf: Tensor | None = None
        self._vbuf: Tensor | None = None
        # -1: a compiled or captured fixed-shape step advanced only _pos (see _synced).
        self._length = 0
        # fixed_shape: the cached length as a 0-d int64 tensor beside the storage,
        # which a compiled step reads and advances without a Python int.
        self._pos: Tensor | None = None

    @property
    def key(self) -> Tensor | None:
        """The cached keys k~ (B, G, P, d), or None when empty."""
        kb, n = self._kbuf, self._synced()
        return None if kb is None or (self._static and not n) else kb.narrow(2, 0, n)

    @key.setter
    def key(self, tensor: Tensor | None) -> None:
        self._set(tensor, self.value)

    @property
    def value(self) -> Tensor | None:
        """The cached values (B, G, P, d_v), or None when empty."""
        vb, n = self._vbuf, self._synced()
        return None if vb is None or (self._static and not n) else vb.narrow(2, 0, n)

    @value.setter
    def value(self, tensor: Tensor | None) -> None:
        self._set(self.key, tensor)

    def _synced(self) -> int:
        """The cached length as a Python int. A compiled or CUDA-graph-captured
        step of a ``fixed_shape`` cache advances only the position tensor (a
        Python int would make the length a size of its graph): the int is
        then read back from it (a device sync, outside the step)."""
        n = self._length
        if n < 0:
            assert self._pos is not None  # set with the storage of a fixed_shape cache
            n = self._length = int(self._pos)
        return n

    def _set(self, key: Tensor | None, value: Tensor | None) -> None:
        # Assigned tensors become the storage (full, so the next append copies
        # into new storage rather than writing into the caller's tensors; a
        # static cache copies them into its fixed storage there).
        length = 0 if key is None else int(key.shape[2])
        if self._static and self._reserve is not None and length > self._reserve:
            raise DamchaValueError(
                f"A static `DamchaKVCache` holds at most `capacity`={self._reserve} positions. "
                f"Received: key.shape={tuple(key.shape)}"  # type: ignore[union-attr]
            )
        self._kbuf, self._vbuf, self._pos = key, value, None
        self._length = length
        if (
            self._fixed
            and key is not None
            and value is not None
            and length
            and key.dim() == value.dim() == 4
            and key.shape[:3] == value.shape[:3]
        ):
            # Copied into the fixed storage now, so that a compiled step (which
            # cannot allocate marked storage) finds it there.
            self._kbuf = self._vbuf = None
            with torch.no_grad():
                self._store_static(key.detach(), value.detach(), 0, length)

    @property
    def capacity(self) -> int:
        """Positions the current storage holds (>= ``len(self)``); a static
        cache's ``capacity`` argument."""
        if self._static:
            return self._reserve  # type: ignore[return-value]  # required with static
        return 0 if self._kbuf is None else int(self._kbuf.shape[2])

    @property
    def static(self) -> bool:
        """Whether the storage is fixed (``DamchaKVCache(capacity, static=True)``)."""
        return self._static

    @property
    def fixed_shape(self) -> bool:
        """Whether compiled steps read the whole capacity (``fixed_shape=True``)."""
        return self._fixed

    def __len__(self) -> int:
        if self._kbuf is None:
            return 0
        n = self._length
        return n if n >= 0 else self._synced()

    def __getstate__(self) -> dict[str, Any]:
        # Only the cached positions (pickling a view saves its whole storage),
        # under the attribute names of the concatenating cache.
        key, value = self.key, self.value
        return {
            "key": None if key is None else key.clone(),
            "value": None if value is None else value.clone(),
            "capacity": self._reserve,
            "static": self._static,
            "fixed_shape": self._fixed,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._reserve = state.get("capacity")
        self._static = state.get("static", False)
        self._fixed = state.get("fixed_shape", False)
        self._set(state["key"], state["value"])

    def _store(self, key: Tensor, value: Tensor, P: int) -> tuple[Tensor, Tensor]:
        """Append checked key/value after the P cached positions (P may be 0)."""
        kb, vb = self._kbuf, self._vbuf
        n = key.shape[2]
        if self._static:
            return self._store_static(key, value, P, n)
        if torch.is_grad_enabled():
            # An earlier step's graph may hold the cached tensors (SDPA saves
            # its keys and values): an in-place write into their storage would
            # bump the version counter that its backward checks. The result
            # fills its storage, so a later append never writes into it.
            if kb is not None and vb is not None and P > 0:
                key = torch.cat([kb.narrow(2, 0, P), key], dim=2)
                value = torch.cat([vb.narrow(2, 0, P), value], dim=2)
            self._kbuf, self._vbuf, self._length = key, value, P + n
            return key, value
        if (
            kb is None
            or vb is None
            # One position stays free: a view of the first P + n positions is
            # then never contiguous, so torch.compile's contiguity checks do
            # not flip (and recompile) when the storage fills up.
            or P + n >= kb.shape[2]
            # Storage made under inference_mode cannot be written outside it.
            or (not torch.compiler.is_compiling() and kb.is_inference() and not torch.is_inference_mode_enabled())
        ):
            # Twice what is held, from the first call on: a prompt's storage has room
            # for as many new tokens, so a generation's first steps copy nothing (a
            # growth copies every position into fresh pages, a page fault per 4 KiB:
            # 4 ms at B = 8 after a 512-token prompt, an eighth of a 32-token decode).
            size = max(P + n + 1, 2 * (P + n), self._reserve or 0)
            new_k = key.new_empty(key.shape[0], key.shape[1], size, key.shape[3])
            new_v = value.new_empty(value.shape[0], value.shape[1], size, value.shape[3])
            if kb is not None and vb is not None and P > 0:
                new_k.narrow(2, 0, P).copy_(kb.narrow(2, 0, P))
                new_v.narrow(2, 0, P).copy_(vb.narrow(2, 0, P))
            self._kbuf, self._vbuf, kb, vb = new_k, new_v, new_k, new_v
        kb.narrow(2, P, n).copy_(key)
        vb.narrow(2, P, n).copy_(value)
        self._length = P + n
        return kb.narrow(2, 0, P + n), vb.narrow(2, 0, P + n)

    def _store_static(self, key: Tensor, value: Tensor, P: int, n: int) -> tuple[Tensor, Tensor]:
        cap = self._reserve
        assert cap is not None  # required with static
        if P + n > cap:
            # int(): under torch.compile the sizes may be symbolic, which a
            # traced f-string cannot format (this branch only runs to raise).
            raise DamchaValueError(
                f"This call does not fit the static `kv_cache`: it holds {int(P)} of `capacity`={cap} positions "
                f"and the call appends {int(n)} (call kv_cache.reset() to start a new sequence, or make the "
                f"cache with a larger capacity). Received: key.shape={tuple(int(s) for s in key.shape)}"
            )
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            raise DamchaValueError(
                "A static `kv_cache` is written in place, which would break the backward of earlier steps: "
                "decode under torch.no_grad() or torch.inference_mode(). "
                f"Received: key.requires_grad={key.requires_grad}, value.requires_grad={value.requires_grad}"
            )
        kb, vb = self._kbuf, self._vbuf
        compiling = torch.compiler.is_compiling()
        # The storage holds cap + 1 positions: the free one keeps every view of
        # the cached positions non-contiguous, so torch.compile's contiguity
        # checks never flip (and recompile) on the last position.
        if (
            kb is None
            or vb is None
            or kb.shape[2] != cap + 1
            or vb.shape[2] != cap + 1
            or (
                P == 0  # a new sequence may change the batch, sizes, dtype or device
                and (
                    kb.shape[:2] != key.shape[:2]
                    or kb.shape[3] != key.shape[3]
                    or vb.shape[3] != value.shape[3]
                    or kb.dtype != key.dtype
                    or kb.device != key.device
                    or (not compiling and kb.is_inference() and not torch.is_inference_mode_enabled())
                )
            )
        ):
            # The first call of a sequence (or after a pickle round trip or an
            # assignment): the only allocation.
            new_k, new_v = self._allocate(key, value, cap + 1, compiling)
            if kb is not None and vb is not None and P > 0:
                new_k.narrow(2, 0, P).copy_(kb.narrow(2, 0, P))
                new_v.narrow(2, 0, P).copy_(vb.narrow(2, 0, P))
            kb, vb = new_k, new_v
        elif not compiling and kb.is_inference() and not torch.is_inference_mode_enabled():
            raise DamchaValueError(
                "This static `kv_cache` was allocated under torch.inference_mode() and cannot be written "
                "outside it (torch forbids in-place writes into inference tensors): decode every step under "
                "inference_mode, or under torch.no_grad() from the start. Received: a call outside inference_mode"
            )
        kb.narrow(2, P, n).copy_(key)
        vb.narrow(2, P, n).copy_(value)
        if self._pos is not None:
            self._pos.fill_(P + n)
        self._length = P + n
        return kb.narrow(2, 0, P + n), vb.narrow(2, 0, P + n)

    def _allocate(self, key: Tensor, value: Tensor, size: int, compiling: bool) -> tuple[Tensor, Tensor]:
        """A static cache's storage (B, G, size, d) for key and value, made the
        cache's (and, with fixed_shape, a zero position tensor)."""
        shape_k = (key.shape[0], key.shape[1], size, key.shape[3])
        shape_v = (value.shape[0], value.shape[1], size, value.shape[3])
        if self._fixed:
            # A fixed-shape read covers every position, the unwritten ones
            # masked: they must hold finite numbers (a masked NaN key or value
            # still gives NaN: 0 * NaN).
            new_k, new_v = key.new_zeros(shape_k), value.new_zeros(shape_v)
            self._pos = torch.zeros((), dtype=torch.int64, device=key.device)
        else:
            new_k, new_v = key.new_empty(shape_k), value.new_empty(shape_v)
        if not compiling:
            # Tell torch.compile the address is fixed: CUDA graphs then write
            # into this storage rather than copy it in and out of their pool.
            import torch._dynamo as dynamo  # imported here: eager-only code never needs it

            for t in (new_k, new_v) if self._pos is None else (new_k, new_v, self._pos):
                dynamo.mark_static_address(t)
        self._kbuf, self._vbuf = new_k, new_v
        return new_k, new_v

    def _append_fixed(self, key: Tensor, value: Tensor, causal: bool) -> tuple[Tensor, Tensor, Tensor] | None:
        """``update`` at one shape for every length, for a compiled or
        CUDA-graph-captured step of a ``fixed_shape`` cache: the whole
        capacity (B, G, C, d) and (B, G, C, d_v) with the bool (M, C) mask of
        the positions each of the M new queries may attend (True = attend;
        the causal rule when ``causal``). None when this call reads the
        cached positions as usual (eager steps, other caches).
        """
        if not self._fixed or not (
            torch.compiler.is_compiling() or (key.is_cuda and torch.cuda.is_current_stream_capturing())
        ):
            return None
        cap = self._reserve
        assert cap is not None  # required with static
        kb, vb, pos = self._kbuf, self._vbuf, self._pos
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            return None  # update() raises its error
        if kb is None or vb is None or pos is None:
            # Nothing cached (the position is 0): allocate here. Unmarked storage
            # under compilation; docs/torch.md advises an eager first call.
            kb, vb = self._allocate(key, value, cap + 1, torch.compiler.is_compiling())
            pos = self._pos
            assert pos is not None  # made by _allocate with fixed_shape
        elif (
            key.dim() != 4
            or value.dim() != 4
            or kb.shape[:2] != key.shape[:2]
            or key.shape[:3] != value.shape[:3]
            or kb.shape[3] != key.shape[3]
            or vb.shape[3] != value.shape[3]
            or kb.dtype != key.dtype
            or vb.dtype != value.dtype
            or kb.device != key.device
        ):
            raise DamchaValueError(
                invalid_argument(
                    "key",
                    "the batch, head count, head size, dtype and device of the fixed_shape `kv_cache`'s storage "
                    "(a compiled step cannot reallocate it: run the first call of a sequence with other sizes "
                    "uncompiled)",
                    f"storage key shape {tuple(kb.shape)} {kb.dtype}, new key shape {tuple(key.shape)} {key.dtype}",
                )
            )
        n = key.shape[2]
        if n > cap:
            raise DamchaValueError(
                f"This call does not fit the static `kv_cache`: `capacity`={cap} positions and the call appends "
                f"{int(n)}. Received: key.shape={tuple(int(s) for s in key.shape)}"
            )
        # Positions P .. P + n - 1 from the device tensor; the cap-position views
        # make an index past the capacity an error (the free last position of
        # the storage is not written).
        at = pos + torch.arange(n, device=pos.device)
        keys, values = kb.narrow(2, 0, cap), vb.narrow(2, 0, cap)
        keys.index_copy_(2, at, key)
        values.index_copy_(2, at, value)
        last = at if causal else at[-1:].expand(n)
        visible = torch.arange(cap, device=pos.device) <= last.unsqueeze(-1)
        pos.add_(n)
        self._length = -1  # the Python int is read back from _pos when asked (_synced)
        return keys, values, visible

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Append key (B, G, M, d) and value (B, G, M, d_v); return the full cache.

        Everything is checked before anything is appended: a failed call
        leaves the cache as it was. The returned tensors are ``self.key`` and
        ``self.value``: without autograd, views of the cache's storage (their
        P + M positions are never rewritten; ``reset`` drops the storage).
        """
        ck, cv = self._kbuf, self._vbuf
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
            return self._store(key, value, self._synced())
        key, value = _check_heads("key", key), _check_heads("value", value)
        if key.shape[:3] != value.shape[:3]:
            raise DamchaValueError(
                invalid_argument(
                    "value",
                    "the batch, head count and length (B, G, M) of `key`",
                    f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}",
                )
            )
        if key.dtype != value.dtype or key.device != value.device:
            raise DamchaValueError(
                invalid_argument(
                    "value",
                    "the dtype and device of `key`",
                    f"key {key.dtype} on {key.device}, value {value.dtype} on {value.device}",
                )
            )
        if ck is None or cv is None or self._synced() == 0:
            return self._store(key, value, 0)
        if key.shape[:2] != ck.shape[:2] or key.shape[3:] != ck.shape[3:] or (value.shape[3:] != cv.shape[3:]):
            raise DamchaValueError(
                invalid_argument(
                    "key",
                    "the batch, head count and head size the `kv_cache` holds (call kv_cache.reset() to start a "
                    "new sequence)",
                    f"cached key shape {(*ck.shape[:2], self._length, ck.shape[3])}, new key shape {tuple(key.shape)}",
                )
            )
        if key.dtype != ck.dtype or key.device != ck.device:
            # torch.cat would silently promote the dtype, or fail later in SDPA.
            raise DamchaValueError(
                invalid_argument(
                    "key",
                    "the dtype and device of the keys the `kv_cache` holds (call kv_cache.reset() to start a new "
                    "sequence)",
                    f"cached {ck.dtype} on {ck.device}, new {key.dtype} on {key.device}",
                )
            )
        return self._store(key, value, self._synced())

    def _extend(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """``update`` for the flat decoding step, whose key and value are plain
        4-D tensors cut from one projection (one dtype and device, the same
        B, G and M): only what they share with the cache is compared here."""
        ck, cv = self._kbuf, self._vbuf
        if (
            ck is not None
            and cv is not None
            and ck.dtype is key.dtype
            and ck.shape[:2] == key.shape[:2]
            and ck.shape[3] == key.shape[3]
            and cv.shape[3] == value.shape[3]
            and ck.get_device() == key.get_device()
        ):
            P = self._length
            return self._store(key, value, P if P >= 0 else self._synced())
        return self.update(key, value)

    def reset(self) -> None:
        """Forget every cached token. The storage is dropped (views handed out
        before stay as they were), except a static cache's, which is kept for
        the next sequence (its views are then overwritten; a ``fixed_shape``
        cache's is zeroed, as its masked positions must stay finite)."""
        if not self._static:
            self._kbuf = self._vbuf = None
        elif self._fixed and self._kbuf is not None and self._vbuf is not None and self._pos is not None:
            # In place, so the addresses stay those a CUDA graph recorded;
            # storage made under inference_mode is written under it.
            with torch.inference_mode() if self._kbuf.is_inference() else torch.no_grad():
                for t in (self._kbuf, self._vbuf, self._pos):
                    t.zero_()
        self._length = 0
