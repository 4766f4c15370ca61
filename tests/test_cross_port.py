"""One argument policy and one canonical I/O protocol across the ports (issue 16).

Every rule of the shared argument policy (``damcha_core._policy``) is tried on the
torch, Flax NNX and Keras (on TensorFlow, in this process) layers: each must raise
the same ``DamchaError`` subclass and name *its own* argument (``dropout_rate`` in
Flax, ``attn_mask`` in torch, ...). Then the canonical parameters travel through
every port (``to_canonical`` -> ``from_canonical``/``load_canonical`` -> ``save``
-> ``load``) and each port's output is held to the NumPy reference on the same
input, in float64 everywhere (JAX inside ``jax.enable_x64``).

Only the ports' public API is used.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import torch
from flax import nnx

import damcha_core as dc
import damcha_jax as dj
import damcha_keras as dk
import damcha_torch as dt
from damcha_conformance import case_params

PORTS = ("torch", "jax", "keras")
E, H, D = 8, 2, 4  # features, heads, head size: small on purpose
B, N, M = 2, 3, 4  # batch, query length, context length


def _tokens(length: int, seed: int = 0, features: int = E) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(B, length, features))


# ------------------------------------------------------------ how each port is driven


def _make(port: str, **kwargs: Any) -> Any:
    """The port's layer for E features and H heads; ``kwargs`` use the port's argument names."""
    if port == "torch":
        return dt.DamchaAttention(E, H, batch_first=True, **kwargs)
    if port == "jax":
        return dj.DamchaAttention(H, E, rngs=nnx.Rngs(0), **kwargs)
    return dk.DamchaAttention(H, D, **kwargs)


def _call(port: str, layer: Any, query: np.ndarray, context: np.ndarray | None = None, mask: Any = None) -> np.ndarray:
    """The port's forward pass in its own calling convention; ``mask`` is the
    reference's boolean (N, M) "True = may attend", converted to the port's."""
    c = query if context is None else context
    if port == "torch":
        t_mask = None if mask is None else torch.from_numpy(~np.asarray(mask))  # torch: True = masked out
        dtype = layer.out_proj.weight.dtype
        q, k = torch.from_numpy(query).to(dtype), torch.from_numpy(c).to(dtype)
        # The same tensor three times is torch's self-attention (one packed projection).
        y, _ = layer(q, q if context is None else k, q if context is None else k, attn_mask=t_mask, need_weights=False)
        return y.detach().numpy()
    if port == "jax":
        return np.asarray(layer(jnp.asarray(query), None if context is None else jnp.asarray(c), mask=mask))
    return keras.ops.convert_to_numpy(layer(query, c, attention_mask=mask))


def _build(port: str, layer: Any, query_features: int = E) -> Any:
    """A Keras layer creates its weights on the first call; the other ports at construction."""
    if port == "keras":
        layer(np.zeros((B, N, query_features), layer.compute_dtype), np.zeros((B, N, E), layer.compute_dtype))
    return layer


def _generator(port: str) -> Any:
    """A metric generator of the port fitting one side of the layer of ``_make``."""
    if port == "torch":
        return dt.MetricGenerator(E, H, D)
    if port == "jax":
        return dj.MetricGenerator(E, H, rngs=nnx.Rngs(1))
    return dk.MetricGenerator(H, key_dim=D)


# ------------------------------------------------------------ the argument rules

#: The port's name for the dropout rate, for the query, for the mask.
NAMES = {
    "torch": {"dropout": "dropout", "query": "query", "mask": "attn_mask"},
    "jax": {"dropout": "dropout_rate", "query": "inputs_q", "mask": "mask"},
    "keras": {"dropout": "dropout", "query": "query", "mask": "attention_mask"},
}


def _constructed(**canonical: Any) -> Callable[[str], Any]:
    """A rule broken at construction. Keras resolves what needs the feature sizes
    (the coupling, hence the generator sides) at build, so a Keras layer is also
    called once: the rule holds by the first use of the layer in every port."""

    def trigger(port: str) -> Any:
        kwargs = {NAMES[port].get(k, k): v for k, v in canonical.items()}
        return _build(port, _make(port, **kwargs))

    return trigger


def _bad_num_heads(port: str) -> Any:
    if port == "torch":
        return dt.DamchaAttention(E, 0)
    if port == "jax":
        return dj.DamchaAttention(0, E, rngs=nnx.Rngs(0))
    return dk.DamchaAttention(0, D)


def _single_generator_separate(port: str) -> Any:
    # Not built: every port, Keras too, refuses it in the constructor.
    return _make(port, coupling="separate", metric_generator=_generator(port))


def _generator_with_metric_none(port: str) -> Any:
    return _make(port, metric="none", metric_generator=_generator(port))


def _query_of_wrong_size(port: str) -> Any:
    layer = _build(port, _make(port))
    return _call(port, layer, _tokens(N, features=E + 1).astype(np.float32), _tokens(N).astype(np.float32))


def _mask_of_wrong_shape(port: str) -> Any:
    layer = _build(port, _make(port))
    x = _tokens(N).astype(np.float32)
    return _call(port, layer, x, mask=np.ones((N, N + 1), bool))  # one key too many


def _nan_parameter(port: str) -> Any:
    layer = _build(port, _make(port))
    params = layer.to_canonical()
    params["query.kernel"] = params["query.kernel"].copy()
    params["query.kernel"][0, 0, 0] = np.nan
    return layer.load_canonical(params)


#: rule -> (what breaks it, the error class, the argument as each port names it).
RULES: dict[str, tuple[Callable[[str], Any], type[dc.DamchaError], Callable[[str], str]]] = {
    "num_heads=0": (_bad_num_heads, dc.DamchaValueError, lambda port: "num_heads"),
    "metric=cosine": (_constructed(metric="cosine"), dc.DamchaValueError, lambda port: "metric"),
    "coupling=loose": (_constructed(coupling="loose"), dc.DamchaValueError, lambda port: "coupling"),
    "dropout=1.5": (_constructed(dropout=1.5), dc.DamchaValueError, lambda port: NAMES[port]["dropout"]),
    "metric_generator-single-with-separate": (
        _single_generator_separate,
        dc.DamchaValueError,
        lambda port: "metric_generator",
    ),
    "metric_generator-with-metric-none": (
        _generator_with_metric_none,
        dc.DamchaValueError,
        lambda port: "metric_generator",
    ),
    "metric_generator-not-a-generator": (
        _constructed(metric_generator="shared"),
        dc.DamchaTypeError,
        lambda port: "metric_generator",
    ),
    "query-features-E+1": (_query_of_wrong_size, dc.DamchaValueError, lambda port: NAMES[port]["query"]),
    "mask-shape-(N,M+1)": (_mask_of_wrong_shape, dc.DamchaValueError, lambda port: NAMES[port]["mask"]),
    "load_canonical-NaN": (_nan_parameter, dc.DamchaValueError, lambda port: "params['query.kernel']"),
}


@pytest.mark.parametrize("port", PORTS)
@pytest.mark.parametrize("rule", list(RULES))
def test_every_port_refuses_the_same_bad_argument_alike(rule: str, port: str) -> None:
    trigger, error, name_of = RULES[rule]
    with pytest.raises(error) as info:
        trigger(port)
    # The exact class: a port raising a sibling (a TypeError for a ValueError rule) fails.
    assert type(info.value) is error, f"{port} raised {type(info.value).__name__}, the policy says {error.__name__}"
    message = str(info.value)
    assert f"`{name_of(port)}`" in message, message
    assert "Received:" in message, message


def test_the_rules_name_different_arguments_where_the_ports_do() -> None:
    # The table is not vacuous: at least the dropout, query and mask rules speak each port's language.
    for key in ("dropout", "query", "mask"):
        assert len({NAMES[port][key] for port in PORTS}) > 1, key


# ------------------------------------------------------------ canonical round trips

#: (config, self-attention?) pairs: a tied "heads" self-attention and a lowrank cross-attention.
CONFIGS = {
    "heads-tied-self": (dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, metric="heads", coupling="tied"), True),
    "lowrank-separate-cross": (
        dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, metric="lowrank", metric_rank=3, coupling="separate"),
        False,
    ),
}


def _from_canonical(port: str, params: dict[str, np.ndarray], config: dc.DamchaConfig) -> Any:
    """The port's layer for ``config`` holding ``params``, in float64."""
    if port == "torch":
        return dt.DamchaAttention.from_canonical(params, config, batch_first=True, dtype=torch.float64)
    if port == "jax":
        return dj.DamchaAttention.from_canonical(params, config, param_dtype=jnp.float64, dtype=jnp.float64)
    return dk.DamchaAttention.from_canonical(params, config, dtype="float64")


def _load(port: str, path: Path) -> Any:
    if port == "torch":
        return dt.DamchaAttention.load(path, batch_first=True, dtype=torch.float64)
    if port == "jax":
        return dj.DamchaAttention.load(path, param_dtype=jnp.float64, dtype=jnp.float64)
    return dk.DamchaAttention.load(str(path), dtype="float64")


def _fresh(port: str, config: dc.DamchaConfig) -> Any:
    """A float64 layer of ``config``'s shape built with the port's own constructor and initialisers."""
    kwargs = {"metric": config.metric, "metric_rank": config.metric_rank, "coupling": config.coupling}
    if port == "torch":
        return dt.DamchaAttention(E, H, batch_first=True, dtype=torch.float64, **kwargs)
    if port == "jax":
        return dj.DamchaAttention(H, E, param_dtype=jnp.float64, dtype=jnp.float64, rngs=nnx.Rngs(3), **kwargs)
    layer = dk.DamchaAttention(H, D, dtype="float64", **kwargs)
    layer(np.zeros((B, N, E)), np.zeros((B, M, E)))
    return layer


def _inputs(self_attention: bool) -> tuple[np.ndarray, np.ndarray | None]:
    return _tokens(N, seed=5), None if self_attention else _tokens(M, seed=6)


def _assert_same_params(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)  # canonical names in canonical order
    for name in want:
        assert got[name].dtype == np.float64, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _assert_reference(
    port: str, layer: Any, params: dict[str, np.ndarray], config: dc.DamchaConfig, self_attention: bool
) -> None:
    query, context = _inputs(self_attention)
    mask = np.tril(np.ones((N, N if self_attention else M), bool), k=1)  # a real mask: some keys hidden
    expected = dc.damcha_attention(params, config, query, context, mask=mask)
    got = _call(port, layer, query, context, mask=mask)
    assert got.dtype == np.float64, port
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10, err_msg=port)


@pytest.fixture
def x64() -> Any:
    # JAX computes float64 only in x64 mode; scoped, so the rest of this process stays float32.
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("config_id", list(CONFIGS))
def test_torch_jax_keras_and_back_keep_the_reference_output(config_id: str, x64: Any) -> None:
    config, self_attention = CONFIGS[config_id]
    start = case_params(config, seed=7)  # open gates: a port ignoring the metric would fail
    seen = []
    layer = dt.DamchaAttention.from_canonical(start, config, batch_first=True, dtype=torch.float64)
    for port in ("torch", "jax", "keras", "torch"):
        if seen:  # a fresh layer of the next port, built by its constructor, loaded in place
            layer = _fresh(port, config)
            assert layer.config == config, port
            assert layer.load_canonical(seen[-1]) is layer, f"{port}.load_canonical must return the layer"
        _assert_reference(port, layer, start, config, self_attention)
        params = layer.to_canonical()
        _assert_same_params(params, start)
        seen.append(params)


@pytest.mark.parametrize(
    ("source", "target"),
    list(itertools.permutations(PORTS, 2)),
    ids=[f"{a}-to-{b}" for a, b in itertools.permutations(PORTS, 2)],
)
@pytest.mark.parametrize("config_id", list(CONFIGS))
def test_each_port_reads_what_every_other_port_writes(
    config_id: str, source: str, target: str, x64: Any, tmp_path: Path
) -> None:
    config, self_attention = CONFIGS[config_id]
    start = case_params(config, seed=11)
    written = _from_canonical(source, start, config)
    params = written.to_canonical()
    _assert_same_params(params, start)
    # In memory: from_canonical.
    read = _from_canonical(target, params, config)
    assert read.config == config
    _assert_same_params(read.to_canonical(), start)
    _assert_reference(target, read, start, config, self_attention)
    # On disk: save (safetensors with the config) -> load.
    path = tmp_path / f"{source}.safetensors"
    written.save(str(path))
    loaded = _load(target, path)
    assert loaded.config == config
    _assert_same_params(loaded.to_canonical(), start)
    _assert_reference(target, loaded, start, config, self_attention)


def test_float_masks_mean_what_the_readme_says_per_port() -> None:
    """The README used to say masks are read "identically in every backend"; a float mask is
    not (torch: additive, as SDPA; JAX: 0/1, as Flax; the reference: refused). Its table is
    pinned here against each function's actual behaviour, which this does not change."""
    config = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D)
    params = dc.init_params(config, 0)
    x = np.random.default_rng(0).normal(size=(1, N, E))
    visible = np.array([[True, False, True]] * N)
    want = dc.damcha_attention(params, config, x, mask=visible)
    additive, zero_one = np.where(visible, 0.0, -np.inf), visible.astype(np.float64)
    with pytest.raises(dc.DamchaTypeError):
        dc.damcha_attention(params, config, x, mask=zero_one)
    tp, tx = {k: torch.tensor(v) for k, v in params.items()}, torch.tensor(x)
    np.testing.assert_allclose(dt.damcha_attention(tp, config, tx, mask=torch.tensor(additive)), want, atol=1e-12)
    # A 0/1 float mask is added to the logits (softmax ignores the shift by 1): hidden keys stay visible.
    as_additive = dt.damcha_attention(tp, config, tx, mask=torch.tensor(zero_one)).numpy()
    np.testing.assert_allclose(as_additive, dt.damcha_attention(tp, config, tx, mask=torch.tensor(zero_one - 1)))
    assert np.abs(as_additive - want).max() > 1e-3
    with jax.enable_x64(True):
        jp, jx = {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x)
        np.testing.assert_allclose(dj.damcha_attention(jp, config, jx, mask=jnp.asarray(zero_one)), want, atol=1e-12)
        with pytest.raises(dc.DamchaValueError):
            dj.damcha_attention(jp, config, jx, mask=jnp.asarray(additive))
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "| `damcha_torch.damcha_attention` | True = may attend | **additive**" in readme
    assert "| `damcha_jax.damcha_attention` | True = may attend | **0/1**" in readme
    assert "| `damcha_core.damcha_attention` | True = may attend | refused" in readme
