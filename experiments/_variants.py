"""The variant registry: which attention, and which training-side options (no PyTorch needed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from damcha_core import DamchaValueError, invalid_argument


@dataclasses.dataclass(frozen=True)
class Variant:
    """An attention variant: ``kind`` is "mha", "talking-heads" or "damcha".

    Args:
        name: registry name (``VARIANTS``).
        kind: "mha", "talking-heads" or "damcha".
        metric, coupling, metric_rank: the DAMCHA layer options.
        share_metric: one generator (per side) shared by every layer of the
            stack; each layer keeps its own gates.
        penalty: coefficient of ``damcha_torch.metric_penalty`` added to the loss.
        gate_init: initial value of every gate (0 = the layer starts as MHA,
            and then its generator receives exactly zero gradient until the
            gates move).
        metric_lr_mult: learning rate of gates and generators = lr times this.
        description: one line for tables.
    """

    name: str
    kind: str
    metric: str = "none"
    coupling: str = "tied"
    metric_rank: int | None = None
    share_metric: bool = False
    penalty: float = 0.0
    gate_init: float = 0.0
    metric_lr_mult: float = 1.0
    description: str = ""


def _damcha(name: str, metric: str = "heads", coupling: str = "tied", **kw: Any) -> Variant:
    return Variant(name, "damcha", metric, coupling, **kw)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("mha", "mha", description="nn.MultiheadAttention"),
        Variant("talking-heads", "talking-heads", description="static HxH mixing of logits and weights"),
        _damcha("damcha-heads-tied", description="per-layer generator, tied q/k"),
        _damcha("damcha-heads-separate", coupling="separate", description="q and k generators"),
        _damcha("damcha-heads-query", coupling="query", description="queries only"),
        _damcha("damcha-lowrank-tied", "lowrank", metric_rank=8, description="rank-8 map, tied"),
        # Ablations (claim 4): each differs from damcha-heads-tied (or -query) in one thing.
        _damcha(
            "damcha-heads-tied-shared",
            share_metric=True,
            description="one generator shared by the stack, per-layer gates",
        ),
        _damcha(
            "damcha-heads-query-shared",
            coupling="query",
            share_metric=True,
            description="queries only, one generator shared by the stack",
        ),
        _damcha("damcha-heads-tied-pen1e-3", penalty=1e-3, description="metric penalty 1e-3"),
        _damcha("damcha-heads-tied-pen1e-2", penalty=1e-2, description="metric penalty 1e-2"),
        _damcha("damcha-heads-tied-pen1e-1", penalty=1e-1, description="metric penalty 1e-1"),
        _damcha("damcha-heads-tied-gate0.1", gate_init=0.1, description="gates start at 0.1, not 0"),
        _damcha("damcha-heads-tied-mlr10", metric_lr_mult=10.0, description="gates and generator at 10x lr"),
        _damcha("damcha-lowrank-tied-r4", "lowrank", metric_rank=4, description="rank-4 map, tied"),
    )
}

# The comparison behind claims 1-3 (every baseline and the main DAMCHA couplings).
HEADLINE = (
    "mha",
    "talking-heads",
    "damcha-heads-tied",
    "damcha-heads-separate",
    "damcha-heads-query",
    "damcha-lowrank-tied",
)
# Claim 4; damcha-heads-tied is the reference each ablation changes in one respect.
ABLATION = (
    "mha",
    "damcha-heads-tied",
    "damcha-heads-tied-shared",
    "damcha-heads-query",
    "damcha-heads-query-shared",
    "damcha-heads-tied-pen1e-3",
    "damcha-heads-tied-pen1e-2",
    "damcha-heads-tied-pen1e-1",
    "damcha-heads-tied-gate0.1",
    "damcha-heads-tied-mlr10",
    "damcha-lowrank-tied",
    "damcha-lowrank-tied-r4",
)
SUITES: dict[str, tuple[str, ...]] = {"headline": HEADLINE, "ablation": ABLATION}
# Which variant each ablation is compared with (the one thing it changes).
ABLATION_REFERENCE: dict[str, str] = {
    "damcha-heads-tied-shared": "damcha-heads-tied",
    "damcha-heads-query-shared": "damcha-heads-query",
    "damcha-heads-tied-pen1e-3": "damcha-heads-tied",
    "damcha-heads-tied-pen1e-2": "damcha-heads-tied",
    "damcha-heads-tied-pen1e-1": "damcha-heads-tied",
    "damcha-heads-tied-gate0.1": "damcha-heads-tied",
    "damcha-heads-tied-mlr10": "damcha-heads-tied",
    "damcha-lowrank-tied": "damcha-heads-tied",
    "damcha-lowrank-tied-r4": "damcha-heads-tied",
}


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise DamchaValueError(invalid_argument("name", f"one of {sorted(VARIANTS)}", f"name={name!r}"))
    return VARIANTS[name]
