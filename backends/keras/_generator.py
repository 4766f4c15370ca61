"""The metric generator: the data-adaptive part of DAMCHA, shareable across a stack.

``KERAS_LEAVES`` is the one place that maps damcha_core's metric structures
(``METRIC_STRUCTURES``: leaf names, shapes, initialiser stds) to Keras
weights; the layer's canonical I/O reads the leaves through it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

import damcha_core as dc
import keras
from damcha_core import DamchaValueError, GeneratorSpec

from ._functional import generator, rms_normalise

__all__ = [
    "KERAS_LEAVES",
    "MetricGenerator",
    "hold",
    "read_sharing",
    "record_sharing",
    "rms_normalise",
    "serialize_generator",
    "shared_with_others",
]

# generator -> the layers that use it (DamchaAttention, a converted model's
# DamchaMaps), weakly: whether a weights file holds the generator under one
# layer's path for several layers (Keras saves a shared object once).
_HOLDERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


def hold(generator: Any, holder: Any) -> None:
    """Record that ``holder`` (a layer) maps with ``generator``."""
    _HOLDERS.setdefault(generator, weakref.WeakSet()).add(holder)


def shared_with_others(generators: Mapping[str, Any], holder: Any) -> bool:
    """Whether a live layer other than ``holder`` maps with one of ``generators``:
    Keras then saves that generator once, under the first holder's path."""
    return any(other is not holder for g in generators.values() for other in _HOLDERS.get(g, ()))


def record_sharing(store: Any, key: str, generators: Mapping[str, Any], holder: Any) -> None:
    """Write into a layer's weights ``store`` whether its ``generators`` are shared
    (nothing for a layer without a generator)."""
    if generators:
        store[key] = np.asarray(shared_with_others(generators, holder), dtype=np.int8)


def read_sharing(
    store: Any, key: str, generators: Mapping[str, Any], holder: Any
) -> tuple[Any, tuple[bool, bool] | None]:
    """(``store`` less the record ``record_sharing`` wrote, (saved, mine) where the
    record disagrees with ``holder``'s sharing, else None). A file saved before
    the record existed has none; a layer without a generator compares nothing
    (Keras's own count of the entries reports that mismatch)."""
    keys = list(store.keys())
    if key not in keys:
        return store, None
    saved, mine = bool(np.asarray(store[key])), shared_with_others(generators, holder)
    rest = {k: store[k] for k in keys if k != key}
    return rest, ((saved, mine) if generators and saved != mine else None)


# metric -> generator leaf -> seed offset of its initialiser (None: the table's
# std is 0, zeros). A generator's weights are named as the leaves, in the
# table's canonical shapes.
KERAS_LEAVES: dict[str, dict[str, int | None]] = {
    "heads": {"kernel": 0, "bias": None},
    "lowrank": {"kernel": 0, "bias": None, "u": 1, "v": 2},
}
_NAMES = {"num_heads": "num_heads", "key_dim": "key_dim", "metric_rank": "metric_rank", "seed": "seed"}


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
        metric = dc.check_choice("metric", metric, tuple(KERAS_LEAVES))
        if metric == "lowrank" and key_dim is None:
            raise DamchaValueError(
                dc.invalid_argument("key_dim", "an int >= 1 with metric='lowrank' (it is required)", "key_dim=None")
            )
        args = dc.check_layer_args(
            num_heads=num_heads, key_dim=1 if key_dim is None else key_dim, metric=metric, metric_rank=metric_rank
        )
        self.num_heads = args["num_heads"]
        self.metric = metric
        self.key_dim = None if key_dim is None else args["key_dim"]
        self.metric_rank = args["metric_rank"]
        self.seed = dc.check_seed("seed", seed)
        self.features: int | None = None
        self._zero_init = False  # see DamchaAttention._zero_init

    def _initializer(self, stddev: float, offset: int | None) -> Any:
        if self._zero_init or offset is None or stddev == 0.0:
            return keras.initializers.Zeros()
        seed = None if self.seed is None else self.seed + offset
        return keras.initializers.RandomNormal(stddev=stddev, seed=seed)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        E = input_shape[-1]
        if E is None:
            raise DamchaValueError(
                dc.invalid_argument(
                    "input_shape",
                    f"a known feature size (last axis) for the tokens fed to MetricGenerator {self.name!r}",
                    f"input_shape={tuple(input_shape)}",
                )
            )
        self.features = int(E)
        structure = dc.METRIC_STRUCTURES[self.metric]
        sizes = (self.features, self.num_heads, self.key_dim or 1, self.metric_rank)
        shapes, stds = structure.shapes(*sizes), structure.stds(*sizes)
        for leaf, offset in KERAS_LEAVES[self.metric].items():
            weight = self.add_weight(name=leaf, shape=shapes[leaf], initializer=self._initializer(stds[leaf], offset))
            setattr(self, leaf, weight)

    def spec(self, features: int | None = None) -> GeneratorSpec:
        """What this generator fits (``damcha_core.GeneratorSpec``); an unbuilt
        generator takes its feature size from the first tokens, so ``features``
        stands in for it until then."""
        E = self.features if self.features is not None else features
        if E is None:
            raise DamchaValueError(
                dc.invalid_argument(
                    "features",
                    f"an int: MetricGenerator {self.name!r} is not built, so its feature size is unknown",
                    "features=None",
                )
            )
        return GeneratorSpec(
            features=E,
            heads=self.num_heads,
            metric=self.metric,
            head_dim=self.key_dim,
            rank=self.metric_rank,
        )

    def leaf_names(self) -> tuple[str, ...]:
        """The canonical leaves this generator holds, in canonical order."""
        return dc.METRIC_STRUCTURES[self.metric].generator_leaves

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
