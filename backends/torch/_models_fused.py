"""The fast paths of converted projections (``convert``, metrics "heads" and "lowrank").

A converted projection computes y = P(t) and then, for each block of y that
holds a role's heads (queries or keys, S heads of d features each), the
residual map y_b + diag(g) A(t) y_b of its token t ("lowrank": y_b +
((y_b V) * c(t)) U_g^T, c(t) = phi(t) W + b (r,), U_g = u with each head's
rows scaled by its gate). Two paths skip the
general one's copies (a split of y, a contiguous copy of each strided block,
a concatenation of the result) and its recomputation of the whole projection:

- ``map_blocks_``: no autograd graph to build (``torch.no_grad``, inference
  mode). The mixing product of each block is added to y in place, through
  strided views: one small ``bmm`` and one ``add_`` per block ("lowrank":
  one ``mm`` and one ``addmm_``), no copy; with ``merge`` (converted
  models) one ``bmm`` per run of adjacent blocks (``_run_mix``). In every float dtype: a 16-bit
  block (a bfloat16 model, autocast) gets its correction in float32, added
  with one rounding.
- ``FusedProjectionMaps``: training with ``recompute`` on a plain
  ``nn.Linear`` projection (timm's fused ``qkv``, ``q_proj``/``k_proj``) or
  transformers' ``Conv1D`` (GPT-2's fused ``c_attn``, weight stored
  (in, out)), optionally wrapped in PEFT's plain LoRA (the update
  (x A^T B^T) * scaling added as PEFT adds it). One autograd node for the projection and its maps that saves
  only what the projection saves (its input and weights): backward
  recomputes the rows of the projection that hold mapped heads (two thirds
  of a fused qkv GEMM instead of all of it; a Conv1D's columns, read in
  place) and the generator's S x S coefficients, and writes the
  gradients by hand: a ``baddbmm`` per run of adjacent blocks and a ``bmm``
  per block for the mixing (the first makes that run's dL/dy fresh; the
  unmapped columns stay views of the incoming gradient and the projection's
  gradients take the pieces one GEMM each, writing the weight and bias
  gradients in place, so neither the (T, F) gradient nor the parameter
  gradients are ever copied), a few passes over
  the (T, S*S) coefficients and two over the tokens for the generator
  (autograd's norm backward made several (T, E) temporaries). The backward
  is written with differentiable ops, so ``create_graph=True`` (a gradient
  penalty) differentiates it. float32/float64 outside autocast only (the
  caller keeps 16-bit and autocast training on the general path).
  ``StoredProjectionMaps`` is its store mode (``OutputRecipe``): the mapped
  output a copy, the unmapped output kept, and the host's saved views of
  the mapped output saved as recipes (hooks opened around the host's
  attention module by ``DamchaMaps``), so backward projects nothing again.

- ``SplitLinearMaps``: ``DamchaAttention``'s projections in training
  (``recompute``, metric "heads"): ``FusedProjectionMaps`` on an ``nn.Linear``
  weight whose output comes back as the pieces q~, k~, v (or q~ alone), each
  with its own gradient (no concatenation or copy of them in backward). Its
  store mode (``MapRecipes``) returns q~ and k~ as fresh tensors and keeps
  the unmapped output instead of projecting again in backward; the layer's
  SDPA call saves q~ and k~ as recipes (``saved_as_recipes``), so what
  autograd keeps is still what nn.MultiheadAttention keeps.

Both compute each mapped block the same way (y_b + bmm(diag(g) A(t), y_b),
or the "lowrank" ``addmm_``), one product per block (the tied queries and keys of one projection share one A(t)), so
they agree bit for bit with each other (a host's reentrant gradient
checkpointing runs the first under ``no_grad`` and the second when it
recomputes). With the gates at 0 the product is exactly 0 and y is returned
unchanged, bit for bit. ``SplitLinearMaps``' store mode maps each block as
the layer's general path does (one ``baddbmm``, y_b + diag(g) A(t) y_b),
and its recipes make the block again with the same op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import damcha_core as dc
import torch
import torch.nn.functional as F
from torch import Tensor

from . import _functional as fn

__all__ = [
    "FusedProjectionMaps",
    "MapRecipes",
    "OutputRecipe",
    "SharedNorm",
    "SideBlocks",
    "SplitLinearMaps",
    "StoredProjectionMaps",
    "coefficients",
    "lowrank_factors",
    "map_blocks_",
    "mix_coefficients",
    "project",
    "saved_as_recipes",
    "side_leaves",
]


class SideBlocks(NamedTuple):
    """The blocks of a projection's output that one metric side maps: one
    block at each feature offset of ``offsets``, each ``heads`` heads of
    ``head_dim`` features (the tied queries and keys of a fused qkv are two
    blocks of side "qk"), and the side's metric ("heads" or "lowrank").

    ``groups`` > 1: an interleaved output (``ProjectionSite.groups``) of
    ``groups`` equal runs of F / groups features, each holding one head of
    each block (``heads == groups``), the offsets counted within a run: head
    h of the block at offset o starts at feature h * F / groups + o
    (GPT-NeoX's query_key_value: offsets (0, d) for its tied queries and
    keys). Metric "heads" only."""

    side: str
    heads: int
    head_dim: int
    offsets: tuple[int, ...]
    metric: str = "heads"
    groups: int = 1


# The tensors of a side that the fused node takes, in SideWeights' order:
# (weight, bias, gate), and "lowrank"'s (u, v).
_LEAVES = {"heads": 3, "lowrank": 5}


def side_leaves(weights: fn.SideWeights) -> tuple[Tensor, ...]:
    """The tensors of ``weights`` the fused node takes (``FusedProjectionMaps``' leaves)."""
    if weights.metric == "heads":
        return (weights.weight, weights.bias, weights.gate)
    assert weights.u is not None and weights.v is not None
    return (weights.weight, weights.bias, weights.gate, weights.u, weights.v)


def coefficients(side: fn.SideWeights, tokens: Tensor, r: Tensor | None = None) -> Tensor:
    """A(t) = phi(t) W + b, (T, S*S) for "heads" or (T, r) for "lowrank", of
    tokens (T, E), computed as the functional core does (one GEMM on the raw
    tokens, the RMS normalisation applied to its small output); ``r`` the
    tokens' ``_rms_denominator`` if already known."""
    if r is None:
        r = fn._rms_denominator(tokens)
    return fn.coefficients_of(F.linear(tokens, side.weight), r, side.bias, tokens.shape[-1])


class SharedNorm:
    """The RMS denominator r (T, 1) of one input that several converted
    projections of an attention module read (Llama's ``q_proj`` and
    ``k_proj`` both project the same hidden states): computed once in
    forward and once in backward, where each site computed its own in each.
    The forward's lives until the attention module returns
    (``end_forward``); the backward's from the first fused node's backward
    until the last node that read it in forward has it. The same op on the
    same tokens, so the same bits."""

    __slots__ = ("_backward", "_forward", "_left", "readers")

    def __init__(self) -> None:
        self.readers = 0  # fused nodes that read it in forward (each reads it in backward)
        self._forward: Tensor | None = None
        self._backward: Tensor | None = None
        self._left = 0

    def forward(self, t: Tensor, reader: bool = True) -> Tensor:
        """r of the tokens t (T, E) in forward (``reader``: a fused node's, which reads it again in backward)."""
        self.readers += reader
        if self._forward is None:
            self._forward = fn._rms_denominator(t)
        return self._forward

    def end_forward(self) -> None:
        self._forward = None

    def backward(self, t: Tensor) -> Tensor:
        """r of the tokens t (T, E) in a fused node's backward."""
        r = self._backward
        if r is None or self._left <= 0:
            r, self._left = fn._rms_denominator(t), self.readers
        self._left -= 1
        self._backward = r if self._left > 0 else None
        return r


def mix_coefficients(side: fn.SideWeights, tokens: Tensor) -> Tensor:
    """diag(g) A(t), (T, S, S), of tokens (T, E); metric "heads"."""
    S = side.gate.shape[0]
    return coefficients(side, tokens).view(-1, S, S) * side.gate.view(S, 1)


def lowrank_factors(side: fn.SideWeights) -> tuple[Tensor, Tensor]:
    """The factors of metric "lowrank"'s L(t) y = y + ((y V) * c(t)) U_g^T on a
    block y (T, S*d): (V (S*d, r), U_g (S*d, r)), U_g = u with each head's rows
    scaled by its gate."""
    assert side.u is not None and side.v is not None
    S = side.gate.shape[0]
    return side.v.flatten(0, 1), (side.u * side.gate.view(S, 1, 1)).flatten(0, 1)


def _block(flat: Tensor, offset: int, heads: int, head_dim: int) -> Tensor:
    """The (T, S, d) strided view of one block of a (T, F) output."""
    return flat[:, offset : offset + heads * head_dim].unflatten(-1, (heads, head_dim))


def _interleaved(flat: Tensor, offset: int, heads: int, width: int, stride: int) -> Tensor:
    """The (T, S, width) view of ``heads`` heads of a (T, S * stride) output,
    head h's ``width`` features at column offset + h * stride (an interleaved
    run of ``SideBlocks``: the heads of one or more blocks adjacent within a
    run). Made by unflatten and a slice, not ``as_strided``: torch.compile
    refuses an in-place write through an ``as_strided`` view."""
    return flat.unflatten(-1, (heads, stride))[:, :, offset : offset + width]


def _interleaved_runs(blocks: SideBlocks) -> tuple[tuple[int, int], ...]:
    """(offset, n) of each run of an interleaved side's blocks adjacent
    within a run of the output (GPT-NeoX's tied query and key of each head:
    one run of 2 at offset 0), in column order: each is one (T, S, n*d) view
    that the side's (T, S, S) mix maps at once (the same mix multiplies every
    feature of a head)."""
    runs: list[tuple[int, int]] = []
    for offset in sorted(blocks.offsets):
        if runs and runs[-1][0] + runs[-1][1] * blocks.head_dim == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset, 1))
    return tuple(runs)


def _map_interleaved_(flat: Tensor, blocks: SideBlocks, mix: Tensor, same: bool = True) -> None:
    """Map an interleaved side's blocks of ``flat`` (T, F) in place by its mix
    (T, S, S): one batched product per run of the heads' strided (T, S, n*d)
    view (BLAS reads it in place: measured as fast as on consecutive heads,
    and faster than gathering them first), added back in place. ``same``:
    flat is in the mix's dtype, else (16 bits) the heads are read in it and
    the correction added with one rounding."""
    stride = flat.shape[1] // blocks.groups
    for offset, n in _interleaved_runs(blocks):
        part = _interleaved(flat, offset, blocks.heads, n * blocks.head_dim, stride)
        part.add_(torch.bmm(mix, part if same else part.to(mix.dtype)))


def _runs(blocks: SideBlocks) -> tuple[tuple[int, int], ...]:
    """(offset, n) of each run of ``blocks``' blocks that lie side by side in
    the output, in column order (a fused qkv's tied queries and keys: one
    run of 2 at offset 0). Memoised in eager mode; under torch.compile the
    plain function is traced (its result is a constant of the graph), as
    Dynamo warns on every ``lru_cache``-wrapped function it traces, which
    every compiled forward of a converted model did."""
    if torch.compiler.is_compiling():
        return _find_runs(blocks)
    return _memo_runs(blocks)


def _find_runs(blocks: SideBlocks) -> tuple[tuple[int, int], ...]:
    width = blocks.heads * blocks.head_dim
    runs: list[tuple[int, int]] = []
    for offset in sorted(blocks.offsets):
        if runs and runs[-1][0] + runs[-1][1] * width == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset, 1))
    return tuple(runs)


_memo_runs = functools.lru_cache(maxsize=256)(_find_runs)


def _run_mix(A: Tensor, gate: Tensor, n: int) -> Tensor:
    """diag(g) A(t), (T, S, S), of the coefficients A (T, S*S); for a run of n
    blocks (n > 1) its block diagonal (T, n*S, n*S): n copies of it on the
    diagonal, exact zeros off it, so that one ``bmm`` maps the whole run as
    (T, n*S, d). At S = 3 a batched product of T tiny matrices costs about
    the same per matrix whether it is 3 x 3 or 6 x 6 (MKL's batched GEMM is
    overhead-bound there), so one call for the queries and keys beats two.
    Each entry is the one product A * g_i (or an exact 0), as ``mix_coefficients``'.

    The diagonal blocks are written by one ``mul`` into the diagonal of a
    zeroed (T, n, S, n, S) tensor: a third of the CPU time of a broadcast
    product A * (I_n (x) diag(g)) over all n^2 blocks (0.17 vs 0.47 ms at
    T = 2308, S = 3, n = 2, one thread), whose TensorIterator broadcasts A
    over two inner dimensions. The same entries (1 * g_i = g_i exactly), but
    the off-diagonal zeros are +0 where A * 0 gave -0 for a negative A (the
    products agree: a 0 term adds nothing to a sum). ``out=`` records no
    graph, Dynamo does not trace a strided ``out=`` and torch.func has no
    batching rule for it: under a graph (a ``create_graph`` backward), a
    tracer, a compiler or a torch.func transform, the broadcast product."""
    S = gate.shape[0]
    if n == 1:
        return A.view(-1, S, S) * gate.view(S, 1)
    if not fn._writable(A) or (torch.is_grad_enabled() and gate.requires_grad):
        scale = torch.eye(n, dtype=A.dtype, device=A.device).view(n, 1, n, 1) * gate.view(1, S, 1, 1)
        return (A.view(-1, 1, S, 1, S) * scale).view(-1, n * S, n * S)
    mix = A.new_zeros(A.shape[0], n, S, n, S)
    torch.mul(A.view(-1, S, S, 1).expand(-1, S, S, n), gate.view(S, 1, 1), out=mix.diagonal(0, 1, 3))
    return mix.view(-1, n * S, n * S)


def map_blocks_(
    y: Tensor,
    tokens: Tensor,
    sides: Sequence[tuple[SideBlocks, fn.SideWeights]],
    *,
    merge: bool = False,
    norm: SharedNorm | None = None,
    kernel: bool = False,
) -> Tensor:
    """Map the blocks of y (..., F) in place; y must be contiguous. Returns y.

    Only where no autograd graph is recorded (the caller checks), or inside
    ``FusedProjectionMaps``. A 16-bit y (a bfloat16/float16 model, or a
    projection run under autocast) is mapped as the general path maps it: the
    correction g A(t) y_b of each block is computed in float32 (tokens,
    weights and the block cast up, autocast off) and added to y_b in place,
    rounded once, so the result is the 16-bit rounding of y_b + correction,
    the residual form (gates at 0 leave y as it was, bit for bit).

    ``merge``: a float32/float64 y maps each run of adjacent "heads" blocks
    with one ``bmm`` (``_run_mix``; the converted models' fused qkv), as
    ``_remap``, ``OutputRecipe`` and the fused node's backward do. ``norm``:
    the tokens' RMS denominator shared with the module's other sites (else
    computed here, once for all sides).

    ``kernel``: a call outside any autograd node (not the fused node's
    forward, whose backward remakes the mix with these ops, bit for bit) may
    map a few CPU tokens with the C kernel (``_kernel_map_``): a converted
    model's decoding step at small batch, where these ops' count is its cost."""
    if kernel and _kernel_map_(y, tokens, sides):
        return y
    dtype = torch.float32 if y.dtype in _HALF else y.dtype
    device = y.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return _map_blocks(y, tokens, sides, dtype, merge, norm)
    return _map_blocks(y, tokens, sides, dtype, merge, norm)


_HALF = (torch.float16, torch.bfloat16)


def _kernel_map_(y: Tensor, tokens: Tensor, sides: Sequence[tuple[SideBlocks, fn.SideWeights]]) -> bool:
    """``map_blocks_`` by the C kernel (damcha_torch._headmix, as the flat
    decoding step uses it): every run of adjacent "heads" blocks of a side in
    one call (an interleaved side's blocks, ``groups`` > 1: one call with the
    heads a run apart), in place, for at most ``fn._FEW_TOKENS`` CPU tokens in
    y's float32/float64 dtype with contiguous weights of that dtype. False
    (and y untouched) where any of that does not hold: the torch ops map it
    then. The kernel trusts its pointers: these checks keep it in bounds."""
    kernel = fn._HEADMIX
    if (
        kernel is None
        or y.__class__ is not Tensor  # a subclass (DTensor, vmap's batched tensors) may have no storage
        or tokens.__class__ is not Tensor
        or not y.is_cpu
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
    ):
        return False
    dtype = y.dtype
    if dtype is not torch.float32 and dtype is not torch.float64:
        return False
    F_ = y.shape[-1]
    E = tokens.shape[-1]
    T = y.numel() // F_ if F_ else 0
    if not 0 < T <= fn._FEW_TOKENS or tokens.dtype is not dtype or not tokens.is_cpu or tokens.numel() != T * E:
        return False
    t = tokens.reshape(T, E)
    if t.stride(1) != 1 and E > 1:
        return False
    # (S, d, offset, blocks, head stride, block stride, weights) of each kernel call
    calls: list[tuple[int, int, int, int, int, int, fn.SideWeights]] = []
    for blocks, w in sides:
        S, d, groups = blocks.heads, blocks.head_dim, blocks.groups
        if not (
            blocks.metric == "heads"
            and all(
                v.__class__ in fn._PLAIN
                and v.is_cpu
                and v.dtype is dtype
                and v.layout is fn._STRIDED
                and v.is_contiguous()
                for v in (w.weight, w.bias, w.gate)
            )
            and w.weight.shape == (S * S, E)
            and w.bias.shape == (S * S,)
            and w.gate.shape == (S,)
        ):
            return False
        if groups == 1:
            for offset, n in _runs(blocks):
                if offset < 0 or offset + n * S * d > F_:
                    return False
                calls.append((S, d, offset, n, d, S * d, w))
            continue
        # Interleaved: head h of the block at offset o (within a run) starts at h * run + o.
        run, offsets = F_ // groups, sorted(blocks.offsets)
        if groups != S or F_ % groups or offsets[0] < 0 or offsets[-1] + d > run:
            return False
        step = offsets[1] - offsets[0] if len(offsets) > 1 else 0
        if any(b - a != step for a, b in zip(offsets, offsets[1:])) or (len(offsets) > 1 and step < d):
            return False  # blocks not evenly spaced or overlapping: not one call's layout
        calls.append((S, d, offsets[0], len(offsets), run, step, w))
    double, item = dtype is torch.float64, 8 if dtype is torch.float64 else 4
    base, xp, row = y.data_ptr(), t.data_ptr(), t.stride(0)
    for S, d, offset, n, head_stride, block_stride, w in calls:
        at = base + offset * item
        kernel.map(
            double,
            T,
            E,
            S,
            d,
            xp,
            row,
            w.weight.data_ptr(),
            w.bias.data_ptr(),
            w.gate.data_ptr(),
            at,
            F_,
            n,
            at,
            F_,
            dc.RMS_EPS,
            head_stride,
            block_stride,
        )
    return True


def _map_blocks(
    y: Tensor,
    tokens: Tensor,
    sides: Sequence[tuple[SideBlocks, fn.SideWeights]],
    dtype: torch.dtype,
    merge: bool,
    norm: SharedNorm | None,
) -> Tensor:
    flat = y.view(-1, y.shape[-1])
    t = tokens.reshape(-1, tokens.shape[-1])
    t = fn._cast(t, dtype)
    same = y.dtype == dtype  # else each block is read in float32 and its correction added with one rounding
    r = fn._rms_denominator(t) if norm is None else norm.forward(t, reader=False)
    for blocks, weights in sides:
        weights = _cast_side(weights, dtype)
        if blocks.groups > 1:
            _map_interleaved_(flat, blocks, _run_mix(coefficients(weights, t, r), weights.gate, 1), same)
        elif blocks.metric == "heads" and merge and same:
            _map_runs_(flat, blocks, coefficients(weights, t, r), weights.gate)
        elif blocks.metric == "heads":
            S = weights.gate.shape[0]
            mix = coefficients(weights, t, r).view(-1, S, S) * weights.gate.view(S, 1)
            for offset in blocks.offsets:
                part = _block(flat, offset, blocks.heads, blocks.head_dim)
                part.add_(torch.bmm(mix, part if same else part.to(dtype)))
        else:
            c = coefficients(weights, t, r)
            v, u = lowrank_factors(weights)
            width = blocks.heads * blocks.head_dim
            for offset in blocks.offsets:
                # A (T, S*d) view with row stride F: BLAS writes it in place.
                part = flat[:, offset : offset + width]
                if same:
                    part.addmm_(c * part.mm(v), u.t())
                else:
                    part.add_(torch.mm(c * part.to(dtype).mm(v), u.t()))
    return y


def _map_runs_(flat: Tensor, blocks: SideBlocks, A: Tensor, gate: Tensor) -> None:
    """Map the "heads" blocks of ``flat`` (T, F) in place, one ``bmm`` per run
    of adjacent blocks (``_run_mix``), from the side's coefficients A (T, S*S)."""
    mixes: dict[int, Tensor] = {}
    for offset, n in _runs(blocks):
        mix = mixes.get(n)
        if mix is None:
            mix = mixes[n] = _run_mix(A, gate, n)
        part = _block(flat, offset, n * blocks.heads, blocks.head_dim)
        part.add_(torch.bmm(mix, part))


def _cast_side(side: fn.SideWeights, dtype: torch.dtype) -> fn.SideWeights:
    if all(t is None or t.dtype == dtype for t in (side.weight, side.bias, side.gate, side.u, side.v)):
        return side
    return fn.SideWeights(
        side.metric,
        side.weight.to(dtype),
        side.bias.to(dtype),
        side.gate.to(dtype),
        fn._cast(side.u, dtype),
        fn._cast(side.v, dtype),
    )


class _KnownNorm(SharedNorm):
    """A ``SharedNorm`` whose forward value is given (``_map_out``'s ``r``)."""

    __slots__ = ()

    def __init__(self, r: Tensor) -> None:
        super().__init__()
        self._forward = r


def _side_weights(metric: str, leaves: Sequence[Tensor]) -> fn.SideWeights:
    return fn.SideWeights(metric, *leaves)


def _split_leaves(sides: Sequence[SideBlocks], leaves: Sequence[Tensor]) -> list[tuple[int, int]]:
    """(start, stop) of each side's tensors in ``leaves``."""
    out, k = [], 0
    for blocks in sides:
        out.append((k, k + _LEAVES[blocks.metric]))
        k += _LEAVES[blocks.metric]
    assert k == len(leaves)
    return out


def project(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    """The projection as the host computes it: ``nn.Linear`` (weight (out, in))
    or, ``transposed``, transformers' ``Conv1D`` (weight (in, out): one
    ``addmm`` on the flattened tokens), so the outputs are the host's bit for bit."""
    if not transposed:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    y = flat.mm(weight) if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


class FusedProjectionMaps(torch.autograd.Function):
    """The projection (``project``) with the maps of ``sides`` applied to its
    blocks, saving only x, weight and bias (see the module docstring).

    ``apply(sides, transposed, scaling, norm, x, weight, bias, lora_a,
    lora_b, *leaves)``: ``sides`` a tuple of ``SideBlocks``; ``transposed`` False for
    an ``nn.Linear`` weight (out, in), True for a ``Conv1D`` weight (in, out);
    ``norm`` a ``SharedNorm`` of x shared with other sites, or None;
    ``lora_a`` (r, in) and ``lora_b`` (out, r), or both None: a LoRA update
    added as PEFT adds it, y = P(x) + (x A^T B^T) * ``scaling``; ``leaves`` the
    ``side_leaves`` of each side in that order (the generator's
    ``nn.Linear``-layout weight (S*S, E) or (r, E), bias (S*S,) or (r,), the
    layer's gate (S,), and for "lowrank" u, v (S, d, r)).
    float32/float64, no autocast (the caller checks).
    """

    @staticmethod
    def forward(
        ctx: Any,
        sides: tuple[SideBlocks, ...],
        transposed: bool,
        scaling: float,
        norm: SharedNorm | None,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        lora_a: Tensor | None,
        lora_b: Tensor | None,
        *leaves: Tensor,
    ) -> Tensor:
        return _fused_forward(ctx, None, (sides, transposed, scaling, x, weight, bias, lora_a, lora_b, leaves), norm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _fused_backward(ctx, grad, 0)


def _project(args: tuple) -> Tensor:
    """The projection of ``FusedProjectionMaps``' arguments ``args``, with its LoRA update."""
    _, transposed, scaling, x, weight, bias, lora_a, lora_b, _ = args
    y = project(x, weight, bias, transposed)
    if lora_a is not None and lora_b is not None:
        y = y + F.linear(F.linear(x, lora_a), lora_b) * scaling  # PEFT's own expression, bit for bit
    return y


def _mapped_copy(
    y: Tensor, x: Tensor, sides: tuple[SideBlocks, ...], leaves: Sequence[Tensor], r: Tensor | None = None
) -> tuple[Tensor, tuple[Tensor, list[Tensor]] | None]:
    """(out, kept): the mapped output as a new tensor, y left as it is
    (float32/float64, no autocast: the fused node's case), the same bits as
    ``_map_out`` on a copy of y. Metric "heads": each run of mapped blocks
    written once, as y_run + bmm(mix, y_run) into its columns of a new
    tensor, and only the unmapped columns copied from y (a clone and an
    in-place add passed over the mapped columns twice more), and kept the
    generator's (r, [P = t W^T per side]) it was mapped with; "lowrank":
    ``_map_out`` on a clone, None."""
    if any(b.metric != "heads" or b.groups > 1 for b in sides) or not y.is_contiguous():
        return _map_out(y.clone(), x, sides, leaves, r), None
    out = torch.empty_like(y)
    flat, out_flat = y.view(-1, y.shape[-1]), out.view(-1, y.shape[-1])
    t = x.reshape(-1, x.shape[-1])
    if r is None:
        r = fn._rms_denominator(t)
    written: list[tuple[int, int]] = []
    kept = []
    for blocks, (i, j) in zip(sides, _split_leaves(sides, leaves)):
        weights = _side_weights(blocks.metric, leaves[i:j])
        # coefficients()' ops, with P kept.
        P = F.linear(t, weights.weight)
        A = fn.coefficients_of(P, r, weights.bias, t.shape[-1])
        kept.append(P)
        mixes: dict[int, Tensor] = {}
        for offset, n in _runs(blocks):
            mix = mixes.get(n)
            if mix is None:
                mix = mixes[n] = _run_mix(A, weights.gate, n)
            part = _block(flat, offset, n * blocks.heads, blocks.head_dim)
            torch.add(part, torch.bmm(mix, part), out=_block(out_flat, offset, n * blocks.heads, blocks.head_dim))
            written.append((offset, offset + n * blocks.heads * blocks.head_dim))
    at = 0
    for start, stop in sorted(written) + [(y.shape[-1], y.shape[-1])]:
        if start > at:
            out_flat[:, at:start].copy_(flat[:, at:start])
        at = max(at, stop)
    return out, (r, kept)


def _map_out(
    out: Tensor, x: Tensor, sides: tuple[SideBlocks, ...], leaves: Sequence[Tensor], r: Tensor | None = None
) -> Tensor:
    spans = _split_leaves(sides, leaves)
    weights = [(b, _side_weights(b.metric, leaves[i:j])) for b, (i, j) in zip(sides, spans)]
    return map_blocks_(out, x, weights, merge=True, norm=None if r is None else _KnownNorm(r))


def _fused_forward(ctx: Any, recipe: OutputRecipe | None, args: tuple, norm: SharedNorm | None) -> Tensor:
    sides, transposed, scaling, x, weight, bias, lora_a, lora_b, leaves = args
    ctx.sides, ctx.transposed, ctx.scaling, ctx.recipe, ctx.norm = sides, transposed, scaling, recipe, norm
    ctx.save_for_backward(x, weight, bias, lora_a, lora_b, *leaves)
    r = None if norm is None else norm.forward(x.reshape(-1, x.shape[-1]))
    y = _project(args)
    if recipe is None:
        return _map_out(y, x, sides, leaves, r)
    # Store mode: the mapped output is a copy, y stays unmapped (kept by the
    # recipe, with the generator's product P and the norm r, so that backward
    # runs no generator GEMM and no norm of the tokens again: S*S + 1 floats
    # a token and side, as MapRecipes keeps them; A is made again from them).
    out, kept = _mapped_copy(y, x, sides, leaves, r)
    recipe._keep(out, y, args, kept)
    return out


def _fused_backward(ctx: Any, grad: Tensor, first: int) -> tuple[Tensor | None, ...]:
    """``FusedProjectionMaps.backward`` (``first``: the index of its argument
    ``sides`` among the node's arguments; ``StoredProjectionMaps`` has one more)."""
    x, weight, bias, lora_a, lora_b, *leaves = ctx.saved_tensors
    sides: tuple[SideBlocks, ...] = ctx.sides
    transposed: bool = ctx.transposed
    scaling: float = ctx.scaling
    recipe: OutputRecipe | None = ctx.recipe
    norm: SharedNorm | None = ctx.norm
    need_x, need_w, need_b, need_la, need_lb = ctx.needs_input_grad[first + 4 : first + 9]
    need_leaves = ctx.needs_input_grad[first + 9 :]
    features = weight.shape[1 if transposed else 0]
    t = x.reshape(-1, x.shape[-1])
    g = grad.reshape(-1, features)
    state = None if recipe is None else recipe.stored()
    h = None
    if lora_a is not None and lora_b is not None:
        h = F.linear(t, lora_a)  # (T, r): recomputed, as cheap as storing it
    # Under create_graph the stored y carries no graph: projected again, differentiably.
    reuse = state is not None and state.y is not None and not torch.is_grad_enabled()
    made = None
    made_mixes: dict[tuple[int, int], Tensor] = {}
    if reuse:
        # Store mode: the projection's output as the forward made it (LoRA
        # update included), and the generator's products the output was made
        # again with in the kernel's backward.
        assert state is not None and state.y is not None
        y, lo = state.y.view(-1, features), 0
        made, state.products = state.products, None
        if made is None and state.kept is not None:  # no view of a mapped run was saved
            made = _coefficient_products(x, sides, leaves, state.kept)
        state.kept = None
        made_mixes, state.mixes = state.mixes, {}
    elif sides[0].groups > 1:
        # An interleaved output (one site: every side has its groups): the
        # columns lo:hi of each run that hold mapped heads (GPT-NeoX's queries
        # and keys, not its values; Qwen3-Next's queries, not its gates), one
        # GEMM on those rows of the weight, gathered (a copy of them, small
        # next to the product, which then skips every unmapped row).
        groups = sides[0].groups
        run = features // groups
        lo = min(o for b in sides for o in b.offsets)
        hi = max(o + b.head_dim for b in sides for o in b.offsets)

        def pick(m: Tensor, dim: int) -> Tensor:
            """Columns lo:hi of every run, along m's dimension ``dim`` of F entries."""
            return m.unflatten(dim, (groups, run)).narrow(dim + 1, lo, hi - lo).flatten(dim, dim + 1)

        y = project(t, pick(weight, 1 if transposed else 0), None if bias is None else pick(bias, 0), transposed)
        if h is not None:
            assert lora_b is not None
            y = y + F.linear(h, pick(lora_b, 0)) * scaling
    else:
        # The rows of the projection that hold mapped heads: one GEMM on them.
        starts = [o for b in sides for o in b.offsets]
        ends = [o + b.heads * b.head_dim for b in sides for o in b.offsets]
        lo, hi = min(starts), max(ends)
        rows = weight[:, lo:hi] if transposed else weight[lo:hi]  # a strided view: BLAS reads it in place
        y = project(t, rows, None if bias is None else bias[lo:hi], transposed)
        if h is not None:
            assert lora_b is not None
            y = y + F.linear(h, lora_b[lo:hi]) * scaling
    # dL/dy, in pieces that tile its columns: each mapped block's gradient
    # (the incoming one plus mix^T g_b, one baddbmm into a fresh block) and
    # strided views of the incoming gradient between them. The consumers
    # below (dx, dW, db, LoRA) take the pieces one by one, so dL/dy is never
    # assembled: no copy of the (T, F) gradient (a clone, or a cat of blocks).
    pieces: list[tuple[int, Tensor]] = []
    # An interleaved site's dL/dy, one tensor (its mapped heads' columns alternate with the others').
    dy: Tensor | None = None
    leaf_grads: list[Tensor | None] = [None] * len(leaves)
    through_generator: list[tuple[Tensor, Tensor, Tensor]] = []  # (dP, generator weight, c): dL/dt += dP W + c t
    # The generator's products: those the recipe made the output again with
    # (store mode), or made here as the forward made them (the same mix, bit for bit).
    r = made[0] if made else (fn._rms_denominator(t) if norm is None else norm.backward(t))
    for i, (blocks, (k, k_end)) in enumerate(zip(sides, _split_leaves(sides, leaves))):
        w_gen, b_gen, gate = leaves[k : k + 3]
        need = need_leaves[k:k_end]
        S = blocks.heads
        if made:
            P, A = made[1][i]
        else:
            P = F.linear(t, w_gen)
            A = fn.coefficients_of(P, r, b_gen, t.shape[-1])
        if blocks.groups > 1:
            if dy is None:
                dy = g.clone(memory_format=torch.contiguous_format)
            dA, leaf_grads[k + 2] = _heads_mix_grads(
                _interleaved_backward(blocks, _run_mix(A, gate, 1), g, y, lo, dy), A, gate, need[2]
            )
        elif blocks.metric == "heads":
            # One baddbmm per run of adjacent blocks (the run's dL/dy, fresh),
            # as the forward mapped it (_run_mix); dL/d(mix) one bmm per block
            # (a run's (T, n*S, n*S) product g y^T measured slower than n
            # (T, S, S) ones: its off-diagonal blocks are n^2 - n wasted ones).
            mixes: dict[int, Tensor] = {}
            dmix: Tensor | None = None
            d = blocks.head_dim
            for offset, n in _runs(blocks):
                mix_t = mixes.get(n)
                if mix_t is None:
                    mix = made_mixes.get((i, n))
                    mix_t = mixes[n] = (_run_mix(A, gate, n) if mix is None else mix).transpose(1, 2)
                gb = _block(g, offset, n * S, d)
                pieces.append((offset, torch.baddbmm(gb, mix_t, gb).flatten(1)))
                for at in range(offset, offset + n * S * d, S * d):
                    part = torch.bmm(_block(g, at, S, d), _block(y, at - lo, S, d).transpose(1, 2))
                    dmix = part if dmix is None else dmix.add_(part)
            assert dmix is not None  # a side has at least one block
            dA, leaf_grads[k + 2] = _heads_mix_grads(dmix, A, gate, need[2])
        else:
            dA = _lowrank_backward(blocks, leaves[k:k_end], need, A, g, y, lo, pieces, leaf_grads, k)
        leaf_grads[k], leaf_grads[k + 1] = _generator_grads(
            dA, P, r, t, w_gen, need[0], need[1], need_x, through_generator
        )
    if dy is not None:
        pieces.append((0, dy))
    pieces = _tile(pieces, g)
    dx = dW = db = d_la = d_lb = None
    # The LoRA update's gradients: dL/d(x A^T) = s dy B.
    dh = None
    if lora_b is not None and (need_x or need_la):
        dh = _sum_mm(pieces, lambda a, b: lora_b[a:b]).mul_(scaling)
    if need_la:
        assert dh is not None
        d_la = dh.t().mm(t)
    if need_lb:
        assert h is not None
        d_lb = _cat([dp.t().mm(h) for _, dp in pieces], 0) * scaling
    if need_x:
        dx = _sum_mm(pieces, (lambda a, b: weight[:, a:b].t()) if transposed else (lambda a, b: weight[a:b]))
        if dh is not None:
            assert lora_a is not None
            dx.addmm_(dh, lora_a)
        for dP, w_gen, c in through_generator:
            dx.addmm_(dP, w_gen).addcmul_(t, c)
        dx = dx.view_as(x)
    if need_w:
        dW = _joined_mm(pieces, t, transposed)
    if need_b:
        db = _joined_sum(pieces)
    return (*[None] * (first + 4), dx, dW, db, d_la, d_lb, *leaf_grads)


def _interleaved_backward(blocks: SideBlocks, mix: Tensor, g: Tensor, y: Tensor, lo: int, dy: Tensor) -> Tensor:
    """An interleaved side's part of the fused node's backward: adds mix^T g_b
    to each run's heads of dL/dy ``dy`` (T, F; g already in it) and returns
    dL/d(mix) (T, S, S) = sum of g_b y_b^T over the runs, y the projection's
    columns lo:hi of each run (``groups`` runs of hi - lo). The batched
    products read the heads' strided views in place, as in ``_map_interleaved_``."""
    S, stride, y_stride = blocks.heads, g.shape[1] // blocks.groups, y.shape[1] // blocks.groups
    mix_t = mix.transpose(1, 2)
    dmix: Tensor | None = None
    for offset, n in _interleaved_runs(blocks):
        width = n * blocks.head_dim
        gb = _interleaved(g, offset, S, width, stride)
        _interleaved(dy, offset, S, width, stride).add_(torch.bmm(mix_t, gb))
        part = torch.bmm(gb, _interleaved(y, offset - lo, S, width, y_stride).transpose(1, 2))
        dmix = part if dmix is None else dmix.add_(part)
    assert dmix is not None  # a side has at least one block
    return dmix


def _tile(pieces: list[tuple[int, Tensor]], g: Tensor) -> list[tuple[int, Tensor]]:
    """``pieces`` (offset, (T, width) gradient of the mapped block there), in
    column order, with the columns of ``g`` (T, F) that no block covers added
    as strided views: the pieces of dL/dy, tiling its F columns."""
    out: list[tuple[int, Tensor]] = []
    at = 0
    for offset, piece in sorted(pieces, key=lambda p: p[0]):
        if offset > at:
            out.append((at, g[:, at:offset]))
        out.append((offset, piece))
        at = offset + piece.shape[1]
    if at < g.shape[1]:
        out.append((at, g[:, at:]))
    return out


def _sum_mm(pieces: list[tuple[int, Tensor]], rows: Any) -> Tensor:
    """dy M for dy given by its column ``pieces`` and M by ``rows(a, b)`` (its
    rows a:b): one GEMM per piece, accumulated in place (BLAS reads strided views)."""
    out: Tensor | None = None
    for offset, piece in pieces:
        m = rows(offset, offset + piece.shape[1])
        out = piece.mm(m) if out is None else out.addmm_(piece, m)
    assert out is not None
    return out


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    """The parameter gradients of the pieces, joined (no copy for a single piece)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _joined_mm(pieces: list[tuple[int, Tensor]], t: Tensor, transposed: bool) -> Tensor:
    """The weight gradient dy^T t ((F, E); ``transposed``: t^T dy, (E, F)) of
    dy given by its column ``pieces`` and the tokens t (T, E): each piece's
    GEMM writes its rows (columns) of one gradient tensor in place (BLAS
    writes a strided block), so the pieces are never joined by a copy. Under
    a graph (``create_graph``; ``out=`` is not differentiable) a ``cat`` of
    the pieces' GEMMs."""
    if len(pieces) == 1 or torch.is_grad_enabled():
        if transposed:
            return _cat([t.t().mm(dp) for _, dp in pieces], 1)
        return _cat([dp.t().mm(t) for _, dp in pieces], 0)
    widths = [dp.shape[1] for _, dp in pieces]
    E = t.shape[1]
    out = t.new_empty((E, sum(widths)) if transposed else (sum(widths), E))
    # One split of the result into the pieces' blocks (one op, not a slice each).
    for (_, dp), block in zip(pieces, out.split_with_sizes(widths, dim=1 if transposed else 0)):
        if transposed:
            torch.mm(t.t(), dp, out=block)
        else:
            torch.mm(dp.t(), t, out=block)
    return out


def _joined_sum(pieces: list[tuple[int, Tensor]]) -> Tensor:
    """The bias gradient (F,): each piece's column sums written in place into
    one tensor (a ``cat`` of them under a graph, as ``_joined_mm``)."""
    if len(pieces) == 1 or torch.is_grad_enabled():
        return _cat([dp.sum(0) for _, dp in pieces], 0)
    widths = [dp.shape[1] for _, dp in pieces]
    out = pieces[0][1].new_empty(sum(widths))
    for (_, dp), block in zip(pieces, out.split_with_sizes(widths)):
        torch.sum(dp, 0, out=block)
    return out


def _lowrank_backward(
    blocks: SideBlocks,
    leaves: Sequence[Tensor],
    need: Sequence[bool],
    A: Tensor,
    g: Tensor,
    y: Tensor,
    lo: int,
    pieces: list[tuple[int, Tensor]],
    leaf_grads: list[Tensor | None],
    k: int,
) -> Tensor:
    """Metric "lowrank"'s part of ``FusedProjectionMaps.backward`` for one side:
    out_b = y_b + (A * (y_b V)) U_g^T on each block. Appends each block's
    dL/dy_b = g_b + ((g_b U_g) * A) V^T to ``pieces`` (a fresh tensor), writes
    the gradients of u, v and the gate into ``leaf_grads[k + 2 : k + 5]``
    and returns dL/dA (T, r)."""
    _, _, gate, u, v = leaves
    S, width = blocks.heads, blocks.heads * blocks.head_dim
    V, U = lowrank_factors(fn.SideWeights("lowrank", leaves[0], leaves[1], gate, u, v))
    need_gate, need_u, need_v = need[2], need[3], need[4]
    dA: Tensor | None = None
    dU: Tensor | None = None
    dV: Tensor | None = None
    for offset in blocks.offsets:
        gb = g[:, offset : offset + width]
        yb = y[:, offset - lo : offset - lo + width]
        z = yb.mm(V)
        dm = gb.mm(U)  # dL/d(A * z)
        dz = dm * A
        pieces.append((offset, torch.addmm(gb, dz, V.t())))
        dc = dm * z
        dA = dc if dA is None else dA.add_(dc)
        if need_gate or need_u:
            part = gb.t().mm(A * z)
            dU = part if dU is None else dU.add_(part)
        if need_v:
            part = yb.t().mm(dz)
            dV = part if dV is None else dV.add_(part)
    assert dA is not None  # a side has at least one block
    if dV is not None:
        leaf_grads[k + 4] = dV.view_as(v)
    if dU is not None:
        dU = dU.view_as(u)  # U_g = u * gate per head
        if need_u:
            leaf_grads[k + 3] = dU * gate.view(S, 1, 1)
        if need_gate:
            leaf_grads[k + 2] = (dU * u).sum((1, 2))
    return dA


def _heads_mix_grads(dmix: Tensor, A: Tensor, gate: Tensor, need_gate: bool) -> tuple[Tensor, Tensor | None]:
    """(dL/dA (T, S*S), dL/dgate or None) of one "heads" side from dL/dmix (T, S, S),
    where mix = diag(gate) A."""
    S = gate.shape[0]
    dA = (dmix * gate.view(S, 1)).view(-1, S * S)
    d_gate = (dmix.view(-1, S * S) * A).sum(0).view(S, S).sum(1) if need_gate else None
    return dA, d_gate


def _generator_grads(
    dA: Tensor,
    P: Tensor,
    r: Tensor,
    t: Tensor,
    w_gen: Tensor,
    need_w_gen: bool,
    need_b_gen: bool,
    need_x: bool,
    through_generator: list[tuple[Tensor, Tensor, Tensor]],
) -> tuple[Tensor | None, Tensor | None]:
    """The generator's (weight, bias) gradients from dL/dA, written out (every
    metric structure: its generator is the same): A = b + s P / r with
    P = t W^T, r = sqrt(|t|^2 + E eps), s = sqrt(E). With ``need_x`` the
    tokens' share, dL/dt += dP W + c t, is appended to ``through_generator``
    as (dP, W, c)."""
    scale = math.sqrt(t.shape[-1])
    d_w = d_b = None
    if need_b_gen:
        d_b = dA.sum(0)
    if need_w_gen or need_x:
        dP = dA * (scale / r)
        if need_w_gen:
            d_w = dP.t().mm(t)
        if need_x:
            # through r: dL/dr = -s sum(dA P) / r^2, dr/dt = t / r
            c = (dA * P).sum(-1, keepdim=True).mul_(-scale) / (r * r * r)
            through_generator.append((dP, w_gen, c))
    return d_w, d_b


class MapRecipes:
    """The store mode of ``SplitLinearMaps``: what its mapped blocks are made of.

    In store mode the node returns each mapped block (q~ or k~, (T, S, d)) as
    a fresh tensor and keeps the projection's output y unmapped, so its
    backward reads y instead of projecting again. A consumer that would save
    a mapped block for its own backward (SDPA saves q~ and k~) saves this
    recipe of it instead (``saved_as_recipes``): the block is made again in
    backward from y and the generator's product P = t W^T (T, S*S) and norm
    r (T, 1) of the forward, which the recipes keep (a few elementwise passes
    over P and one small ``baddbmm``: no generator GEMM, no pass over the
    tokens), and y is stored where nn.MultiheadAttention stores q
    and k. The generator's coefficients made then are kept until the node's
    backward, which reads them (``coefficients``) and lets them go
    (``release``). Never holds a mapped block itself (that is what it saves).
    """

    __slots__ = ("_blocks", "_coefficients", "_products", "_state", "hits")

    def __init__(self) -> None:
        # A mapped block's storage (its data pointer) -> (side index, offset, bytes).
        self._blocks: dict[int, tuple[int, int, int]] = {}
        self._coefficients: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        # Side index -> (P = t W^T (T, S*S), r (T, 1)) of the forward: kept, so
        # backward runs no generator GEMM and no norm of the tokens again
        # (S*S + 1 floats per token and side: 1/8 of a (T, E) activation at
        # E = 512, H = 8; A and diag(g) A are made again from them, elementwise).
        self._products: dict[int, tuple[Tensor, Tensor]] = {}
        self._state: tuple[Tensor, Tensor | None, tuple[SideBlocks, ...], tuple[Tensor, ...]] | None = None
        self.hits = 0  # blocks a consumer saved as their recipe (tests read it)

    def _add(self, block: Tensor, side: int, offset: int) -> None:
        storage = block.untyped_storage()
        self._blocks[storage.data_ptr()] = (side, offset, storage.nbytes())

    def _keep(self, x: Tensor, y: Tensor | None, sides: tuple[SideBlocks, ...], leaves: tuple[Tensor, ...]) -> None:
        self._state = (x, y, sides, leaves)

    def _pack(self, t: Tensor, storage: torch.UntypedStorage) -> Any:
        """The recipe of ``t`` if it lies in a mapped block; else None."""
        found = self._blocks.get(storage.data_ptr())
        if found is None or found[2] != storage.nbytes():
            return None
        return _Packed(self, found[0], found[1], t.size(), t.stride(), t.storage_offset(), self._state)

    def coefficients(self, side: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(P = t W^T, r, A, diag(g) A) of side ``side`` for the tokens t (T, E),
        computed as the forward computed them (the same mix, bit for bit)."""
        out = self._coefficients.get(side)
        if out is None:
            assert self._state is not None
            x, _, sides, leaves = self._state
            t = x.reshape(-1, x.shape[-1])
            w_gen, b_gen, gate = leaves[3 * side : 3 * side + 3]
            S = sides[side].heads
            kept = self._products.get(side)
            if kept is not None:
                P, r = kept
            else:
                known = next(iter(self._coefficients.values()), None)
                r = fn._rms_denominator(t) if known is None else known[1]
                P = F.linear(t, w_gen)
            A = fn.coefficients_of(P, r, b_gen, t.shape[-1])
            out = self._coefficients[side] = (P, r, A, A.view(-1, S, S) * gate.view(S, 1))
        return out

    def block(self, side: int, offset: int) -> Tensor:
        """The mapped block at ``offset`` (T, S, d), made again as the forward made it."""
        assert self._state is not None
        _, y, sides, _ = self._state
        assert y is not None  # a block is made again only when its recipe was saved (then settle keeps y)
        mix = self.coefficients(side)[3]
        yb = _block(y, offset, sides[side].heads, sides[side].head_dim)
        return torch.baddbmm(yb, mix, yb)

    def release(self) -> None:
        """After the node's backward: what the kernel's backward handed over goes."""
        self._coefficients.clear()
        self._state = None
        self._products.clear()

    def settle(self) -> None:
        """After the consumer's forward. From here the saved recipes alone keep
        y (and the tokens): autograd frees them with the consumer's saved
        tensors (after its backward, unless ``retain_graph``), and a recipe made
        again in backward hands them to the node's backward (``release`` lets
        them go), so nothing of them outlives the backward while the graph
        object does (a loss kept alive). If the consumer saved none of the
        blocks as their recipe (a kernel that saves copies, or nothing), y goes
        now and the node's backward projects the mapped rows again. The
        generator's products stay here until ``release`` (or go now with y)."""
        self._state = None
        if self.hits == 0:
            self._products.clear()

    def stored(self) -> Tensor | None:
        """The projection's output y (T, F), unmapped, or None (see ``settle``)."""
        return None if self._state is None else self._state[1]


class OutputRecipe:
    """The store mode of ``FusedProjectionMaps`` (``StoredProjectionMaps``):
    what its mapped output is made of.

    A converted host (GPT-2, BERT, a timm ViT) saves views of the projection's
    output for its attention kernel's backward (SDPA's q~, k~, v, a q/k norm's
    input), and the node's backward needs the unmapped output y. In store mode
    the node returns the mapped output as a copy of y (mapped in place, as
    ``map_blocks_`` maps it) and keeps y; under ``saved_as_recipes`` (opened
    by ``DamchaMaps`` after the node, closed when the host's attention module
    returns) every saved view of that output is saved as this recipe
    instead, so autograd keeps y where the original model kept the output,
    and backward makes each view again (``_view``: a view within a mapped
    "heads" block from that block alone, y_b + diag(g) A(t) y_b with the
    forward's ops; a view of unmapped columns, such as SDPA's v, read from y
    in place; otherwise the whole output again, a copy of y and the maps),
    instead of projecting the mapped rows again.

    Who keeps y: until ``settle`` (when the attention module returns) this
    recipe; then only the saved views' recipes (so autograd frees y with
    them, after the kernel's backward, unless ``retain_graph``); a kernel's
    backward hands y to the node's backward, which reads it and lets it go.
    ``settle`` with no view saved as the recipe (a host that saves nothing of
    the output, e.g. a rotary one whose kernel saves q and k after RoPE) lets
    y go, and the node's backward projects again, as without store mode; so
    too if the output is still referenced elsewhere (then it stays alive
    anyway, and is the recipe).
    """

    __slots__ = ("_handoff", "_out", "_state", "_storage", "_version", "hits")

    def __init__(self) -> None:
        self._state: _OutputState | None = None  # until settle
        self._out: Tensor | None = None  # until settle, so its storage's address stays its own
        self._storage = (0, 0)  # (data pointer, bytes) of the output's storage
        self._version = 0
        self._handoff: _OutputState | None = None  # from the kernel's backward to the node's
        self.hits = 0

    def _keep(self, out: Tensor, y: Tensor, args: tuple, kept: tuple[Tensor, list[Tensor]] | None) -> None:
        storage = out.untyped_storage()
        self._storage = (storage.data_ptr(), storage.nbytes())
        self._out, self._version, self._state = out, out._version, _OutputState(y, args)
        self._state.kept = kept

    def _pack(self, t: Tensor, storage: torch.UntypedStorage) -> Any:
        """The recipe of ``t`` if it is a view of the output, unmodified since
        the node made it; else None."""
        if self._state is None or (storage.data_ptr(), storage.nbytes()) != self._storage:
            return None
        if t._version != self._version:
            return None
        state = self._state
        size, stride, storage_offset = t.size(), t.stride(), t.storage_offset()
        found = None if state.y is None else _columns(state.y, state.args[0], size, stride, storage_offset)
        if found is not None and found[0] is not None:
            key = (state.args[0].index(found[0]), found[1])
            state.run_views[key] = state.run_views.get(key, 0) + 1
        return _PackedOutput(self, state, size, stride, storage_offset, found)

    def _made(self, state: _OutputState) -> Tensor:
        """The mapped output (..., F), made again as the forward made it, bit for bit."""
        if torch.is_grad_enabled():
            # A backward that builds a graph (create_graph): made with one.
            return FusedProjectionMaps.apply(*state.args[:3], None, *state.args[3:8], *state.args[8])
        if state.out is not None:  # settle found the output held elsewhere
            return state.out
        self._handoff = state
        if state.made is None:
            assert state.y is not None
            sides, x, leaves = state.args[0], state.args[3], state.args[8]
            state.made, state.products = _remap(state.y.clone(), x, sides, leaves)
            state.pending = self.hits
        out = state.made
        state.pending -= 1
        if state.pending <= 0:  # the last saved view read (a retain_graph backward makes it again)
            state.made = None
        return out

    def _view(self, packed: _PackedOutput) -> Tensor:
        """The saved view ``packed`` of the mapped output, made again as the
        forward made it, bit for bit. A view within one mapped block of metric
        "heads" is made from that block alone (y_b + bmm(diag(g) A(t), y_b),
        the forward's ops on a view of y laid out as the output was); a view
        of unmapped columns is the same view of y (the output's copy of them);
        anything else, from the whole output made again (``_made``)."""
        state = packed.state
        found = packed.found
        if not torch.is_grad_enabled() and state.out is None and state.y is not None and found is not None:
            self._handoff = state
            blocks, offset, size, stride, storage_offset = found
            if blocks is None:  # unmapped columns: the output holds y's values there
                return state.y.as_strided(size, stride, storage_offset)
            return self._run(state, blocks, offset).as_strided(size, stride, storage_offset)
        return self._made(state).as_strided(packed.size, packed.stride, packed.storage_offset)

    @staticmethod
    def _run(state: _OutputState, blocks: SideBlocks, offset: int) -> Tensor:
        """The run of mapped blocks of ``blocks`` at ``offset``, (T, n*S, d),
        made again alone as the forward made it (y_run + bmm(``_run_mix``,
        y_run), bit for bit), once for the saved views that lie in it (SDPA's
        q~ and k~ of a fused qkv: one product for both), kept until the last
        of them is read."""
        sides, x, leaves = state.args[0], state.args[3], state.args[8]
        i = sides.index(blocks)
        key = (i, offset)
        kept = state.runs.pop(key, None)
        if kept is None:
            assert state.y is not None
            r, products = state.products or _coefficient_products(x, sides, leaves, state.kept)
            state.products, state.kept = (r, products), None
            n = dict(_runs(blocks))[offset]
            mix = state.mixes.get((i, n))
            if mix is None:  # kept for the node's backward, which maps its gradient with it
                mix = state.mixes[i, n] = _run_mix(products[i][1], _split_side(sides, leaves, i).gate, n)
            yb = _block(state.y.view(-1, state.y.shape[-1]), offset, n * blocks.heads, blocks.head_dim)
            kept = (torch.add(yb, torch.bmm(mix, yb)), state.run_views.get(key, 1))
        run, left = kept
        if left > 1:
            state.runs[key] = (run, left - 1)
        return run

    def settle(self) -> None:
        """When the attention module returns (see the class docstring)."""
        out, state, self._out, self._state = self._out, self._state, None, None
        if state is not None and self.hits and out is not None and _held_elsewhere(out):
            state.y, state.out, state.kept = None, out, None

    def stored(self) -> _OutputState | None:
        """For the node's backward: what a kernel's backward handed over (the
        projection's output y, unmapped, and the generator's products the
        output was made again with), or None (then it projects again)."""
        state, self._handoff = self._handoff, None
        return state


class _OutputState:
    __slots__ = ("args", "kept", "made", "mixes", "out", "pending", "products", "run_views", "runs", "y")

    def __init__(self, y: Tensor, args: tuple) -> None:
        self.y: Tensor | None = y
        self.args = args
        self.out: Tensor | None = None
        self.made: Tensor | None = None
        self.pending = 0
        # (r, [(P, A) per side]) of the last remake, for the node's backward.
        # (r, [P per side]) of the forward (``_mapped_copy``), until the
        # output is made again in backward (``_coefficient_products``).
        self.kept: tuple[Tensor, list[Tensor]] | None = None
        self.products: tuple[Tensor, list[tuple[Tensor, Tensor]]] | None = None
        # (side index, run length) -> the run's mix (``_run_mix``) made by
        # ``_run`` in backward, for the node's backward.
        self.mixes: dict[tuple[int, int], Tensor] = {}
        # (side index, run offset) -> the saved views that lie in that run of
        # mapped blocks, and the run made again in backward with the views
        # still to read from it (``OutputRecipe._run``).
        self.run_views: dict[tuple[int, int], int] = {}
        self.runs: dict[tuple[int, int], tuple[Tensor, int]] = {}


def _columns(
    y: Tensor, sides: tuple[SideBlocks, ...], size: Any, strides: Any, storage_offset: Any
) -> tuple[SideBlocks | None, int, Any, Any, Any] | None:
    """Where a saved view (``size``, ``strides``, ``storage_offset``) of the
    output (laid out as y (..., F), contiguous) lies: (the side's blocks, the
    offset of the run of adjacent blocks (``_runs``) it lies in, and the
    view's size, stride and storage offset within that run made alone
    (T, n*S*d)) when it lies within one run of mapped blocks of metric
    "heads"; (None, 0, and the view's own geometry, read from y) when it lies
    in unmapped columns only; None otherwise (a view across runs, a strided
    layout this does not read)."""
    F_ = y.shape[-1]
    if not y.is_contiguous() or y.storage_offset() != 0 or not isinstance(storage_offset, int):
        return None
    first, row = storage_offset % F_, storage_offset // F_
    extent = 0  # the last column the view reaches, from its first
    rows: list[bool] = []
    for n, st in zip(size, strides):
        if not isinstance(n, int) or not isinstance(st, int):
            return None  # symbolic sizes (a tracer): the whole output
        rows.append(st % F_ == 0)
        if n > 1 and not rows[-1]:
            if st >= F_:
                return None
            extent += (n - 1) * st
    last = first + extent
    if last >= F_:
        return None
    for blocks in sides:
        for offset, n_blocks in _runs(blocks):
            width = n_blocks * blocks.heads * blocks.head_dim
            if offset <= first and last < offset + width:
                if blocks.metric != "heads":
                    return None
                stride = tuple(st // F_ * width if by_row else st for st, by_row in zip(strides, rows))
                return blocks, offset, size, stride, row * width + first - offset
            if first < offset + width and offset <= last:
                return None  # partly in a mapped run
    return None, 0, size, strides, storage_offset


def _split_side(sides: tuple[SideBlocks, ...], leaves: Sequence[Tensor], i: int) -> fn.SideWeights:
    """The weights of side ``i`` from the fused node's ``leaves``."""
    k, k_end = _split_leaves(sides, leaves)[i]
    return _side_weights(sides[i].metric, leaves[k:k_end])


def _coefficient_products(
    x: Tensor, sides: tuple[SideBlocks, ...], leaves: Sequence[Tensor], kept: tuple[Tensor, list[Tensor]] | None = None
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """(r, [(P = t W^T, A) per side]) of the tokens x, as ``_remap`` makes
    them; r and P those ``kept`` by the forward if given (then only A is made)."""
    t = x.reshape(-1, x.shape[-1])
    r = fn._rms_denominator(t) if kept is None else kept[0]
    products = []
    for i in range(len(sides)):
        weights = _split_side(sides, leaves, i)
        P = F.linear(t, weights.weight) if kept is None else kept[1][i]
        products.append((P, fn.coefficients_of(P, r, weights.bias, t.shape[-1])))
    return r, products


def _remap(
    out: Tensor, x: Tensor, sides: tuple[SideBlocks, ...], leaves: Sequence[Tensor]
) -> tuple[Tensor, tuple[Tensor, list[tuple[Tensor, Tensor]]]]:
    """``_map_out`` (float32/float64, no autocast: the fused node's case) with
    ``map_blocks_``' ops, bit for bit, returning also the generator's products
    (r, [(P = t W^T, A) per side]) for the node's backward."""
    t = x.reshape(-1, x.shape[-1])
    flat = out.view(-1, out.shape[-1])
    r = fn._rms_denominator(t)
    products = []
    for blocks, (i, j) in zip(sides, _split_leaves(sides, leaves)):
        weights = _side_weights(blocks.metric, leaves[i:j])
        P = F.linear(t, weights.weight)
        A = fn.coefficients_of(P, r, weights.bias, t.shape[-1])
        products.append((P, A))
        if blocks.metric == "heads":
            _map_runs_(flat, blocks, A, weights.gate)
        else:
            v, u = lowrank_factors(weights)
            width = blocks.heads * blocks.head_dim
            for offset in blocks.offsets:
                part = flat[:, offset : offset + width]
                part.addmm_(A * part.mm(v), u.t())
    return out, (r, products)


class _PackedOutput(NamedTuple):
    recipe: OutputRecipe
    state: _OutputState
    size: torch.Size
    stride: Any
    storage_offset: Any
    found: tuple[SideBlocks | None, int, Any, Any, Any] | None  # _columns of the view


def _held_elsewhere(t: Tensor) -> bool:
    """Whether anything but ``t`` itself refers to its storage (a view kept by the host)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return True  # cannot tell: the safe answer
    storage = t.untyped_storage()  # one reference more while it lives
    return bool(counter(storage._cdata) > 2)


class StoredProjectionMaps(torch.autograd.Function):
    """``FusedProjectionMaps`` in store mode: ``apply(recipe, sides, transposed,
    scaling, x, weight, bias, lora_a, lora_b, *leaves)`` with an ``OutputRecipe``
    (see there). The same output, bit for bit, as a fresh tensor; the node saves
    what ``FusedProjectionMaps`` saves and the recipe keeps the unmapped output."""

    @staticmethod
    def forward(ctx: Any, recipe: OutputRecipe, *args: Any) -> Tensor:
        sides, transposed, scaling, norm, x, weight, bias, lora_a, lora_b, *leaves = args
        return _fused_forward(
            ctx, recipe, (sides, transposed, scaling, x, weight, bias, lora_a, lora_b, tuple(leaves)), norm
        )

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _fused_backward(ctx, grad, 1)


class _Packed(NamedTuple):
    recipes: MapRecipes
    side: int
    offset: int
    size: torch.Size
    stride: Any
    storage_offset: Any  # int, or a SymInt under a tracer
    state: Any  # the recipes' (x, y, sides, leaves), handed back when made again


def saved_as_recipes(recipes: Sequence[MapRecipes | OutputRecipe]) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks under which a tensor saved for backward that lies in
    a mapped block of ``recipes`` (the block itself or a view of it) is saved
    as its recipe and made again when backward reads it; any other tensor is
    saved as autograd saves it (detached where it has an autograd node)."""

    def pack(t: Tensor) -> Any:
        if type(t) is Tensor:  # a plain tensor (a subclass may have no storage of its own)
            storage = t.untyped_storage()
            for r in recipes:
                packed = r._pack(t, storage)
                if packed is not None:
                    r.hits += 1
                    return packed
        # Detached, as autograd saves it (an op's output kept as is would hold
        # its own node); a tensor with no node (a leaf, one without grad) as it is.
        return t if t.grad_fn is None else t.detach()

    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, _Packed):
            packed.recipes._state = packed.state  # for the node's backward (release lets it go)
            block = packed.recipes.block(packed.side, packed.offset)
            return block.as_strided(packed.size, packed.stride, packed.storage_offset)
        if isinstance(packed, _PackedOutput):
            return packed.recipe._view(packed)
        return packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class SplitLinearMaps(torch.autograd.Function):
    """``FusedProjectionMaps`` whose output comes back in pieces (the attention
    layer's q~, k~, v of one packed projection, or q~ alone).

    ``apply(sides, sizes, recipes, x, weight, bias, *leaves)``: ``F.linear(x,
    weight, bias)`` with the maps of ``sides`` applied to its blocks, returned
    split along the features into pieces of ``sizes``. Each mapped block is
    exactly one piece (its offset is the piece's start, its width the
    piece's size).

    ``recipes`` None: the blocks are mapped in place, as
    ``FusedProjectionMaps`` maps them (bit for bit), the pieces are views of
    one tensor (as ``split_with_sizes`` gives them), and the node saves what
    ``FusedProjectionMaps`` saves (x, weight, bias, leaves): backward projects
    the mapped rows again. A ``MapRecipes``: store mode, each mapped piece is
    a fresh tensor (y_b + diag(g) A(t) y_b, one ``baddbmm``), the node also
    saves y, and backward projects nothing again (see ``MapRecipes``).

    Why not ``FusedProjectionMaps(...).split_with_sizes(...)``: then the pieces'
    gradients reach backward as one tensor, a concatenation made by split's
    backward, which backward copies again before adding the mixing terms
    (two copies of the whole output's gradient). Here each piece's gradient
    arrives on its own: a mapped piece's gradient becomes g + mix^T g in a
    new tensor (one ``baddbmm``), an unmapped one is used as it is, and the
    projection's gradients are one GEMM per piece. Metric "heads",
    float32/float64 outside autocast only (the caller checks).
    """

    @staticmethod
    def forward(
        ctx: Any,
        sides: tuple[SideBlocks, ...],
        sizes: tuple[int, ...],
        recipes: MapRecipes | None,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        *leaves: Tensor,
    ) -> tuple[Tensor, ...]:
        starts = {sum(sizes[:i]): i for i in range(len(sizes))}
        for b in sides:
            for offset in b.offsets:  # the caller's contract (_functional._project_fused)
                assert offset in starts and sizes[starts[offset]] == b.heads * b.head_dim, (b, sizes)
        product = None
        if recipes is not None and len(sides) == 1:
            # Store mode keeps P = t W_g^T for backward anyway: it may be the
            # projection GEMM's last S*S columns (fn._linear_and_product), one
            # GEMM where P alone (64 columns at E = 512, H = 8) ran well below
            # the GEMM rate; y and P are views of the one output, which
            # autograd and the recipes keep as they kept the two.
            y, product = fn._linear_and_product(x, weight, bias, _side_weights("heads", leaves[:3]))
        else:
            y = F.linear(x, weight, bias)
        ctx.sides, ctx.sizes, ctx.recipes = sides, sizes, recipes
        if recipes is None:
            map_blocks_(y, x, [(b, _side_weights("heads", leaves[3 * i : 3 * i + 3])) for i, b in enumerate(sides)])
            ctx.save_for_backward(x, weight, bias, *leaves)
            return tuple(y.split_with_sizes(sizes, dim=-1))
        pieces = list(y.split_with_sizes(sizes, dim=-1))
        t, flat = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        r = fn._rms_denominator(t)
        for i, b in enumerate(sides):
            # mix_coefficients' ops, with P and r kept for backward (MapRecipes).
            w_gen, b_gen, gate = leaves[3 * i : 3 * i + 3]
            P = F.linear(t, w_gen) if product is None else product.reshape(-1, product.shape[-1])
            recipes._products[i] = (P, r)
            S = b.heads
            mix = fn.coefficients_of(P, r, b_gen, t.shape[-1]).view(-1, S, S) * gate.view(S, 1)
            for offset in b.offsets:
                part = _block(flat, offset, b.heads, b.head_dim)
                mapped = torch.baddbmm(part, mix, part)
                recipes._add(mapped, i, offset)
                p = starts[offset]
                pieces[p] = mapped.view(pieces[p].shape)
        # y is kept by the recipes, not saved here: if the consumer saves none
        # of the blocks as their recipe, they let it go (settle).
        recipes._keep(x, flat, sides, tuple(leaves))
        ctx.save_for_backward(x, weight, bias, *leaves)
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        sides: tuple[SideBlocks, ...] = ctx.sides
        sizes: tuple[int, ...] = ctx.sizes
        recipes: MapRecipes | None = ctx.recipes
        x, weight, bias, *leaves = ctx.saved_tensors
        stored = None if recipes is None else recipes.stored()
        need_x, need_w, need_b = ctx.needs_input_grad[3:6]
        need_leaves = ctx.needs_input_grad[6:]
        t = x.reshape(-1, x.shape[-1])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        gs = [g.reshape(-1, n) for g, n in zip(grads, sizes)]
        dys: list[Tensor] = list(gs)
        # Under create_graph the stored y and coefficients carry no graph: made again, differentiably.
        reuse = stored is not None and not torch.is_grad_enabled()
        if reuse:
            assert stored is not None and recipes is not None
            y, lo = stored, 0
        else:
            lo = min(o for b in sides for o in b.offsets)
            hi = max(o + b.heads * b.head_dim for b in sides for o in b.offsets)
            y = F.linear(t, weight[lo:hi], None if bias is None else bias[lo:hi])
        leaf_grads: list[Tensor | None] = [None] * len(leaves)
        through_generator: list[tuple[Tensor, Tensor, Tensor]] = []
        r: Tensor | None = None
        for i, blocks in enumerate(sides):
            w_gen, b_gen, gate = leaves[3 * i : 3 * i + 3]
            S, d = blocks.heads, blocks.head_dim
            if reuse:
                assert recipes is not None
                P, r, A, mix = recipes.coefficients(i)
            else:
                if r is None:
                    r = fn._rms_denominator(t)  # as in forward
                # The forward may have taken P from its joined projection GEMM (an
                # eager node with one metric side): this separate GEMM agrees with it
                # to rounding (a GEMM's column results depend on its output width),
                # not bit for bit; the gradient is exact up to that rounding.
                P = F.linear(t, w_gen)
                A = fn.coefficients_of(P, r, b_gen, t.shape[-1])
                mix = A.view(-1, S, S) * gate.view(S, 1)
            mix_t = mix.transpose(1, 2)
            dmix: Tensor | None = None
            for offset in blocks.offsets:
                p = starts.index(offset)
                gb = gs[p].unflatten(-1, (S, d))  # the piece is the block (forward's contract)
                dys[p] = torch.baddbmm(gb, mix_t, gb).view(-1, sizes[p])
                part = torch.bmm(gb, _block(y, offset - lo, S, d).transpose(1, 2))
                dmix = part if dmix is None else dmix.add_(part)
            assert dmix is not None and r is not None  # a side has at least one block
            need = need_leaves[3 * i : 3 * i + 3]
            dA, leaf_grads[3 * i + 2] = _heads_mix_grads(dmix, A, gate, need[2])
            leaf_grads[3 * i], leaf_grads[3 * i + 1] = _generator_grads(
                dA, P, r, t, w_gen, need[0], need[1], need_x, through_generator
            )
        if recipes is not None:
            recipes.release()
        dx = dW = db = None
        if need_x:
            pieces = weight.split_with_sizes(sizes)
            dx = dys[0].mm(pieces[0])
            for dy, w_piece in zip(dys[1:], pieces[1:]):
                dx.addmm_(dy, w_piece)
            for dP, w_gen, c in through_generator:
                dx.addmm_(dP, w_gen).addcmul_(t, c)
            dx = dx.view_as(x)
        pieces = list(zip(starts, dys))
        if need_w:
            dW = _joined_mm(pieces, t, False)
        if need_b:
            db = _joined_sum(pieces)
        return (None, None, None, dx, dW, db, *leaf_grads)
