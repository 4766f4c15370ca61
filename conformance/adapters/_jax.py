"""The JAX adapter: ``damcha_jax``'s pure functional API held to the NumPy reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from damcha_core import DamchaValueError, invalid_argument
from damcha_jax import damcha_attention, decode_step, init_cache, metric_penalty

_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}

# The catalogue's programs are tiny and run once: XLA's CPU compile time is
# all that counts, and the fusion emitters plus LLVM's optimisations cost ~5x
# more than the legacy emitters at -O0 while giving the same IEEE arithmetic.
_CPU_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}


class JaxAdapter:
    """``damcha_conformance.BackendAdapter`` for ``damcha_jax.damcha_attention``.

    Each case and dtype is one jitted program computing the output and, for
    cases with a gradient check, the gradients of ``sum(output * cotangent)``
    through ``jax.value_and_grad`` (``forward`` keeps them for the
    ``gradients`` call that follows it). ``weights`` is
    ``damcha_attention(..., return_weights=True)``; ``metric_penalty`` is
    ``damcha_jax.metric_penalty``, computed with its gradients in one program
    (kept for ``metric_penalty_gradients``).

    dtypes: float32 and bfloat16, plus float64 when ``jax_enable_x64`` is on
    (``JAX_ENABLE_X64=1`` before importing jax). Without x64 JAX silently
    computes "float64" in float32, so the adapter refuses float64 then
    instead of reporting float32 numbers under its name.
    """

    name = "jax"
    supports_gradients = True

    def __init__(self) -> None:
        x64 = bool(jax.config.read("jax_enable_x64"))
        self.dtypes: Sequence[str] = ("float32", "bfloat16", "float64") if x64 else ("float32", "bfloat16")
        self._last: tuple[tuple[str, str], dict[str, np.ndarray]] | None = None
        self._last_penalty: tuple[tuple[str, str], dict[str, np.ndarray]] | None = None

    def unsupported(self, case: Any) -> str | None:
        return None

    @staticmethod
    def _dtype(dtype: str) -> Any:
        if dtype not in _JNP_DTYPES:
            raise DamchaValueError(invalid_argument("dtype", f"one of {tuple(_JNP_DTYPES)}", f"dtype={dtype!r}"))
        if dtype == "float64" and not jax.config.read("jax_enable_x64"):
            raise DamchaValueError(
                invalid_argument(
                    "dtype",
                    "a dtype JAX computes in: float64 needs JAX's x64 mode (JAX_ENABLE_X64=1 or "
                    "jax.config.update('jax_enable_x64', True))",
                    "dtype='float64' with x64 disabled",
                )
            )
        return _JNP_DTYPES[dtype]

    def _arrays(self, data: Any, dtype: str) -> tuple[Any, dict[str, Any], dict[str, Any], Any]:
        """(dt, params, inputs, mask) of a case in ``dtype``; inputs: "query", and "context",
        "value" when the case has them."""
        dt = self._dtype(dtype)
        params = {n: jnp.asarray(v, dt) for n, v in data.params.items()}
        inputs = {"query": jnp.asarray(data.query, dt)}
        if data.context is not None:
            inputs["context"] = jnp.asarray(data.context, dt)
        if data.value is not None:  # value tokens of their own size (E_v != E_kv)
            inputs["value"] = jnp.asarray(data.value, dt)
        mask = None if data.mask is None else jnp.asarray(data.mask)
        return dt, params, inputs, mask

    @staticmethod
    def _jit(fn: Any) -> Any:
        options = _CPU_COMPILE_OPTIONS if jax.default_backend() == "cpu" else None
        return jax.jit(fn, compiler_options=options)

    def _run(self, data: Any, dtype: str, gradients: bool) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        dt, params, inputs, mask = self._arrays(data, dtype)
        config, causal = data.config, data.causal
        cotangent = jnp.asarray(data.cotangent, dt)
        # Report in float32 at least: NumPy has no bfloat16 arithmetic.
        wide = jnp.promote_types(dt, jnp.float32)

        def loss(params, inputs, mask):
            out = damcha_attention(
                params,
                config,
                inputs["query"],
                inputs.get("context"),
                value=inputs.get("value"),
                mask=mask,
                is_causal=causal,
            )
            return jnp.sum((out * cotangent).astype(wide)), out

        fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True) if gradients else loss
        result = self._jit(fn)(params, inputs, mask)
        to_np = lambda a: np.asarray(a.astype(wide), dtype=np.float64)  # noqa: E731
        if not gradients:
            return to_np(result[1]), None
        (_, out), (g_params, g_inputs) = result
        grads = {name: to_np(g) for name, g in g_inputs.items()}
        grads.update({name: to_np(g) for name, g in g_params.items()})
        return to_np(out), grads

    def forward(self, data: Any, dtype: str) -> np.ndarray:
        out, grads = self._run(data, dtype, gradients=data.case.gradients)
        self._last = ((data.case.name, dtype), grads) if grads is not None else None
        return out

    def weights(self, data: Any, dtype: str) -> np.ndarray:
        dt, params, inputs, mask = self._arrays(data, dtype)
        config, causal = data.config, data.causal

        def probabilities(params, inputs, mask):
            _, weights = damcha_attention(
                params,
                config,
                inputs["query"],
                inputs.get("context"),
                value=inputs.get("value"),
                mask=mask,
                is_causal=causal,
                return_weights=True,
            )
            return weights

        weights = self._jit(probabilities)(params, inputs, mask)
        return np.asarray(weights.astype(jnp.promote_types(dt, jnp.float32)), dtype=np.float64)

    def _penalty(self, data: Any, dtype: str) -> tuple[float, dict[str, np.ndarray]]:
        """The penalty and its gradients, in one jitted program."""
        dt, params, inputs, _ = self._arrays(data, dtype)
        config = data.config

        def penalty(params, inputs):
            return metric_penalty(params, config, inputs["query"], inputs.get("context"), value=inputs.get("value"))

        value, (g_params, g_inputs) = self._jit(jax.value_and_grad(penalty, argnums=(0, 1)))(params, inputs)
        wide = jnp.promote_types(dt, jnp.float32)
        grads = {name: np.asarray(g.astype(wide), dtype=np.float64) for name, g in {**g_inputs, **g_params}.items()}
        return float(value), grads

    def metric_penalty(self, data: Any, dtype: str) -> float:
        value, grads = self._penalty(data, dtype)
        self._last_penalty = ((data.case.name, dtype), grads)
        return value

    def metric_penalty_gradients(self, data: Any, dtype: str) -> dict[str, np.ndarray]:
        cached, self._last_penalty = self._last_penalty, None
        if cached is not None and cached[0] == (data.case.name, dtype):
            return cached[1]
        return self._penalty(data, dtype)[1]

    def decode(self, data: Any, dtype: str) -> np.ndarray:
        """``data.case.steps`` through ``init_cache`` + ``decode_step`` (eager: a
        few tiny programs, no jit needed); every step's outputs."""
        dt = self._dtype(dtype)
        params = {n: jnp.asarray(v, dt) for n, v in data.params.items()}
        x = jnp.asarray(data.query, dt)
        cache = init_cache(data.config, x.shape[0], x.shape[1], dt)
        outs = []
        for start, stop in data.case.steps:
            y, cache = decode_step(params, data.config, cache, x[:, start:stop])
            outs.append(y)
        wide = jnp.promote_types(dt, jnp.float32)
        return np.asarray(jnp.concatenate(outs, axis=1).astype(wide), dtype=np.float64)

    def gradients(self, data: Any, dtype: str) -> dict[str, np.ndarray]:
        key = (data.case.name, dtype)
        if self._last is not None and self._last[0] == key:
            grads = self._last[1]
        else:
            computed = self._run(data, dtype, gradients=True)[1]
            assert computed is not None  # _run returns them when asked
            grads = computed
        self._last = None
        return grads
