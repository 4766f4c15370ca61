"""MetricGenerator: the data-adaptive part of the cross-head map, shareable by
the layers of a stack (each layer keeps its own gate).

``TORCH_LEAVES`` is the one place that maps damcha_core's metric structures
(``METRIC_STRUCTURES``: leaf names, shapes, initialisers) to torch
parameters; the layer's canonical I/O and the functional core read it.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import damcha_core as dc
import torch
from damcha_core import DamchaTypeError, DamchaValueError, describe
from torch import Tensor, nn

from . import _functional as fn
from ._weight_tools import write_initial

__all__ = ["TORCH_LEAVES", "MetricGenerator", "TorchLeaf", "check_param_dtype", "generator_shapes"]


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Whether two paths' tensors hold one value: the same tensor or storage view,
    equal values (NaN equal to NaN: a diverged run's own state dict reloads), or
    tensors whose values cannot be read (meta, fake, a subclass such as DTensor,
    whose comparison would be a collective): not judged."""
    if a is b:
        return True
    if type(a) not in (Tensor, nn.Parameter) or type(b) not in (Tensor, nn.Parameter) or a.is_meta or b.is_meta:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if (
        a.layout is torch.strided
        and b.layout is torch.strided
        and a.device == b.device
        and a.device.type in ("cpu", "cuda")  # (storage-less tensors, lazy or XLA ones, have no data_ptr)
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    ):
        return True
    return bool(torch.equal(a, b)) or (
        a.is_floating_point() and bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    )


# Generator -> (the missing_keys list of the load that last read it, the path it
# was read under, weak references to the tensors read there): see
# MetricGenerator._load_from_state_dict.
_LOADS: weakref.WeakKeyDictionary[nn.Module, tuple[list[str], str, dict[str, weakref.ref[Tensor]]]] = (
    weakref.WeakKeyDictionary()
)


@dataclasses.dataclass(frozen=True)
class TorchLeaf:
    """How one canonical generator leaf is stored in a ``MetricGenerator``.

    Attributes:
        attribute: the parameter's name on the module.
        layout: "linear": ``nn.Linear``'s (out, in) weight, i.e. the canonical
            (E, ...) kernel flattened to 2-D and transposed, so each generator
            call is one ``F.linear``; "flat": flattened to 1-D (a bias);
            "same": the canonical shape.
    """

    attribute: str
    layout: str = "same"

    def shape(self, canonical: tuple[int, ...]) -> tuple[int, ...]:
        """The torch parameter's shape for a canonical leaf shape."""
        if self.layout == "linear":
            return (math.prod(canonical[1:]), canonical[0])
        return (math.prod(canonical),) if self.layout == "flat" else tuple(canonical)

    def to_canonical(self, t: Tensor, canonical: tuple[int, ...]) -> Tensor:
        """The canonical view of the torch parameter ``t`` (shares its storage)."""
        return t.T.reshape(canonical) if self.layout == "linear" else t.view(canonical)

    def from_canonical(self, t: Tensor) -> Tensor:
        """The torch-layout view of a canonical tensor (a view where strides allow)."""
        if self.layout == "linear":
            return t.reshape(t.shape[0], -1).T
        return t.reshape(-1) if self.layout == "flat" else t


# Leaf names, shapes and initialisers are damcha_core's METRIC_STRUCTURES;
# what is torch's is the attribute and its layout. A structure added to the
# core needs its entry here (a test checks that every one has it).
TORCH_LEAVES: dict[str, dict[str, TorchLeaf]] = {
    "heads": {"kernel": TorchLeaf("weight", "linear"), "bias": TorchLeaf("bias", "flat")},
    "lowrank": {
        "kernel": TorchLeaf("weight", "linear"),
        "bias": TorchLeaf("bias", "flat"),
        "u": TorchLeaf("u"),
        "v": TorchLeaf("v"),
    },
}


# The attributes behind SideWeights' fields (kernel, bias, u, v), per metric.
_SIDE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    metric: tuple(leaves[name].attribute for name in ("kernel", "bias", "u", "v") if name in leaves)
    for metric, leaves in TORCH_LEAVES.items()
}


def check_param_dtype(dtype: object) -> None:
    """``dtype=`` of a module's parameters: None or a real floating torch dtype.

    torch builds complex or integer parameters without complaint and the
    layer then fails deep inside a matmul, or raises a raw RuntimeError from
    ``normal_``; say which argument is wrong instead.
    """
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DamchaTypeError(
            dc.invalid_argument(
                "dtype",
                "None or a real floating torch dtype (torch.float16, bfloat16, float32, float64)",
                f"dtype={describe(dtype)}",
            )
        )


def generator_shapes(
    metric: str, features: int, heads: int, head_dim: int, rank: int | None
) -> dict[str, tuple[int, ...]]:
    """Canonical shape of each generator leaf (the gate excluded), from damcha_core's table."""
    structure = dc.METRIC_STRUCTURES[metric]
    shapes = structure.shapes(features, heads, head_dim, rank)
    return {name: shapes[name] for name in structure.generator_leaves}


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
        metric = dc.check_choice("metric", metric, tuple(TORCH_LEAVES))
        features, heads, head_dim = (
            dc.check_int(n, v) for n, v in (("features", features), ("heads", heads), ("head_dim", head_dim))
        )
        if metric == "lowrank":
            if rank is None:
                raise DamchaValueError(
                    dc.invalid_argument("rank", "an int >= 1 with metric='lowrank' (it is required)", "rank=None")
                )
            rank = dc.check_int("rank", rank)
        elif rank is not None:
            raise DamchaValueError(
                dc.invalid_argument(
                    "rank",
                    f"None with metric={metric!r} (it is only used with metric='lowrank')",
                    f"metric={metric!r}, rank={describe(rank)}",
                )
            )
        check_param_dtype(dtype)
        self.features, self.heads, self.head_dim, self.metric, self.rank = features, heads, head_dim, metric, rank
        for name, shape in generator_shapes(metric, features, heads, head_dim, rank).items():
            leaf = TORCH_LEAVES[metric][name]
            setattr(self, leaf.attribute, nn.Parameter(torch.empty(leaf.shape(shape), device=device, dtype=dtype)))
        self.reset_parameters()

    @property
    def spec(self) -> dc.GeneratorSpec:
        """What this generator serves (``damcha_core.resolve_generators`` judges the fit)."""
        return dc.GeneratorSpec(self.features, self.heads, self.metric, self.head_dim, self.rank)

    def reset_parameters(self) -> None:
        """The canonical initialisers (damcha_core's table), drawn from torch's RNG."""
        stds = dc.METRIC_STRUCTURES[self.metric].stds(self.features, self.heads, self.head_dim, self.rank)
        with torch.no_grad():
            for name, leaf in TORCH_LEAVES[self.metric].items():
                fresh = torch.empty_like(getattr(self, leaf.attribute))
                if stds[name] == 0.0:
                    fresh.zero_()
                else:
                    fresh.normal_(0.0, stds[name])
                write_initial(self, leaf.attribute, fresh)  # also under a weight tool (pruning, parametrize)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A generator that several layers share is loaded once per path by one
        # load_state_dict, each path's tensors copied in turn: the last path
        # would win silently. Values that differ between paths come from a
        # checkpoint whose layers had generators of their own: refused by name.
        # One load is told from the next by its missing_keys list, the one
        # object torch hands every module of a load (held here while it is the
        # last seen, so its id is not reused).
        own = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix) and isinstance(v, Tensor)}
        seen = _LOADS.get(self)
        if own and seen is not None and seen[0] is missing_keys and seen[1] != prefix:
            first_prefix, first = seen[1], seen[2]
            for name, value in own.items():
                kept = first.get(name)
                other = None if kept is None else kept()
                if other is not None and not _same_values(other, value):
                    raise DamchaValueError(
                        dc.invalid_argument(
                            "state_dict",
                            f"one value for a metric generator shared by several layers ({first_prefix!r} and "
                            f"{prefix!r} are one MetricGenerator; a checkpoint of layers with generators of their "
                            "own loads into a model built without sharing)",
                            f"state_dict[{prefix + name!r}] differs from state_dict[{first_prefix + name!r}]",
                        )
                    )
        elif own:
            _LOADS[self] = (missing_keys, prefix, {k: weakref.ref(v) for k, v in own.items()})
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        rank = f", rank={self.rank}" if self.metric == "lowrank" else ""
        return f"features={self.features}, heads={self.heads}, head_dim={self.head_dim}, metric={self.metric!r}{rank}"

    def matches(self, features: int, heads: int, head_dim: int, metric: str, rank: int | None) -> bool:
        """Whether this generator can serve a side with these sizes."""
        return not dc.GeneratorSpec(features, heads, metric, head_dim, rank).mismatches(self.spec)

    def side(self, gate: Tensor) -> fn.SideWeights:
        """This generator's parameters with a layer's ``gate``, as the functional core takes them."""
        # Runs on every forward: parameters read from the registry, in
        # SideWeights' order (kernel, bias, then "lowrank"'s u, v).
        kernel, bias, *rest = (fn.tool_entry(self, name) for name in _SIDE_ATTRIBUTES[self.metric])
        return fn.SideWeights(self.metric, kernel, bias, gate, *rest)

    def canonical_views(self, gate: Tensor, side: str = "qk") -> dict[str, Tensor]:
        """``metric.<side>.<leaf>`` -> canonical view of each parameter (and the gate)."""
        out = {f"metric.{side}.gate": gate}
        shapes = generator_shapes(self.metric, self.features, self.heads, self.head_dim, self.rank)
        for name, leaf in TORCH_LEAVES[self.metric].items():
            out[f"metric.{side}.{name}"] = leaf.to_canonical(
                fn.tool_entry(self, leaf.attribute, power_iteration=False), shapes[name]
            )
        return out

    def head_map(self, tokens: Tensor, gate: Tensor) -> Tensor:
        """l(t) = I + diag(g) A(t), (B, T, S, S); metric "heads" only."""
        if not dc.METRIC_STRUCTURES[self.metric].compact_head_map:
            raise DamchaValueError(
                f"`head_map` is the S x S factor l(t) of metric 'heads'; metric {self.metric!r} has none "
                "(use damcha_attention(..., return_metric=True) for the dense L(t))."
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
