"""The fast paths of converted projections (``convert``, metric "heads").

A converted projection computes y = P(t) and then, for each block of y that
holds a role's heads (queries or keys, S heads of d features each), the
residual map y_b + diag(g) A(t) y_b of its token t. Two paths skip the
general one's copies (a split of y, a contiguous copy of each strided block,
a concatenation of the result) and its recomputation of the whole projection:

- ``map_blocks_``: no autograd graph to build (``torch.no_grad``, inference
  mode). The mixing product of each block is added to y in place, through
  strided views: one small ``bmm`` and one ``add_`` per block, no copy.
- ``FusedProjectionMaps``: training with ``recompute`` on a plain
  ``nn.Linear`` projection (timm's fused ``qkv``, ``q_proj``/``k_proj``) or
  transformers' ``Conv1D`` (GPT-2's fused ``c_attn``, weight stored
  (in, out)). One autograd node for the projection and its maps that saves
  only what the projection saves (its input and weights): backward
  recomputes the rows of the projection that hold mapped heads (two thirds
  of a fused qkv GEMM instead of all of it; a Conv1D's columns, read in
  place) and the generator's S x S coefficients, and writes the
  gradients by hand: two ``bmm`` per block for the mixing, a few passes over
  the (T, S*S) coefficients and two over the tokens for the generator
  (autograd's norm backward made several (T, E) temporaries). The backward
  is written with differentiable ops, so ``create_graph=True`` (a gradient
  penalty) differentiates it.

Both compute each mapped block as y_b + bmm(diag(g) A(t), y_b), one product
per block (the tied queries and keys of one projection share one A(t)), so
they agree bit for bit with each other (a host's reentrant gradient
checkpointing runs the first under ``no_grad`` and the second when it
recomputes). With the gates at 0 the product is exactly 0 and y is returned
unchanged, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _functional as fn

__all__ = ["FusedProjectionMaps", "SideBlocks", "map_blocks_", "mix_coefficients", "project"]


class SideBlocks(NamedTuple):
    """The blocks of a projection's output that one metric side maps: one
    block at each feature offset of ``offsets``, each ``heads`` heads of
    ``head_dim`` features (the tied queries and keys of a fused qkv are two
    blocks of side "qk")."""

    side: str
    heads: int
    head_dim: int
    offsets: tuple[int, ...]


def mix_coefficients(side: fn.SideWeights, tokens: Tensor) -> Tensor:
    """diag(g) A(t), (T, S, S), of tokens (T, E); metric "heads".

    A(t) = phi(t) W + b computed as the functional core does (one GEMM on the
    raw tokens, the RMS normalisation applied to its small output)."""
    S = side.gate.shape[0]
    A = torch.addcdiv(
        side.bias, F.linear(tokens, side.weight), fn._rms_denominator(tokens), value=math.sqrt(tokens.shape[-1])
    )
    return A.view(-1, S, S) * side.gate.view(S, 1)


def _block(flat: Tensor, offset: int, heads: int, head_dim: int) -> Tensor:
    """The (T, S, d) strided view of one block of a (T, F) output."""
    return flat[:, offset : offset + heads * head_dim].unflatten(-1, (heads, head_dim))


def map_blocks_(y: Tensor, tokens: Tensor, sides: Sequence[tuple[SideBlocks, fn.SideWeights]]) -> Tensor:
    """Map the blocks of y (..., F) in place; y must be contiguous. Returns y.

    Only where no autograd graph is recorded (the caller checks)."""
    flat = y.view(-1, y.shape[-1])
    t = tokens.reshape(-1, tokens.shape[-1])
    for blocks, weights in sides:
        mix = mix_coefficients(weights, t)
        for offset in blocks.offsets:
            part = _block(flat, offset, blocks.heads, blocks.head_dim)
            part.add_(torch.bmm(mix, part))
    return y


def _side_weights(leaves: Sequence[Tensor]) -> fn.SideWeights:
    weight, bias, gate = leaves
    return fn.SideWeights("heads", weight, bias, gate)


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

    ``apply(sides, transposed, x, weight, bias, *leaves)``: ``sides`` a tuple
    of ``SideBlocks``; ``transposed`` False for an ``nn.Linear`` weight
    (out, in), True for a ``Conv1D`` weight (in, out); ``leaves`` the (weight,
    bias, gate) of each side in that order (the generator's
    ``nn.Linear``-layout weight (S*S, E), bias (S*S,), the layer's gate (S,)).
    float32/float64, no autocast (the caller checks).
    """

    @staticmethod
    def forward(
        ctx: Any,
        sides: tuple[SideBlocks, ...],
        transposed: bool,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        *leaves: Tensor,
    ) -> Tensor:
        y = project(x, weight, bias, transposed)
        map_blocks_(y, x, [(b, _side_weights(leaves[3 * i : 3 * i + 3])) for i, b in enumerate(sides)])
        ctx.sides, ctx.transposed = sides, transposed
        ctx.save_for_backward(x, weight, bias, *leaves)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias, *leaves = ctx.saved_tensors
        sides: tuple[SideBlocks, ...] = ctx.sides
        transposed: bool = ctx.transposed
        need_x, need_w, need_b = ctx.needs_input_grad[2:5]
        need_leaves = ctx.needs_input_grad[5:]
        features = weight.shape[1 if transposed else 0]
        t = x.reshape(-1, x.shape[-1])
        g = grad.reshape(-1, features)
        # The rows of the projection that hold mapped heads: one GEMM on them.
        starts = [o for b in sides for o in b.offsets]
        ends = [o + b.heads * b.head_dim for b in sides for o in b.offsets]
        lo, hi = min(starts), max(ends)
        rows = weight[:, lo:hi] if transposed else weight[lo:hi]  # a strided view: BLAS reads it in place
        y = project(t, rows, None if bias is None else bias[lo:hi], transposed)
        covered = lo == 0 and hi == features and sum(e - s for s, e in zip(starts, ends)) == features
        # dL/dy: the incoming gradient, plus mix^T g_b on each mapped block.
        dy = None if covered else g.clone()
        leaf_grads: list[Tensor | None] = [None] * len(leaves)
        through_generator = []  # (dP, generator weight, c): dL/dt += dP W + c t
        pieces = []
        scale = math.sqrt(t.shape[-1])
        r = fn._rms_denominator(t)  # as in forward: the same mix, bit for bit
        for i, blocks in enumerate(sides):
            w_gen, b_gen, gate = leaves[3 * i : 3 * i + 3]
            S = blocks.heads
            P = F.linear(t, w_gen)
            A = torch.addcdiv(b_gen, P, r, value=scale)
            mix_t = (A.view(-1, S, S) * gate.view(S, 1)).transpose(1, 2)
            dmix: Tensor | None = None
            for offset in blocks.offsets:
                gb = _block(g, offset, blocks.heads, blocks.head_dim)
                yb = _block(y, offset - lo, blocks.heads, blocks.head_dim)
                if dy is None:
                    pieces.append((offset, torch.baddbmm(gb, mix_t, gb)))
                else:
                    # (baddbmm_ into a strided view would loop over the tokens)
                    _block(dy, offset, blocks.heads, blocks.head_dim).add_(torch.bmm(mix_t, gb))
                part = torch.bmm(gb, yb.transpose(1, 2))
                dmix = part if dmix is None else dmix.add_(part)
            assert dmix is not None  # a side has at least one block
            # The generator's gradients, written out: mix = diag(g) A,
            # A = b + s P / r with P = t W^T, r = sqrt(|t|^2 + E eps).
            need_w_gen, need_b_gen, need_gate = need_leaves[3 * i : 3 * i + 3]
            dA = (dmix * gate.view(S, 1)).view(-1, S * S)
            dmix = dmix.view(-1, S * S)
            if need_gate:
                leaf_grads[3 * i + 2] = (dmix * A).sum(0).view(S, S).sum(1)
            if need_b_gen:
                leaf_grads[3 * i + 1] = dA.sum(0)
            if need_w_gen or need_x:
                dP = dA * (scale / r)
                if need_w_gen:
                    leaf_grads[3 * i] = dP.t().mm(t)
                if need_x:
                    # through r: dL/dr = -s sum(dA P) / r^2, dr/dt = t / r
                    c = (dA * P).sum(-1, keepdim=True).mul_(-scale) / (r * r * r)
                    through_generator.append((dP, w_gen, c))
        if dy is None:
            pieces.sort(key=lambda p: p[0])
            dy = pieces[0][1].flatten(1) if len(pieces) == 1 else torch.cat([p.flatten(1) for _, p in pieces], dim=1)
        dx = dW = db = None
        if need_x:
            dx = dy.mm(weight.t() if transposed else weight)
            for dP, w_gen, c in through_generator:
                dx.addmm_(dP, w_gen).addcmul_(t, c)
            dx = dx.view_as(x)
        if need_w:
            dW = t.t().mm(dy) if transposed else dy.t().mm(t)
        if need_b:
            db = dy.sum(0)
        return (None, None, dx, dW, db, *leaf_grads)
