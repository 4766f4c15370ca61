"""The metric generator as Flax NNX modules: ``MetricGenerator`` (phi(t) -> A(t)
or u(t), shareable between layers), ``CrossHeadMap`` (one side's gate and its
generator) and ``make_metric_generators``."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe

from . import _functional as F

Array = jax.Array


class MetricGenerator(nnx.Module):
    """The data-adaptive part of one side's cross-head map: phi(t) -> A(t) or u(t).

    Holds the generator ``kernel`` and ``bias`` (and, for metric "lowrank",
    the static factors ``u`` and ``v``); the per-layer gate lives in the
    layer. Pass one instance to several ``DamchaAttention`` layers (argument
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
        if metric not in ("heads", "lowrank"):
            raise DamchaValueError(f"`metric` must be one of ('heads', 'lowrank'). Received: metric={metric!r}")
        if metric == "lowrank" and (rank is None or head_dim is None):
            raise DamchaValueError(
                f"`rank` and `head_dim` are required with metric='lowrank'. Received: rank={rank!r}, head_dim={head_dim!r}"
            )
        self.in_features, self.num_heads, self.metric = in_features, num_heads, metric
        self.rank, self.head_dim = rank, head_dim
        E, S = in_features, num_heads

        def normal(shape: tuple[int, ...], fan_in: int) -> Array:
            # A Python float is weakly typed: the result stays in param_dtype (a
            # NumPy scalar would promote bfloat16 to float32, and float32 to
            # float64 under x64).
            return jax.random.normal(rngs.params(), shape, param_dtype) / float(np.sqrt(fan_in))

        if metric == "heads":
            self.kernel = nnx.Param(normal((E, S, S), E * S))
            self.bias = nnx.Param(jnp.zeros((S, S), param_dtype))
            self.u = nnx.data(None)
            self.v = nnx.data(None)
        else:
            r, d = rank, head_dim
            self.kernel = nnx.Param(normal((E, r), E))
            self.bias = nnx.Param(jnp.zeros((r,), param_dtype))
            self.u = nnx.Param(normal((S, d, r), r))
            self.v = nnx.Param(normal((S, d, r), S * d))

    def leaves(self) -> dict[str, nnx.Variable]:
        """Canonical leaf name (``kernel``, ``bias``, and ``u``, ``v`` for "lowrank") -> variable."""
        names = ("kernel", "bias") if self.metric == "heads" else ("kernel", "bias", "u", "v")
        return {leaf: getattr(self, leaf) for leaf in names}

    def __call__(self, tokens: Array) -> Array:
        """Coefficients for tokens (B, T, E): A (B, T, S, S) or u (B, T, r)."""
        return F.coefficients(self.metric, self.kernel[...], self.bias[...], jnp.asarray(tokens))


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
    return {
        side: MetricGenerator(
            config.side_features(side), config.side_heads(side), metric=config.metric,
            rank=config.metric_rank, head_dim=config.key_dim, param_dtype=param_dtype, rngs=rngs,
        )
        for side in config.metric_sides
    }


def _check_generator(side: str, gen: Any, config: DamchaConfig) -> MetricGenerator:
    if not isinstance(gen, MetricGenerator):
        raise DamchaTypeError(
            f"`metric_generator[{side!r}]` must be a MetricGenerator. Received: {describe(gen)}"
        )
    expected = (config.side_features(side), config.side_heads(side), config.metric, config.metric_rank,
                config.key_dim if config.metric == "lowrank" else gen.head_dim)
    got = (gen.in_features, gen.num_heads, gen.metric, gen.rank, gen.head_dim)
    if got != expected:
        raise DamchaValueError(
            f"`metric_generator[{side!r}]` does not fit this layer: expected (in_features, num_heads, metric, "
            f"rank, head_dim)={expected}. Received: {got}"
        )
    return gen


def given_generators(metric_generator: Any, config: DamchaConfig) -> dict[str, MetricGenerator] | None:
    """The caller's shared generators, checked against ``config``; None = make fresh ones."""
    if isinstance(metric_generator, MetricGenerator):
        if len(config.metric_sides) != 1:
            raise DamchaValueError(
                f"`metric_generator` must be a dict side -> MetricGenerator for sides {config.metric_sides}. "
                f"Received: a single {describe(metric_generator)}"
            )
        metric_generator = {config.metric_sides[0]: metric_generator}
    if metric_generator is None:
        return None
    if isinstance(metric_generator, Mapping):
        if set(metric_generator) != set(config.metric_sides):
            raise DamchaValueError(
                f"`metric_generator` must have exactly the sides {list(config.metric_sides)}. "
                f"Received: {sorted(metric_generator)}"
            )
        return {s: _check_generator(s, g, config) for s, g in metric_generator.items()}
    raise DamchaTypeError(
        "`metric_generator` must be a MetricGenerator, a dict side -> MetricGenerator or None. "
        f"Received: metric_generator={describe(metric_generator)}"
    )
