"""The metric generator: the data-adaptive part of DAMCHA, shareable across a stack."""

from __future__ import annotations

import math
from typing import Any

import keras

from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe

from ._functional import generator, rms_normalise

_METRICS = ("heads", "lowrank")

__all__ = ["MetricGenerator", "rms_normalise", "serialize_generator"]


@keras.saving.register_keras_serializable(package="damcha")
class MetricGenerator(keras.layers.Layer):
    """Maps each token t (B, T, E) to the coefficients of its cross-head map.

    metric "heads": A(t) = phi(t)·W + b, shape (B, T, S, S), with
    ``kernel`` (E, S, S) and ``bias`` (S, S). metric "lowrank": u(t) =
    phi(t)·W + b, shape (B, T, r), with ``kernel`` (E, r), ``bias`` (r,) and
    the static factors ``u``, ``v`` (S, d, r).

    One generator can be passed to several ``DamchaAttention`` layers as
    ``metric_generator``: that is DAMCHA's stack-wise sharing. Each attention
    layer keeps its own gate, so a shared generator still starts as plain MHA.
    Sharing survives ``.keras`` save/load (Keras's object-sharing scope
    restores one generator for all the layers that used it).

    Args:
        num_heads: S, the number of heads the map acts on.
        metric: "heads" or "lowrank".
        key_dim: d, the head size; required for "lowrank" (the size of u, v).
        metric_rank: r; required for "lowrank", must be None for "heads".
        seed: seed of the initialisers (the spec's scaled normals).
        **kwargs: base ``keras.layers.Layer`` arguments (name, dtype, ...).

    The feature size E is taken from the first input, as ``Dense`` does.
    """

    def __init__(
        self,
        num_heads: int,
        metric: str = "heads",
        key_dim: int | None = None,
        metric_rank: int | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if metric not in _METRICS:
            raise DamchaValueError(
                f"`metric` of a MetricGenerator must be one of {_METRICS}. Received: metric={describe(metric)}"
            )
        # DamchaConfig applies the reference's rules (ints >= 1, rank only with lowrank).
        if metric == "lowrank" and key_dim is None:
            raise DamchaValueError("`key_dim` is required with metric='lowrank'. Received: key_dim=None")
        probe = DamchaConfig(
            query_dim=1, num_heads=num_heads, key_dim=1 if key_dim is None else key_dim,
            metric=metric, metric_rank=metric_rank,
        )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise DamchaTypeError(f"`seed` must be an int or None. Received: seed={describe(seed)}")
        self.num_heads = probe.num_heads
        self.metric = metric
        self.key_dim = key_dim
        self.metric_rank = probe.metric_rank
        self.seed = seed
        self.features: int | None = None
        self._zero_init = False  # see DamchaAttention._zero_init

    def _initializer(self, stddev: float, offset: int) -> keras.initializers.Initializer:
        if self._zero_init:
            return keras.initializers.Zeros()
        seed = None if self.seed is None else self.seed + offset
        return keras.initializers.RandomNormal(stddev=stddev, seed=seed)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        E = input_shape[-1]
        if E is None:
            raise DamchaValueError(
                f"the tokens fed to MetricGenerator {self.name!r} need a known feature size. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        E, S = int(E), self.num_heads
        self.features = E
        # Stds from damcha_core._params: they make phi·W entries O(1/sqrt(S)).
        if self.metric == "heads":
            self.kernel = self.add_weight(name="kernel", shape=(E, S, S), initializer=self._initializer(1 / math.sqrt(E * S), 0))
            self.bias = self.add_weight(name="bias", shape=(S, S), initializer="zeros")
        else:
            d, r = self.key_dim, self.metric_rank
            self.kernel = self.add_weight(name="kernel", shape=(E, r), initializer=self._initializer(1 / math.sqrt(E), 0))
            self.bias = self.add_weight(name="bias", shape=(r,), initializer="zeros")
            self.u = self.add_weight(name="u", shape=(S, d, r), initializer=self._initializer(1 / math.sqrt(r), 1))
            self.v = self.add_weight(name="v", shape=(S, d, r), initializer=self._initializer(1 / math.sqrt(S * d), 2))

    def check_compatible(self, features: int, num_heads: int, key_dim: int, metric: str, metric_rank: int | None, user: str) -> None:
        """Raise unless this generator fits the side of layer ``user``."""
        mine = (self.metric, self.num_heads, self.metric_rank) + ((self.key_dim,) if self.metric == "lowrank" else ())
        theirs = (metric, num_heads, metric_rank) + ((key_dim,) if metric == "lowrank" else ())
        if mine != theirs or (self.features is not None and self.features != features):
            raise DamchaValueError(
                f"`metric_generator` {self.name!r} does not fit layer {user!r}: the generator has "
                f"(metric, heads, rank{', key_dim' if self.metric == 'lowrank' else ''}) = {mine} and "
                f"features={self.features}, the layer needs {theirs} and features={features}"
            )

    def leaf_names(self) -> tuple[str, ...]:
        """The canonical leaves this generator holds, in canonical order."""
        return ("kernel", "bias") if self.metric == "heads" else ("kernel", "bias", "u", "v")

    def call(self, tokens: Any) -> Any:
        """Coefficients (B, T, S, S) for "heads", (B, T, r) for "lowrank"."""
        return generator(self.metric, self.kernel, self.bias, tokens)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        if self.metric == "heads":
            return tuple(input_shape[:-1]) + (self.num_heads, self.num_heads)
        return tuple(input_shape[:-1]) + (self.metric_rank,)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "metric": self.metric,
            "key_dim": self.key_dim,
            "metric_rank": self.metric_rank,
            "seed": self.seed,
        }


def serialize_generator(generator: MetricGenerator) -> dict[str, Any]:
    """Serialise a generator so that a .keras load rebuilds one object for all its users.

    Keras's ObjectSharingScope (active during ``save``/``load_model``) reuses
    the object of a config that carries ``shared_object_id``; stamping the id
    on every user's copy does not depend on the order or number of
    ``get_config`` calls the saver makes. Outside a load, each copy is new.
    """
    config = keras.saving.serialize_keras_object(generator)
    config["shared_object_id"] = id(generator)
    return config
