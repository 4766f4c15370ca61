"""Canonical parameter I/O of the NNX modules: ``to_canonical``,
``load_canonical``, ``from_canonical``, ``save``/``load`` (the vocabulary every
port shares), with the old ``to_params``/``set_params``/``from_params`` kept
one release as deprecated aliases."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

import damcha_core as dc
import jax
import jax.numpy as jnp
from damcha_core import DamchaConfig, DamchaValueError
from damcha_core._params import check_no_config_kwargs, detached

Array = jax.Array

_PROJECTIONS = (("query", "query"), ("key", "key"), ("value", "value"), ("output", "out"))


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"`{old}` is deprecated; use `{new}` (same result).", DeprecationWarning, stacklevel=3)


def variables(layer: Any) -> dict[str, nnx.Variable]:
    """Canonical name -> the NNX variable of ``layer`` (a ``DamchaAttention``) holding it."""
    if getattr(layer, "normalize_qk", False):
        raise DamchaValueError(
            "A layer with normalize_qk=True has no canonical parameters: DAMCHA v1's canonical format "
            "(damcha_core) has no LayerNorm on q and k. Received: normalize_qk=True"
        )
    out: dict[str, nnx.Variable] = {}
    for name, attr in _PROJECTIONS:
        module = getattr(layer, attr)
        out[f"{name}.kernel"] = module.kernel
        if layer.use_bias:
            out[f"{name}.bias"] = module.bias
    for side in layer.config.metric_sides:
        cross = layer.metric[side]
        out[f"metric.{side}.gate"] = cross.gate
        out.update({f"metric.{side}.{leaf}": var for leaf, var in cross.generator.leaves().items()})
    return {name: out[name] for name in layer.config.param_shapes()}


def check_compute_fit(params: Mapping[str, Any], dtype: Any) -> None:
    """``check_params_fit`` against a module's compute ``dtype`` (Flax's
    ``dtype=``: the parameters are promoted to it in every call), when one is
    set: float32 parameters of a ``dtype=float16`` layer that hold 1e5 load
    fine and make every output inf or NaN."""
    if dtype is None or not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        return
    compute = jax.dtypes.canonicalize_dtype(dtype)  # float64 is float32 unless jax_enable_x64 is on
    dc.check_params_fit(params, f"{compute.name}, the compute dtype (dtype=)", float(jnp.finfo(compute).max))


class CanonicalIO:
    """Canonical I/O of ``DamchaAttention`` (a base class; needs ``config``,
    ``param_dtype`` and the variables that ``variables`` reads)."""

    config: DamchaConfig
    param_dtype: Any

    def _variables(self) -> dict[str, nnx.Variable]:
        found = variables(self)
        shapes = self.config.param_shapes()
        for name, var in found.items():
            shape = tuple(var.shape)
            if shape != shapes[name]:
                # Layers stacked by nnx.vmap/nnx.scan (what replace_mha/from_mha make of a stacked
                # MHA): every variable carries the layer axes, and one layer's params would load
                # into all of them (or read as arrays of no canonical shape).
                raise DamchaValueError(
                    dc.invalid_argument(
                        "self",
                        "one layer: canonical params are one layer's, in damcha_core's shapes (for layers "
                        "stacked by nnx.vmap/nnx.scan, take layer i's first: graphdef, state = nnx.split(layer); "
                        "nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)))",
                        f"a layer whose {name} has shape {shape}, where one layer's is {shapes[name]}",
                    )
                )
        return found

    def arrays(self) -> dict[str, Array]:
        """The canonical params as JAX arrays in ``param_dtype`` (what ``damcha_attention`` takes)."""
        return {name: var[...] for name, var in self._variables().items()}

    def to_canonical(self) -> dict[str, np.ndarray]:
        """The canonical params as float64 NumPy arrays (``damcha_core``'s names and shapes)."""
        return {name: np.asarray(value, dtype=np.float64) for name, value in self.arrays().items()}

    def load_canonical(self, params: Mapping[str, Any]) -> Any:
        """Load canonical params (validated against ``self.config``: names,
        shapes, dtypes, finite values), cast to ``param_dtype``; returns self.
        A shared generator is shared: loading it here sets it for every layer
        that holds it."""
        checked = dc.validate_params(detached(params), self.config)
        # What JAX stores: float64 is float32 unless jax_enable_x64 is on (1e39 loaded as inf, silently).
        dtype = jax.dtypes.canonicalize_dtype(self.param_dtype)
        name = dtype.name if dtype == jnp.dtype(self.param_dtype) else f"{dtype.name} (float64 without jax_enable_x64)"
        dc.check_params_fit(checked, name, float(jnp.finfo(dtype).max))
        check_compute_fit(checked, getattr(self, "dtype", None))
        for name, var in self._variables().items():
            var[...] = jnp.asarray(checked[name], self.param_dtype)
        return self

    @classmethod
    def from_canonical(
        cls, params: Mapping[str, Any], config: DamchaConfig, *, rngs: nnx.Rngs | None = None, **kwargs: Any
    ) -> Any:
        """A layer with ``config``'s shape holding ``params``; ``kwargs`` are
        the non-shape arguments (dtype, param_dtype, decode, deterministic, ...)."""
        dc.check_config(config)
        from_config = dict(
            num_heads=config.num_heads,
            in_features=config.query_dim,
            qkv_features=None,
            out_features=config.output_dim,
            num_kv_heads=config.num_kv_heads,
            in_kv_features=config.context_dim,
            # Values of their own feature size (E_v != E_kv): the value kernel is (E_v, G, d_v);
            # without it the layer expects (E_kv, ...) and blames the params.
            in_v_features=config.value_input_dim if config.value_input_dim != config.context_dim else None,
            key_dim=config.key_dim,
            value_dim=config.value_dim,
            metric=config.metric,
            metric_rank=config.metric_rank,
            coupling=config.coupling,
            scale=config.scale,
            dropout_rate=config.dropout,
            use_bias=config.use_bias,
        )
        check_no_config_kwargs(kwargs, from_config)
        layer = cls(**from_config, rngs=rngs or nnx.Rngs(0), **kwargs)  # type: ignore[call-arg]
        return layer.load_canonical(params)

    def save(self, path: str | os.PathLike) -> None:
        """Write the canonical params and config as safetensors (``damcha_core.save_params``)."""
        dc.save_params(path, self.to_canonical(), self.config)

    @classmethod
    def load(cls, path: str | os.PathLike, *, rngs: nnx.Rngs | None = None, **kwargs: Any) -> Any:
        """Read a file written by ``save`` (or any port's ``save_params``)."""
        params, config = dc.load_params(path)
        return cls.from_canonical(params, config, rngs=rngs, **kwargs)

    # ------------------------------------------------ deprecated (one release)

    def to_params(self) -> dict[str, np.ndarray]:
        """Deprecated alias of ``to_canonical``."""
        _deprecated("to_params", "to_canonical")
        return self.to_canonical()

    def set_params(self, params: Mapping[str, Any]) -> Any:
        """Deprecated alias of ``load_canonical``."""
        _deprecated("set_params", "load_canonical")
        return self.load_canonical(params)

    @classmethod
    def from_params(cls, params: Mapping[str, Any], config: DamchaConfig, **kwargs: Any) -> Any:
        """Deprecated alias of ``from_canonical``."""
        _deprecated("from_params", "from_canonical")
        return cls.from_canonical(params, config, **kwargs)
