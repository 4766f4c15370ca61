"""MetricGenerator: the data-adaptive part of the cross-head map, shareable by
the layers of a stack (each layer keeps its own gate)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import damcha_core as dc
from damcha_core import DamchaValueError

__all__ = ["MetricGenerator"]


def generator_linear(tokens: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """phi(t) W + b with phi(t) = t / sqrt(mean(t^2) + eps), without building phi.

    (t W) * rsqrt(...) + b is one GEMM on the raw tokens, which autograd
    already keeps for the projections, plus a pass over the small output;
    materialising phi would cost a pass and a stored (B, T, E) tensor.
    """
    mean_sq = torch.linalg.vecdot(tokens, tokens, dim=-1).unsqueeze(-1) / tokens.shape[-1]
    return torch.addcmul(bias, F.linear(tokens, weight), torch.rsqrt(mean_sq + dc.RMS_EPS))


class MetricGenerator(nn.Module):
    """Per-token coefficients of the cross-head map L(t), from phi(t) = RMS(t).

    ``metric="heads"``: A(t) = phi(t) W_A + b_A (S, S) and
    (L y)^h = y^h + g_h sum_a A[h, a] y^a. ``metric="lowrank"``:
    u(t) = phi(t) W_u + b_u (r,) and (L y)[h, i] = y[h, i] + g_h sum_r
    U[h, i, r] u_r z_r with z_r = sum_{a, i} V[a, i, r] y[a, i].

    Parameters are stored so that each step is one ``F.linear``/``matmul``:
    ``weight`` (S*S, E) or (r, E) in ``nn.Linear`` layout, ``bias`` (S*S,) or
    (r,), and for lowrank ``u``, ``v`` (S, d, r) as in the canonical format.

    Args:
        features: E, feature size of the tokens that drive the map.
        heads: S, number of heads the map mixes.
        head_dim: d, size of each head (used by "lowrank" only).
        metric: "heads" or "lowrank".
        rank: r, required for "lowrank".
    """

    def __init__(
        self,
        features: int,
        heads: int,
        head_dim: int,
        metric: str = "heads",
        rank: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if metric not in ("heads", "lowrank"):
            raise DamchaValueError(f"`metric` must be 'heads' or 'lowrank' for a MetricGenerator. Received: metric={metric!r}")
        # DamchaConfig validates the ints and the rank rule with the shared messages.
        dc.DamchaConfig(query_dim=features, num_heads=heads, key_dim=head_dim, metric=metric, metric_rank=rank, coupling="query")
        self.features, self.heads, self.head_dim, self.metric, self.rank = features, heads, head_dim, metric, rank
        kw = {"device": device, "dtype": dtype}
        out = heads * heads if metric == "heads" else rank
        self.weight = nn.Parameter(torch.empty(out, features, **kw))  # type: ignore[arg-type]
        self.bias = nn.Parameter(torch.empty(out, **kw))  # type: ignore[arg-type]
        if metric == "lowrank":
            self.u = nn.Parameter(torch.empty(heads, head_dim, rank, **kw))  # type: ignore[arg-type]
            self.v = nn.Parameter(torch.empty(heads, head_dim, rank, **kw))  # type: ignore[arg-type]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The canonical initialisers (damcha_core._params), drawn from torch's RNG."""
        E, S = self.features, self.heads
        with torch.no_grad():
            if self.metric == "heads":
                self.weight.normal_(0.0, 1.0 / math.sqrt(E * S))
            else:
                self.weight.normal_(0.0, 1.0 / math.sqrt(E))
                self.u.normal_(0.0, 1.0 / math.sqrt(self.rank))  # type: ignore[arg-type]
                self.v.normal_(0.0, 1.0 / math.sqrt(S * self.head_dim))
            self.bias.zero_()

    def extra_repr(self) -> str:
        rank = f", rank={self.rank}" if self.metric == "lowrank" else ""
        return f"features={self.features}, heads={self.heads}, head_dim={self.head_dim}, metric={self.metric!r}{rank}"

    def matches(self, features: int, heads: int, head_dim: int, metric: str, rank: int | None) -> bool:
        """Whether this generator can serve a side with these sizes."""
        if (self.features, self.heads, self.metric, self.rank) != (features, heads, metric, rank):
            return False
        return metric == "heads" or self.head_dim == head_dim

    def head_map(self, tokens: Tensor, gate: Tensor) -> Tensor:
        """l(t) = I + diag(g) A(t), (B, T, S, S); metric "heads" only.

        The gate is folded into the small (S*S, E) weight rather than into
        the (B, T, S, S) activations: one ``addmm`` per token yields l.
        """
        S = self.heads
        weight, bias = self.weight.to(tokens.dtype), self.bias.to(tokens.dtype)
        gate = gate.to(tokens.dtype)
        eye = torch.eye(S, dtype=tokens.dtype, device=tokens.device)
        weight = (weight.view(S, S, -1) * gate.view(S, 1, 1)).view(S * S, -1)
        bias = (bias.view(S, S) * gate.view(S, 1) + eye).view(S * S)
        return generator_linear(tokens, weight, bias).unflatten(-1, (S, S))

    def _map_heads(self, tokens: Tensor, gate: Tensor, ys: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if self.metric == "heads":
            l = self.head_map(tokens, gate)
            return tuple(torch.matmul(l, y) for y in ys)
        dtype = tokens.dtype
        u = generator_linear(tokens, self.weight.to(dtype), self.bias.to(dtype))  # (B, T, r)
        v = self.v.to(dtype).flatten(0, 1)  # (S*d, r)
        gated_u = (self.u.to(dtype) * gate.to(dtype).view(-1, 1, 1)).flatten(0, 1).transpose(0, 1)  # (r, S*d)
        out = []
        for y in ys:
            flat = y.flatten(-2)  # (B, T, S*d)
            z = torch.matmul(flat, v)  # (B, T, r)
            out.append((flat + torch.matmul(u * z, gated_u)).view_as(y))
        return tuple(out)

    def forward(self, tokens: Tensor, y: Tensor, gate: Tensor, *more: Tensor) -> Tensor | tuple[Tensor, ...]:
        """L(t) y for tokens t (B, T, E) and their stacked heads y (B, T, S, d).

        Extra head tensors in ``more`` reuse the same per-token coefficients
        (tied self-attention maps q and k with one generator call); then a
        tuple is returned.
        """
        ys = (y, *more)
        if y.dtype in (torch.float16, torch.bfloat16):
            # l sits near I: in a 16-bit type it rounds q~ twice (l, then l q);
            # the map is tiny next to attention, so it runs in float32.
            with torch.autocast(y.device.type, enabled=False):
                out = self._map_heads(tokens.float(), gate, tuple(t.float() for t in ys))
            out = tuple(t.to(y.dtype) for t in out)
        else:
            out = self._map_heads(tokens.to(y.dtype), gate, ys)
        return out if more else out[0]

    def penalty(self, tokens: Tensor, gate: Tensor) -> Tensor:
        """mean over tokens of ||L(t) - I||_F^2 / (S*d), a 0-d tensor.

        As in ``forward``, 16-bit tokens (or autocast) are computed in
        float32: sum(t^2) over the features overflows float16 for moderately
        large tokens. The result has the tokens' dtype.
        """
        dtype = torch.float32 if tokens.dtype in (torch.float16, torch.bfloat16) else tokens.dtype
        device = tokens.device.type
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return self._penalty(tokens.to(dtype), gate.to(dtype), dtype).to(tokens.dtype)
        return self._penalty(tokens.to(dtype), gate.to(dtype), dtype).to(tokens.dtype)

    def _penalty(self, tokens: Tensor, gate: Tensor, dtype: torch.dtype) -> Tensor:
        S, d = self.heads, self.head_dim
        coeff = generator_linear(tokens, self.weight.to(dtype), self.bias.to(dtype))
        if self.metric == "heads":
            # L - I = (diag(g) A) (x) I_d, whose squared norm is d * ||diag(g) A||^2.
            gated = coeff.unflatten(-1, (S, S)) * gate.view(S, 1)
            return gated.square().sum(dim=(-2, -1)).mean() / S
        # L - I = P diag(u) Q^T with P = g U, Q = V (S*d, r): O(r^2) per token.
        P = (self.u.to(dtype) * gate.view(-1, 1, 1)).flatten(0, 1)
        Q = self.v.to(dtype).flatten(0, 1)
        gram = (P.transpose(0, 1) @ P) * (Q.transpose(0, 1) @ Q)
        return torch.einsum("...r,...s,rs->...", coeff, coeff, gram).mean() / (S * d)
