"""The metric generator as Flax NNX modules: ``MetricGenerator`` (phi(t) -> A(t)
or u(t), shareable between layers), ``CrossHeadMap`` (one side's gate and its
generator) and ``make_metric_generators``.

This is the port's one mapping of ``damcha_core``'s metric-structure table
(``METRIC_STRUCTURES``) to Flax: the leaves, their shapes and initialisers
come from the table; the math is the table's, evaluated with ``jax.numpy`` in
``_functional``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

import jax
import jax.numpy as jnp
from damcha_core import (
    METRIC_STRUCTURES,
    DamchaConfig,
    DamchaValueError,
    GeneratorSpec,
    check_choice,
    check_int,
    invalid_argument,
    resolve_generators,
)

from . import _functional as F

Array = jax.Array


class MetricGenerator(nnx.Module):
    """The data-adaptive part of one side's cross-head map: phi(t) -> A(t) or u(t).

    Holds the generator's leaves of ``damcha_core.METRIC_STRUCTURES[metric]``
    (``kernel`` and ``bias``, and for metric "lowrank" the static factors
    ``u`` and ``v``); the per-layer gate lives in the layer. Pass one
    instance to several ``DamchaAttention`` layers (argument
    ``metric_generator``) for stack-wise sharing: NNX keeps it a single
    shared node, so ``nnx.split``/``nnx.grad`` see it once and its gradient
    sums over the layers.

    Args:
        in_features: E, feature size of the tokens feeding this side.
        num_heads: S, heads the map acts on.
        metric: "heads" (kernel (E, S, S), bias (S, S)) or "lowrank"
            (kernel (E, r), bias (r,), u and v (S, d, r)).
        rank: r, required for "lowrank".
        head_dim: d, required for "lowrank".
        param_dtype: dtype of the parameters.
        rngs: initialisation RNGs (stream ``params``).
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        *,
        metric: str = "heads",
        rank: int | None = None,
        head_dim: int | None = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        metric = check_choice("metric", metric, tuple(METRIC_STRUCTURES))
        structure = METRIC_STRUCTURES[metric]
        E, S = check_int("in_features", in_features), check_int("num_heads", num_heads)
        needs = [leaf.dims for leaf in structure.leaves if leaf.generator]
        uses_rank = any("r" in dims for dims in needs)
        if uses_rank and rank is None or structure.uses_head_dim and head_dim is None:
            missing = "rank" if uses_rank and rank is None else "head_dim"
            raise DamchaValueError(
                invalid_argument(
                    missing,
                    f"an int >= 1 with metric={metric!r} (it is required)",
                    f"rank={rank!r}, head_dim={head_dim!r}",
                )
            )
        r = check_int("rank", rank, optional=True)
        d = check_int("head_dim", head_dim, optional=True)
        self.in_features, self.num_heads, self.metric = E, S, metric
        self.rank, self.head_dim = r, d
        shapes, stds = structure.shapes(E, S, d, r), structure.stds(E, S, d, r)  # type: ignore[arg-type]
        self._leaf_names = structure.generator_leaves
        for leaf in structure.generator_leaves:
            shape, std = shapes[leaf], stds[leaf]
            if std == 0.0:
                value = jnp.zeros(shape, param_dtype)
            else:
                # A Python float is weakly typed: the result stays in param_dtype.
                value = jax.random.normal(rngs.params(), shape, param_dtype) * float(std)
            setattr(self, leaf, nnx.Param(value))
        for leaf in ("u", "v"):  # the attribute names of both structures exist (None when unused)
            if not hasattr(self, leaf):
                setattr(self, leaf, nnx.data(None))

    @property
    def spec(self) -> GeneratorSpec:
        """What this generator was built for (``damcha_core.GeneratorSpec``)."""
        return GeneratorSpec(self.in_features, self.num_heads, self.metric, self.head_dim, self.rank)

    def leaves(self) -> dict[str, nnx.Variable]:
        """Canonical leaf name (the table's generator leaves) -> variable."""
        return {leaf: getattr(self, leaf) for leaf in self._leaf_names}

    def __call__(self, tokens: Array) -> Array:
        """Coefficients for tokens (B, T, E): A (B, T, S, S) or u (B, T, r)."""
        tokens = F.check_float("tokens", tokens)
        leaves = {leaf: var[...] for leaf, var in self.leaves().items()}
        return METRIC_STRUCTURES[self.metric].coefficients(jnp, F.rms_normalise(tokens), leaves)


class CrossHeadMap(nnx.Module):
    """One side's map L(t) = I + diag(gate) Delta(t): its own gate (S,),
    starting at 0 (exactly MHA), and a possibly shared ``MetricGenerator``."""

    def __init__(self, generator: MetricGenerator, *, param_dtype: Any = jnp.float32) -> None:
        self.gate = nnx.Param(jnp.zeros((generator.num_heads,), param_dtype))
        self.generator = generator


def make_metric_generators(
    config: DamchaConfig, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs
) -> dict[str, MetricGenerator]:
    """Fresh generators for every metric side of ``config`` (``{}`` for metric
    "none"): build once, then pass to each layer of a stack."""
    F._check_config(config)
    out = {}
    for side in config.metric_sides:
        spec = config.generator_spec(side)
        out[side] = MetricGenerator(
            spec.features,
            spec.heads,
            metric=spec.metric,
            rank=spec.rank,
            head_dim=spec.head_dim,
            param_dtype=param_dtype,
            rngs=rngs,
        )
    return out


def resolve_metric_generators(
    given: Any, config: DamchaConfig, *, names: Mapping[str, str] | None = None, coupling_was_auto: bool = False
) -> dict[str, MetricGenerator]:
    """The caller's shared generators by side (``{}``: make fresh ones), by the
    one rule of ``damcha_core.resolve_generators`` (``names``: the layer's
    argument names; ``coupling_was_auto``: the caller passed no coupling, so
    messages say it was chosen automatically)."""
    return resolve_generators(
        given,
        config,
        generator_type=MetricGenerator,
        spec_of=lambda g: g.spec,
        names=names,
        coupling_was_auto=coupling_was_auto,
    )
