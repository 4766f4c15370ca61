"""MetricGenerator: the data-adaptive part of the cross-head map, shareable by
the layers of a stack (each layer keeps its own gate).

``TORCH_LEAVES`` is the one place that maps the metric structures of the
canonical format (``damcha_core``: leaf names, shapes, initialisers) to torch
parameters; the layer's canonical I/O and the functional core read it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import Tensor, nn

from damcha_core import DamchaTypeError, DamchaValueError, describe

from . import _functional as fn

__all__ = ["MetricGenerator", "TORCH_LEAVES", "TorchLeaf"]


@dataclasses.dataclass(frozen=True)
class TorchLeaf:
    """How one canonical generator leaf is stored in a ``MetricGenerator``.

    Attributes:
        attribute: the parameter's name on the module.
        shape: its torch shape from (S heads, d head size, r rank, E features).
        canonical: the canonical leaf's shape from (S, d, r, E).
        transposed: stored as ``nn.Linear``'s (out, in) weight, i.e. the
            transpose of the canonical (E, ...) kernel flattened to 2-D, so
            each generator call is one ``F.linear``.
        std: initialiser: normal with this std (of S, d, r, E), or zeros.
    """

    attribute: str
    shape: Callable[[int, int, int, int], tuple[int, ...]]
    canonical: Callable[[int, int, int, int], tuple[int, ...]]
    transposed: bool = False
    std: Callable[[int, int, int, int], float] | None = None

    def to_canonical(self, t: Tensor, dims: tuple[int, int, int, int]) -> Tensor:
        """The canonical view of the torch parameter ``t`` (shares its storage)."""
        shape = self.canonical(*dims)
        return t.T.reshape(shape) if self.transposed else t.view(shape)

    def from_canonical(self, t: Tensor, dims: tuple[int, int, int, int]) -> Tensor:
        """The torch-layout view of a canonical tensor (a view where strides allow)."""
        return t.reshape(t.shape[0], -1).T if self.transposed else t.reshape(self.shape(*dims))


# Leaf shapes and stds are damcha_core's (docs/spec.md, damcha_core._params);
# what is torch's here is the attribute, its shape and the transposition.
TORCH_LEAVES: dict[str, dict[str, TorchLeaf]] = {
    "heads": {
        "kernel": TorchLeaf("weight", lambda S, d, r, E: (S * S, E), lambda S, d, r, E: (E, S, S), True,
                            lambda S, d, r, E: 1.0 / math.sqrt(E * S)),
        "bias": TorchLeaf("bias", lambda S, d, r, E: (S * S,), lambda S, d, r, E: (S, S)),
    },
    "lowrank": {
        "kernel": TorchLeaf("weight", lambda S, d, r, E: (r, E), lambda S, d, r, E: (E, r), True,
                            lambda S, d, r, E: 1.0 / math.sqrt(E)),
        "bias": TorchLeaf("bias", lambda S, d, r, E: (r,), lambda S, d, r, E: (r,)),
        "u": TorchLeaf("u", lambda S, d, r, E: (S, d, r), lambda S, d, r, E: (S, d, r), False,
                       lambda S, d, r, E: 1.0 / math.sqrt(r)),
        "v": TorchLeaf("v", lambda S, d, r, E: (S, d, r), lambda S, d, r, E: (S, d, r), False,
                       lambda S, d, r, E: 1.0 / math.sqrt(S * d)),
    },
}


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DamchaTypeError(f"`{name}` must be an int >= 1. Received: {name}={describe(value)}")
    if value < 1:
        raise DamchaValueError(f"`{name}` must be >= 1. Received: {name}={value}")
    return value


class MetricGenerator(nn.Module):
    """Per-token coefficients of the cross-head map L(t), from phi(t) = RMS(t).

    ``metric="heads"``: A(t) = phi(t) W_A + b_A (S, S) and
    (L y)^h = y^h + g_h sum_a A[h, a] y^a. ``metric="lowrank"``:
    u(t) = phi(t) W_u + b_u (r,) and (L y)[h, i] = y[h, i] + g_h sum_r
    U[h, i, r] u_r z_r with z_r = sum_{a, i} V[a, i, r] y[a, i].

    Parameters are stored so that each step is one ``F.linear``/``matmul``
    (see ``TORCH_LEAVES``): ``weight`` (S*S, E) or (r, E) in ``nn.Linear``
    layout, ``bias`` (S*S,) or (r,), and for lowrank ``u``, ``v`` (S, d, r)
    as in the canonical format.

    Args:
        features: E, feature size of the tokens that drive the map.
        heads: S, number of heads the map mixes.
        head_dim: d, size of each head (used by "lowrank" only).
        metric: "heads" or "lowrank".
        rank: r, required for "lowrank".
        device, dtype: factory kwargs for the parameters.
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
        if metric not in TORCH_LEAVES:
            raise DamchaValueError(
                f"`metric` must be 'heads' or 'lowrank' for a MetricGenerator. Received: metric={describe(metric)}"
            )
        features, heads, head_dim = (_check_size(n, v) for n, v in
                                     (("features", features), ("heads", heads), ("head_dim", head_dim)))
        if metric == "lowrank":
            if rank is None:
                raise DamchaValueError("`rank` is required with metric='lowrank'. Received: rank=None")
            rank = _check_size("rank", rank)
        elif rank is not None:
            raise DamchaValueError(f"`rank` is only used with metric='lowrank'. Received: rank={describe(rank)}")
        self.features, self.heads, self.head_dim, self.metric, self.rank = features, heads, head_dim, metric, rank
        dims = (heads, head_dim, rank or 0, features)
        for leaf in TORCH_LEAVES[metric].values():
            setattr(self, leaf.attribute, nn.Parameter(torch.empty(leaf.shape(*dims), device=device, dtype=dtype)))
        self.reset_parameters()

    @property
    def spec(self) -> tuple[int, int, int, str, int | None]:
        """(features, heads, head_dim, metric, rank): what a layer side must match."""
        return self.features, self.heads, self.head_dim, self.metric, self.rank

    def reset_parameters(self) -> None:
        """The canonical initialisers (damcha_core's table), drawn from torch's RNG."""
        dims = (self.heads, self.head_dim, self.rank or 0, self.features)
        with torch.no_grad():
            for leaf in TORCH_LEAVES[self.metric].values():
                param = getattr(self, leaf.attribute)
                if leaf.std is None:
                    param.zero_()
                else:
                    param.normal_(0.0, leaf.std(*dims))

    def extra_repr(self) -> str:
        rank = f", rank={self.rank}" if self.metric == "lowrank" else ""
        return f"features={self.features}, heads={self.heads}, head_dim={self.head_dim}, metric={self.metric!r}{rank}"

    def matches(self, features: int, heads: int, head_dim: int, metric: str, rank: int | None) -> bool:
        """Whether this generator can serve a side with these sizes."""
        if (self.features, self.heads, self.metric, self.rank) != (features, heads, metric, rank):
            return False
        return metric == "heads" or self.head_dim == head_dim

    def side(self, gate: Tensor) -> fn.SideWeights:
        """This generator's parameters with a layer's ``gate``, as the functional core takes them."""
        if self.metric == "heads":
            return fn.SideWeights("heads", self.weight, self.bias, gate)
        return fn.SideWeights("lowrank", self.weight, self.bias, gate, self.u, self.v)

    def canonical_views(self, gate: Tensor, side: str = "qk") -> dict[str, Tensor]:
        """``metric.<side>.<leaf>`` -> canonical view of each parameter (and the gate)."""
        dims = (self.heads, self.head_dim, self.rank or 0, self.features)
        out = {f"metric.{side}.gate": gate}
        for name, leaf in TORCH_LEAVES[self.metric].items():
            out[f"metric.{side}.{name}"] = leaf.to_canonical(getattr(self, leaf.attribute), dims)
        return out

    def head_map(self, tokens: Tensor, gate: Tensor) -> Tensor:
        """l(t) = I + diag(g) A(t), (B, T, S, S); metric "heads" only."""
        if self.metric != "heads":
            raise DamchaValueError(
                "`head_map` is the S x S factor of metric 'heads'; a 'lowrank' map has none. "
                f"Received: metric={self.metric!r}"
            )
        return fn.head_map_weights(self.side(gate), tokens)

    def forward(self, tokens: Tensor, y: Tensor, gate: Tensor, *more: Tensor) -> Tensor | tuple[Tensor, ...]:
        """L(t) y for tokens t (B, T, E) and their stacked heads y (B, T, S, d).

        Extra head tensors in ``more`` reuse the same per-token coefficients
        (tied self-attention maps q and k with one generator call); then a
        tuple is returned. 16-bit heads are mapped in float32 (see
        ``damcha_torch.apply_map``).
        """
        out = fn.apply_map_weights(self.side(gate), tokens, (y, *more))
        return out if more else out[0]

    def penalty(self, tokens: Tensor, gate: Tensor) -> Tensor:
        """mean over tokens of ||L(t) - I||_F^2 / (S*d), a 0-d tensor in the tokens' dtype."""
        return fn.role_penalty_weights(self.side(gate), tokens, self.head_dim)

