"""The Keras adapter: ``damcha_keras.DamchaAttention`` under the current Keras backend.

The layer itself is backend-neutral; gradients are not (Keras 3 has no
``keras.ops`` autodiff), so ``gradients`` dispatches to the backend's own
autodiff: ``tf.GradientTape``, ``jax.grad`` over ``stateless_call``, or
``torch.autograd``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from damcha_core import DamchaValueError
from damcha_keras import DamchaAttention

from .._cases import Case, CaseData


def _backend_dtypes(backend: str) -> tuple[str, ...]:
    if backend == "jax":
        import jax

        # JAX computes float64 only with x64 enabled (JAX_ENABLE_X64=1).
        return ("float32", "float64") if jax.config.read("jax_enable_x64") else ("float32",)
    return ("float32", "float64")


class KerasAdapter:
    """Runs ``DamchaAttention`` on the current ``KERAS_BACKEND``.

    Masks arrive 4-D (B|1, H|1, N|1, M) and are passed as ``attention_mask``
    (the layer accepts Keras's (B, N, M) and the 4-D form); the case's causal
    flag becomes ``use_causal_mask``. ``weights`` calls the layer with
    ``return_attention_scores=True``; ``metric_penalty`` builds it with
    ``metric_l2=1.0`` and reads the loss a call adds (``layer.losses``), which
    is then the penalty itself.
    """

    supports_gradients = True

    def __init__(self) -> None:
        self.backend = keras.backend.backend()
        self.name = f"keras-{self.backend}"
        self.dtypes: Sequence[str] = _backend_dtypes(self.backend)
        self._cached: tuple[tuple[str, str, float], DamchaAttention] | None = None
        self._jax_grads: tuple[tuple[str, str], dict[str, Any]] | None = None
        self._jax_penalty: tuple[tuple[str, str], dict[str, Any]] | None = None

    def unsupported(self, case: Case) -> str | None:
        return None

    def _layer(self, data: CaseData, dtype: str, metric_l2: float = 0.0) -> DamchaAttention:
        # The runner asks for the output, then the gradients, of the same case (or its penalty,
        # then the penalty's gradients): building once halves the variable creation.
        key = (data.case.name, dtype, metric_l2)
        if self._cached is None or self._cached[0] != key:
            layer = DamchaAttention.from_canonical(data.params, data.config, dtype=dtype, metric_l2=metric_l2)
            self._cached = (key, layer)
        return self._cached[1]

    @staticmethod
    def _tensors(data: CaseData, dtype: str) -> dict[str, Any]:
        """The case's inputs as tensors: "query", plus "context" and "value" when given."""
        tensors = {"query": keras.ops.convert_to_tensor(data.query.astype(dtype))}
        for name in ("context", "value"):
            array = getattr(data, name)
            if array is not None:
                tensors[name] = keras.ops.convert_to_tensor(array.astype(dtype))
        return tensors

    @staticmethod
    def _mask(data: CaseData) -> Any:
        return None if data.mask is None else keras.ops.convert_to_tensor(data.mask)

    def forward(self, data: CaseData, dtype: str) -> np.ndarray:
        layer = self._layer(data, dtype)
        tensors, mask = self._tensors(data, dtype), self._mask(data)
        if self.backend == "jax":
            # One jitted compilation gives the output and the gradients (kept for
            # the runner's next call): compiling dominates JAX's time here.
            out, grads = _value_and_grads_jax(layer, tensors, mask, data)
            self._jax_grads = ((data.case.name, dtype), grads)
        else:
            out = _call(layer, tensors, mask, data.causal)
        return np.asarray(keras.ops.convert_to_numpy(out), dtype=np.float64)

    def weights(self, data: CaseData, dtype: str) -> np.ndarray:
        layer = self._layer(data, dtype)
        _, scores = _call(
            layer, self._tensors(data, dtype), self._mask(data), data.causal, return_attention_scores=True
        )
        return np.asarray(keras.ops.convert_to_numpy(scores), dtype=np.float64)

    def metric_penalty(self, data: CaseData, dtype: str) -> float:
        layer = self._layer(data, dtype, metric_l2=1.0)
        tensors, mask = self._tensors(data, dtype), self._mask(data)
        if self.backend == "jax":
            penalty, grads = _penalty_and_grads_jax(layer, tensors, mask, data)
            self._jax_penalty = ((data.case.name, dtype), grads)
        else:
            _call(layer, tensors, mask, data.causal)
            penalty = _added_loss(layer)
        return float(keras.ops.convert_to_numpy(penalty))

    def metric_penalty_gradients(self, data: CaseData, dtype: str) -> dict[str, np.ndarray]:
        layer = self._layer(data, dtype, metric_l2=1.0)
        tensors, mask = self._tensors(data, dtype), self._mask(data)
        if self.backend == "jax":
            cached, self._jax_penalty = self._jax_penalty, None
            if cached is not None and cached[0] == (data.case.name, dtype):
                grads = cached[1]
            else:
                grads = _penalty_and_grads_jax(layer, tensors, mask, data)[1]
            return {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
        grad_fn = {"tensorflow": _grads_tf, "torch": _grads_torch}.get(self.backend)
        if grad_fn is None:
            raise DamchaValueError(f"no gradient support for Keras backend {self.backend!r}")
        _call(layer, tensors, mask, data.causal)
        if not layer.losses:  # metric "none" adds no loss: nothing depends on any tensor
            shapes = {k: tuple(v.shape) for k, v in tensors.items()}
            shapes.update({n: tuple(v.shape) for n, v in layer.canonical_variables().items()})
            return {k: np.zeros(shape) for k, shape in shapes.items()}

        def loss_of(inputs: dict[str, Any], call: Callable[..., Any]) -> Any:
            _call(call, inputs, mask, data.causal)
            return _added_loss(layer)

        grads = grad_fn(layer, list(layer.canonical_variables()), tensors, loss_of)
        return {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}

    def decode(self, data: CaseData, dtype: str) -> np.ndarray:
        """``data.case.steps`` through the layer's KerasHub-style cache, each
        written at its ``cache_update_index``; every step's outputs."""
        layer = DamchaAttention.from_canonical(data.params, data.config, dtype=dtype)
        x = data.query.astype(dtype)
        cache, outs = layer.init_cache(x.shape[0], x.shape[1]), []
        for start, stop in data.case.steps:
            t = keras.ops.convert_to_tensor(x[:, start:stop])
            y, cache = layer(t, t, use_causal_mask=True, cache=cache, cache_update_index=start)
            outs.append(np.asarray(keras.ops.convert_to_numpy(y), dtype=np.float64))
        return np.concatenate(outs, axis=1)

    def gradients(self, data: CaseData, dtype: str) -> dict[str, np.ndarray]:
        layer = self._layer(data, dtype)
        tensors, mask = self._tensors(data, dtype), self._mask(data)
        cotangent = data.cotangent.astype(dtype)
        if self.backend == "jax":
            cached = self._jax_grads
            if cached is not None and cached[0] == (data.case.name, dtype):
                grads = cached[1]
            else:
                grads = _value_and_grads_jax(layer, tensors, mask, data)[1]
            return {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
        grad_fn = {"tensorflow": _grads_tf, "torch": _grads_torch}.get(self.backend)
        if grad_fn is None:
            raise DamchaValueError(f"no gradient support for Keras backend {self.backend!r}")
        names = list(layer.canonical_variables())

        def loss_of(inputs: dict[str, Any], call: Callable[..., Any]) -> Any:
            out = _call(call, inputs, mask, data.causal)
            return keras.ops.sum(out * keras.ops.convert_to_tensor(cotangent))

        grads = grad_fn(layer, names, tensors, loss_of)
        return {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}


def _call(call: Callable[..., Any], tensors: dict[str, Any], mask: Any, causal: bool, **kwargs: Any) -> Any:
    """``call(query, value, key=...)`` in Keras MHA's argument order: the
    context is the key and, unless the case has value tokens of their own,
    the value too; self-attention passes the query as both."""
    q = tensors["query"]
    key = tensors.get("context", q)
    value = tensors.get("value", key)
    return call(q, value, key=key, attention_mask=mask, use_causal_mask=causal, **kwargs)


def _added_loss(layer: DamchaAttention) -> Any:
    """The loss the layer's last call added: its metric penalty (times metric_l2 = 1), or 0 for
    metric "none", which adds none."""
    losses = layer.losses
    if len(losses) > 1:
        raise AssertionError(f"one call of the layer added {len(losses)} losses; expected its metric penalty")
    return losses[0] if losses else keras.ops.zeros((), dtype=layer.compute_dtype)


def _grads_tf(layer, names, inputs, loss_of):
    import tensorflow as tf

    variables = layer.canonical_variables()
    tensors = {k: tf.convert_to_tensor(v) for k, v in inputs.items()}
    with tf.GradientTape() as tape:
        tape.watch(list(tensors.values()))
        loss = loss_of(tensors, layer)
    targets = list(tensors.values()) + [variables[n].value for n in names]
    grads = tape.gradient(loss, targets)
    keys = list(tensors) + names
    return {k: np.zeros(t.shape) if g is None else g.numpy() for k, g, t in zip(keys, grads, targets)}


def _value_and_grads_jax(layer, inputs, mask, data):
    """Output and gradients of sum(output * cotangent), in one jitted function."""
    import jax

    variables = layer.canonical_variables()
    trainable = layer.trainable_variables
    index = {id(v): i for i, v in enumerate(trainable)}
    non_trainable = [v.value for v in layer.non_trainable_variables]
    dtype = keras.backend.standardize_dtype(inputs["query"].dtype)
    cotangent = keras.ops.convert_to_tensor(data.cotangent.astype(dtype))

    def loss(train_values, tensors):
        out, _ = _call(
            lambda *a, **k: layer.stateless_call(train_values, non_trainable, *a, **k), tensors, mask, data.causal
        )
        return keras.ops.sum(out * cotangent), out

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, out), (g_vars, g_inputs) = grad_fn([v.value for v in trainable], dict(inputs))
    grads = {k: np.asarray(g_inputs[k]) for k in inputs}
    grads.update({n: np.asarray(g_vars[index[id(v)]]) for n, v in variables.items()})
    return out, grads


def _penalty_and_grads_jax(layer, inputs, mask, data):
    """The metric penalty (the loss a call adds, ``metric_l2`` = 1) and its gradients, in one
    jitted function."""
    import jax

    variables = layer.canonical_variables()
    trainable = layer.trainable_variables
    index = {id(v): i for i, v in enumerate(trainable)}
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def penalty(train_values, tensors):
        _, _, losses = _call(
            lambda *a, **k: layer.stateless_call(train_values, non_trainable, *a, return_losses=True, **k),
            tensors,
            mask,
            data.causal,
        )
        return sum(losses) if losses else keras.ops.zeros((), dtype=layer.compute_dtype)

    (value, (g_vars, g_inputs)) = jax.jit(jax.value_and_grad(penalty, argnums=(0, 1)))(
        [v.value for v in trainable], dict(inputs)
    )
    grads = {k: np.asarray(g_inputs[k]) for k in inputs}
    grads.update({n: np.asarray(g_vars[index[id(v)]]) for n, v in variables.items()})
    return value, grads


def _grads_torch(layer, names, inputs, loss_of):
    import torch

    variables = layer.canonical_variables()
    tensors = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    params = [variables[n].value for n in names]
    loss = loss_of(tensors, layer)
    grads = torch.autograd.grad(loss, list(tensors.values()) + params, allow_unused=True)
    keys = list(tensors) + names
    targets = list(tensors.values()) + params
    return {
        k: np.zeros(tuple(t.shape)) if g is None else g.detach().cpu().numpy() for k, g, t in zip(keys, grads, targets)
    }
