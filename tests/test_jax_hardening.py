"""Hardening of the JAX port (issue 11): masks, NaN propagation, error messages.

Every check goes through the public entry points (the pure functions and the
NNX module) and compares with the NumPy reference where a result is expected.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import damcha_core as dc
import damcha_jax as dj
from damcha_conformance import case_params

FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
fast_jit = functools.partial(jax.jit, compiler_options=FAST)

B, N, E, H = 2, 4, 8, 2
CFG = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=4)
PARAMS = {k: np.asarray(v, np.float32) for k, v in case_params(CFG, 0).items()}  # open gates, non-zero biases
X = np.random.default_rng(0).normal(size=(B, N, E)).astype(np.float32)
PAD = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)[:, None, None, :]  # (B, 1, 1, M); no empty row


def _layer() -> dj.DamchaAttention:
    return dj.DamchaAttention.from_canonical(PARAMS, CFG)


# ------------------------------------------------------------------- masks


def test_additive_float_mask_is_refused_not_inverted() -> None:
    """An additive 0/-inf float mask would be read as "non-zero = attend", i.e.
    inverted (Flax's MHA does exactly that): the module and the functions refuse it."""
    additive = np.where(PAD, 0.0, -np.inf).astype(np.float32)
    layer = _layer()
    calls = {
        "module": lambda: layer(X, mask=additive),
        "damcha_attention": lambda: dj.damcha_attention(PARAMS, CFG, X, mask=additive),
        "decode_step": lambda: dj.decode_step(PARAMS, CFG, dj.init_cache(CFG, B, N), X[:, :1], mask=additive),
    }
    for name, call in calls.items():
        with pytest.raises(
            dc.DamchaValueError,
            match=r"Invalid argument `mask`: expected a mask that is boolean .*Received: mask=.*holds other values",
        ) as err:
            call()
        assert "inf" not in str(err.value).split("Received:")[1], name  # shape and dtype only, never the contents
    # The Flax/Keras 0/1 convention (float or int) is read as the bool mask.
    expected = dc.damcha_attention(PARAMS, CFG, X, mask=PAD)
    for mask in (PAD.astype(np.float32), PAD.astype(np.int32), jnp.asarray(PAD, jnp.bfloat16)):
        np.testing.assert_allclose(layer(X, mask=mask), expected, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(dj.damcha_attention(PARAMS, CFG, X, mask=mask), expected, rtol=2e-4, atol=2e-5)


def test_additive_mask_under_jit_gives_nan() -> None:
    """Under jit the values cannot be checked: a mask with values other than
    0/1 makes the output NaN instead of silently attending to the hidden keys."""
    layer = _layer()
    additive = jnp.asarray(np.where(PAD, 0.0, -np.inf), jnp.float32)
    graphdef, state = nnx.split(layer)

    def calls(mask):
        module = nnx.merge(graphdef, state)
        cache = dj.init_cache(CFG, B, N)
        return (
            module(X, mask=mask),
            dj.damcha_attention(PARAMS, CFG, X, mask=mask),
            dj.decode_step(PARAMS, CFG, cache, X[:, :1], mask=mask)[0],
        )

    for out in fast_jit(calls)(additive):
        assert np.all(np.isnan(np.asarray(out)))
    for out in fast_jit(calls)(jnp.asarray(PAD, jnp.float32)):  # 0/1 under jit: the real answer
        assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize(
    "lead, shape",
    [((B,), (N, N)), ((), (1, 1, N, N)), ((2, 3), (2, 3, 1, N, N)), ((2, 3), (N, N))],
    ids=["batched-(N,M)", "unbatched-extra-axes", "two-batch-axes", "two-batch-axes-(N,M)"],
)
def test_a_wrong_mask_hint_reports_the_mask_as_passed(lead, shape) -> None:
    """The hint's refusal prints the mask's shape as given, not the (b, h, N, M)
    view the kernel planning uses."""
    causal = np.broadcast_to(np.tril(np.ones((N, N), bool)), shape)  # causal, so not what "padding" says
    x = np.ones((*lead, N, E), np.float32)
    received = re.escape(f"Received: mask.shape={shape}")
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `mask`: expected what mask_hint='padding'.*" + received
    ):
        _layer()(x, mask=causal, mask_hint="padding")
    if len(lead) == 1 and len(shape) == 2:
        with pytest.raises(dc.DamchaValueError, match=r"expected what mask_hint='padding'.*" + received):
            dj.damcha_attention(PARAMS, CFG, x, mask=causal, mask_hint="padding")


def test_nan_from_a_traced_mask_is_explained_by_the_debug_recipes() -> None:
    """docs/jax.md's recipe: under jit a bad mask can only make the output NaN;
    jax_debug_nans reruns the step op by op, where the mask's values are
    concrete and the DamchaValueError says what is wrong. A wrong hint on a
    JAX bool mask is found by both recipes too: with a hint, a concrete bool
    mask is read back for the check (before, it never was, and gave NaN)."""
    layer = _layer()
    step = nnx.jit(lambda m, x, mask, hint=None: m(x, mask=mask, mask_hint=hint), static_argnames="hint")
    additive = jnp.asarray(np.where(PAD, 0.0, -np.inf), jnp.float32)
    assert np.isnan(np.asarray(step(layer, X, additive))).all()
    with (
        jax.debug_nans(True),
        pytest.raises(dc.DamchaValueError, match="Invalid argument `mask`: expected a mask that is boolean"),
    ):
        step(layer, X, additive)
    not_causal = jnp.ones((N, N), bool).at[0, 3].set(False)
    assert np.isnan(np.asarray(step(layer, X, not_causal, hint="causal"))).all()
    wrong_hint = r"expected what mask_hint='causal' says.*mask\.shape=\(4, 4\), mask_hint='causal', a mask that is"
    for mask in (not_causal, np.asarray(not_causal)):
        with jax.disable_jit(), pytest.raises(dc.DamchaValueError, match=wrong_hint):
            step(layer, X, mask, hint="causal")
    with jax.debug_nans(True), pytest.raises(dc.DamchaValueError, match=wrong_hint):
        step(layer, X, not_causal, hint="causal")


# A concrete mask that is not what its mask_hint says: (mask (N, N), hint, what the mask is).
_CAUSAL = np.tril(np.ones((N, N), bool))
_PADDING = np.ones((N, N), bool)
_PADDING[:, 3] = False  # key 3 padded: a padding-only mask
_SCATTERED = _CAUSAL.copy()
_SCATTERED[3, 1] = False  # neither causal nor padding
CONTRADICTIONS = {
    "causal-as-padding": (_CAUSAL, "padding", "the causal rule and padding"),
    "padding-as-causal": (_PADDING, "causal", "padding only"),
    "scattered-as-causal": (_SCATTERED, "causal", "neither"),
    "scattered-as-padding": (_SCATTERED, "padding", "neither"),
}
# The kinds a concrete mask comes in: a JAX bool array (before: never read back, so NaN), a
# Flax-style float 0/1 array and a NumPy bool array (before: refused, but after the dropout draw).
MASK_KINDS = {
    "jax-bool": lambda m: jnp.asarray(m),
    "jax-float": lambda m: jnp.asarray(m, jnp.float32),
    "numpy-bool": lambda m: m,
}


def _dropout_layer(decode: bool) -> dj.DamchaAttention:
    layer = dj.DamchaAttention(H, E, dropout_rate=0.5, deterministic=False, decode=decode, rngs=nnx.Rngs(0, dropout=1))
    layer.load_canonical(PARAMS)
    if decode:
        layer.init_cache((B, N, E))
    return layer


@pytest.mark.parametrize("entry", ["module", "module-decode", "damcha_attention", "decode_step"])
@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_a_concrete_mask_that_contradicts_its_hint_is_refused_before_any_work(
    entry: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The docstrings promise a DamchaValueError when the mask's values are
    concrete. A concrete JAX bool mask gave NaN instead (it was never read
    back), and the masks that were read were refused only after the
    projections and the dropout draw (a refused call advanced the layer's rng
    stream). Now every concrete kind is refused at the boundary, naming
    mask_hint, the hint received and what the mask is."""
    mask, hint, actual = CONTRADICTIONS[case]
    from damcha_jax import _cache, _functional

    def no_projection(*args, **kwargs):
        raise AssertionError("projected before the mask's hint was checked")

    monkeypatch.setattr(_functional, "_qkv", no_projection)
    monkeypatch.setattr(_cache, "_qkv", no_projection)
    for kind, make in MASK_KINDS.items():
        m = make(mask)
        layer = _dropout_layer(decode=entry == "module-decode") if entry.startswith("module") else None
        with pytest.raises(dc.DamchaValueError) as err:
            if layer is not None:  # "module-decode": a prefill of N tokens over the cache of N
                layer(X, mask=m, mask_hint=hint)
            elif entry == "damcha_attention":
                dj.damcha_attention(PARAMS, CFG, X, mask=m, mask_hint=hint)
            else:
                dj.decode_step(PARAMS, CFG, dj.init_cache(CFG, B, N), X, mask=m, mask_hint=hint)
        message = str(err.value)
        assert message.startswith(f"Invalid argument `mask`: expected what mask_hint='{hint}' says"), (kind, message)
        received = message.split("Received: ")[1]
        assert f"mask.shape={(N, N)}, mask_hint='{hint}'" in received, (kind, message)
        assert f"a mask that is {actual}" in received, (kind, message)
        if layer is not None:
            assert int(layer.rngs.count[...]) == 0, kind  # refused before the dropout key was drawn
            if entry == "module-decode":
                assert int(layer.cache_index[...]) == 0, kind


def test_a_mask_that_agrees_with_its_hint_equals_the_reference() -> None:
    """A concrete JAX bool mask with a hint it agrees with: the reference's
    numbers (eager, read on the host), and under jit, traced, the same ones;
    a traced contradiction still gives NaN (the values are unknown there)."""
    layer = _layer()
    padding = jnp.asarray(np.broadcast_to(PAD, (B, 1, N, N)))
    causal = jnp.asarray(_CAUSAL) & padding
    step = nnx.jit(lambda m, x, mask, hint: m(x, mask=mask, mask_hint=hint), static_argnames="hint")
    fn = fast_jit(
        lambda p, x, mask, hint: dj.damcha_attention(p, CFG, x, mask=mask, mask_hint=hint), static_argnames="hint"
    )
    for mask, hint in ((padding, "padding"), (causal, "causal"), (padding, "causal")):
        if hint == "causal" and mask is padding:
            for out in (step(layer, X, mask, hint), fn(PARAMS, X, mask, hint)):
                assert np.all(np.isnan(np.asarray(out))), "a traced contradiction gives NaN"
            continue
        expected = dc.damcha_attention(PARAMS, CFG, X, mask=np.asarray(mask), causal=hint == "causal")
        for out in (
            layer(X, mask=mask, mask_hint=hint),
            dj.damcha_attention(PARAMS, CFG, X, mask=mask, mask_hint=hint),
            step(layer, X, mask, hint),
            fn(PARAMS, X, mask, hint),
        ):
            np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-5)
    # Empty masks (no query, an empty batch) pass the check: the empty output.
    for x, mask in ((np.ones((B, 0, E), np.float32), jnp.ones((0, 0), bool)), (X[:0], jnp.ones((0, 1, N, N), bool))):
        for hint in ("causal", "padding"):
            assert layer(x, mask=mask, mask_hint=hint).shape == x.shape
            assert dj.damcha_attention(PARAMS, CFG, x, mask=mask, mask_hint=hint).shape == x.shape
    # A concrete mask closed over by a jitted function is read while tracing: refused, not NaN.
    with pytest.raises(dc.DamchaValueError, match="mask_hint='causal'"):
        fast_jit(lambda p, x: dj.damcha_attention(p, CFG, x, mask=padding, mask_hint="causal"))(PARAMS, X)


# --------------------------------------------------------------- NaN in, NaN out

NAN_TARGETS = ["query.kernel", "value.kernel", "metric.qk.kernel", "input"]


def _with_nan(target: str):
    params = dict(PARAMS)
    x = X.copy()
    if target == "input":
        x[1, 2, 3] = np.nan
    else:
        value = params[target].copy()
        value.flat[0] = np.nan
        params[target] = value
    return params, x


@pytest.mark.parametrize("target", NAN_TARGETS)
def test_nan_in_gives_nan_out_on_every_path(target: str) -> None:
    """NaN in a parameter or an input gives NaN wherever the reference does
    (never a finite number), on the fused path, the einsum path (weights),
    float64, dropout, decoding and the module (DECISIONS 5: forward passes
    never inspect values, NaN propagates)."""
    params, x = _with_nan(target)
    mask = np.ones((B, 1, N, N), bool)
    mask[0, :, 1, :] = False  # an empty row: output bias there, in the reference too
    ref64 = {k: v.astype(np.float64) for k, v in PARAMS.items()}
    if target == "input":
        # The reference takes NaN inputs; a decoder's step t sees only tokens <= t.
        nan_rows = np.isnan(dc.damcha_attention(ref64, CFG, x.astype(np.float64), mask=mask))
        causal_ref = np.stack(
            [
                np.isnan(dc.damcha_attention(ref64, CFG, x[:, : t + 1].astype(np.float64), causal=True)[:, t])
                for t in range(N)
            ],
            axis=1,
        )
    else:
        # The reference refuses NaN parameters (they enter there); every row that
        # sees a key reads the poisoned tensor, the empty row is the output bias.
        nan_rows = np.ones((B, N, E), bool)
        nan_rows[0, 1] = False
        causal_ref = np.ones((B, N, E), bool)
    assert nan_rows.any() and not nan_rows.all()
    key = jax.random.key(0)
    dropping = CFG.replace(dropout=0.5)

    def paths(params, x):
        out = {
            "fused": dj.damcha_attention(params, CFG, x, mask=mask),
            "weights": dj.damcha_attention(params, CFG, x, mask=mask, return_weights=True)[0],
            "dropout": dj.damcha_attention(params, dropping, x, mask=mask, dropout_rng=key, deterministic=False),
        }
        cache = dj.init_cache(CFG, B, N)
        ys = []
        for t in range(N):
            y, cache = dj.decode_step(params, CFG, cache, x[:, t : t + 1])
            ys.append(y)
        out["decode"] = jnp.concatenate(ys, axis=1)
        return out

    results = fast_jit(paths)(params, x)
    for name, out in results.items():
        out = np.asarray(out)
        expected = causal_ref if name == "decode" else nan_rows
        if name == "dropout":
            # Dropout only scales kept probabilities: where the reference is NaN the output must be too.
            assert np.all(np.isnan(out[expected])), name
        else:
            np.testing.assert_array_equal(np.isnan(out), expected, err_msg=name)
    with jax.enable_x64(True):
        out64 = dj.damcha_attention(
            {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}, CFG, jnp.asarray(x, jnp.float64), mask=mask
        )
        np.testing.assert_array_equal(np.isnan(np.asarray(out64)), nan_rows, err_msg="float64")
    layer = _layer()
    if target == "input":
        out = layer(x, mask=mask)
    else:
        # load_canonical refuses NaN (parameters entering are checked): poison a variable directly.
        name = {"query.kernel": ("query", "kernel"), "key.bias": ("key", "bias"), "value.kernel": ("value", "kernel")}
        if target in name:
            var = getattr(getattr(layer, name[target][0]), name[target][1])
        else:
            var = getattr(layer.metric["qk"].generator, target.rsplit(".", 1)[1])
        var[...] = jnp.asarray(params[target])
        out = layer(x, mask=mask)
    np.testing.assert_array_equal(np.isnan(np.asarray(out)), nan_rows, err_msg="module")


def test_non_finite_parameters_are_refused_where_they_enter() -> None:
    """load_canonical / from_canonical check values (parameters entering), naming the parameter."""
    params, _ = _with_nan("metric.qk.kernel")
    with pytest.raises(dc.DamchaValueError, match="metric.qk.kernel"):
        _layer().load_canonical(params)
    with pytest.raises(dc.DamchaValueError, match="metric.qk.kernel"):
        dj.DamchaAttention.from_canonical(params, CFG)


def test_load_canonical_loads_the_values_it_checked() -> None:
    """A mapping that answers a second read differently (a lazy or mutating
    store) cannot slip an unchecked value in: what is loaded is the copy
    validate_params checked, read once."""
    from collections.abc import Mapping

    class SecondReadIsInf(Mapping):
        def __init__(self) -> None:
            self.reads: dict[str, int] = {}

        def __getitem__(self, name: str) -> np.ndarray:
            self.reads[name] = self.reads.get(name, 0) + 1
            return PARAMS[name] if self.reads[name] == 1 else np.full_like(PARAMS[name], np.inf)

        def __iter__(self):
            return iter(PARAMS)

        def __len__(self) -> int:
            return len(PARAMS)

    layer = _layer().load_canonical(SecondReadIsInf())
    for name, value in layer.to_canonical().items():
        np.testing.assert_array_equal(value, PARAMS[name], err_msg=name)


def test_params_are_checked_against_the_compute_dtype() -> None:
    """dtype=float16 with float32 params: a 1e5 weight fits the variable and is
    inf in every call (Flax promotes the params to dtype); it was loaded and
    the output was not finite. Keras checks its mixed policy's compute dtype."""
    params = {k: v.copy() for k, v in PARAMS.items()}
    params["output.kernel"][0, 0, 0] = 1e5
    with pytest.raises(dc.DamchaValueError, match=r"output.kernel.*float16, the compute dtype \(dtype=\)"):
        dj.DamchaAttention.from_canonical(params, CFG, dtype=jnp.float16, param_dtype=jnp.float32)
    layer = dj.DamchaAttention.from_canonical(params, CFG, dtype=jnp.float32, param_dtype=jnp.float32)
    assert layer.to_canonical()["output.kernel"][0, 0, 0] == 1e5
    stack_cfg = dc.EncoderConfig(CFG, num_layers=1, ffn_dim=8, activation="gelu_tanh")
    stack_params = dc.init_encoder_params(stack_cfg, seed=0)
    stack_params["layers.0.ffn.in.kernel"][0, 0] = 1e5
    with pytest.raises(dc.DamchaValueError, match=r"ffn.in.kernel.*float16, the compute dtype"):
        dj.DamchaEncoder.from_canonical(stack_params, stack_cfg, dtype=jnp.float16, param_dtype=jnp.float32)


def test_float64_params_without_x64_are_checked_against_float32() -> None:
    """param_dtype=float64 with jax_enable_x64 off stores float32 (JAX's rule, with its warning): a
    1e39 bias passed the float64 range check and was stored as inf, every output NaN."""
    assert not jax.config.jax_enable_x64
    params = {k: np.asarray(v, np.float64) for k, v in PARAMS.items()}
    params["query.bias"][0, 0] = 1e39
    with (
        warnings.catch_warnings(),
        pytest.raises(dc.DamchaValueError, match=r"query.bias.*float32 \(float64 without jax_enable_x64\)"),
    ):
        warnings.simplefilter("ignore", UserWarning)  # JAX's own "float64 is not available" warning
        dj.DamchaAttention.from_canonical(params, CFG, param_dtype=jnp.float64)
    with jax.enable_x64(True):
        layer = dj.DamchaAttention.from_canonical(params, CFG, param_dtype=jnp.float64)
        assert layer.to_canonical()["query.bias"][0, 0] == 1e39


# -------------------------------------------------------------- error messages


def test_list_inputs_are_described_by_type_not_contents() -> None:
    query = X.tolist()
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `query`: expected a real floating") as err:
        dj.damcha_attention(PARAMS, CFG, query)
    assert len(str(err.value)) < 300 and "0." not in str(err.value).split("Received:")[1]
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `inputs_q`: expected a real floating") as err:
        _layer()(query)
    assert len(str(err.value)) < 300
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `inputs_k`: expected a real floating"):
        _layer()(X, X[0].tolist())
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `mask`: expected a mask that is boolean"):
        _layer()(X, mask=PAD.tolist())


@pytest.mark.parametrize(
    "shape, match",
    [
        (
            (E,),
            r"Invalid argument `inputs_q`: expected shape \[batch\.\.\., length, features\] \(rank >= 2\)\. Received: inputs_q.shape=\(8,\)",
        ),
        (
            (N, 3),
            r"Invalid argument `inputs_q`: expected 8 features \(in_features\)\. Received: inputs_q.shape=\(4, 3\)",
        ),
        (
            (2, 3, N, 3),
            r"Invalid argument `inputs_q`: expected 8 features \(in_features\)\. Received: inputs_q.shape=\(2, 3, 4, 3\)",
        ),
        (
            (B, N, 3),
            r"Invalid argument `inputs_q`: expected 8 features \(in_features\)\. Received: inputs_q.shape=\(2, 4, 3\)",
        ),
    ],
    ids=["rank-1", "unbatched-features", "two-batch-axes-features", "features"],
)
def test_module_reports_the_shape_the_user_passed(shape, match) -> None:
    with pytest.raises(dc.DamchaValueError, match=match):
        _layer()(np.ones(shape, np.float32))


LAYER = dict(num_heads=2, in_features=8)
BAD_CONSTRUCTOR = {
    "in_features-str": (dict(in_features="8"), dc.DamchaTypeError, "`in_features`"),
    "qkv_features-float": (dict(qkv_features=8.0), dc.DamchaTypeError, "`qkv_features`"),
    "in_kv_features-zero": (dict(in_kv_features=0), dc.DamchaValueError, "`in_kv_features`"),
    "in_v_features-str": (dict(in_v_features="4"), dc.DamchaTypeError, "`in_v_features`"),
    "out_features-neg": (dict(out_features=-1), dc.DamchaValueError, "`out_features`"),
    "dropout_rate": (dict(dropout_rate=1.5), dc.DamchaValueError, "`dropout_rate`"),
    "num_kv_heads": (dict(num_kv_heads=3), dc.DamchaValueError, "`num_kv_heads`"),
    "coupling": (dict(coupling="both"), dc.DamchaValueError, "`coupling`"),
    "metric": (dict(metric=3), dc.DamchaTypeError, "`metric`"),
    "broadcast_dropout": (dict(broadcast_dropout="yes"), dc.DamchaTypeError, "`broadcast_dropout`"),
    "normalize_qk": (dict(normalize_qk=1), dc.DamchaTypeError, "`normalize_qk`"),
    "keep_rngs": (dict(keep_rngs=None), dc.DamchaTypeError, "`keep_rngs`"),
    "deterministic": (dict(deterministic="no"), dc.DamchaTypeError, "`deterministic`"),
    "decode": (dict(decode=0), dc.DamchaTypeError, "`decode`"),
    "attention_fn": (dict(attention_fn="cudnn"), dc.DamchaTypeError, "`attention_fn`"),
    "rngs": (dict(rngs=0), dc.DamchaTypeError, "`rngs`"),
    "metric_generator": (dict(metric_generator="shared"), dc.DamchaTypeError, "`metric_generator`"),
    "generator-separate-single": (
        dict(coupling="separate", metric_generator="GEN"),
        dc.DamchaValueError,
        "`metric_generator`",
    ),
    "generator-missing-side": (
        dict(coupling="separate", metric_generator={"q": "GEN"}),
        dc.DamchaValueError,
        "missing sides",
    ),
    # Complex parameters computed complex outputs and lost their imaginary parts in save().
    "param_dtype-complex": (dict(param_dtype=jnp.complex64), dc.DamchaTypeError, "`param_dtype`: expected a real"),
    "dtype-complex": (dict(dtype=jnp.complex64), dc.DamchaTypeError, "`dtype`: expected a real"),
    "param_dtype-int": (dict(param_dtype=jnp.int32), dc.DamchaTypeError, "`param_dtype`.*int32"),
    "dtype-int": (dict(dtype=jnp.int32), dc.DamchaTypeError, "`dtype`.*int32"),
    "kernel_init": (dict(kernel_init=None), dc.DamchaTypeError, "`kernel_init`: expected an initializer"),
    "out_bias_init": (dict(out_bias_init="zeros"), dc.DamchaTypeError, "`out_bias_init`"),
    "precision-name": (dict(precision="bogus"), dc.DamchaValueError, "`precision`.*Received: precision='bogus'"),
    "precision-type": (dict(precision=3), dc.DamchaTypeError, "`precision`.*Received: precision=3"),
}


@pytest.mark.parametrize("case", list(BAD_CONSTRUCTOR))
def test_every_bad_constructor_argument_is_named(case: str) -> None:
    kwargs, error, name = BAD_CONSTRUCTOR[case]
    gen = dj.MetricGenerator(8, 2, rngs=nnx.Rngs(0))
    kwargs = {
        k: (gen if v == "GEN" else dict.fromkeys(v, gen) if isinstance(v, dict) else v) for k, v in kwargs.items()
    }
    with pytest.raises(error, match=name):
        dj.DamchaAttention(**{**LAYER, "rngs": nnx.Rngs(0), **kwargs})


BAD_CALL = {
    "is_causal": (dict(is_causal="yes"), dc.DamchaTypeError, "`is_causal`"),
    "sow_weights": (dict(sow_weights=1), dc.DamchaTypeError, "`sow_weights`"),
    "decode": (dict(decode="no"), dc.DamchaTypeError, "`decode`"),
    # dropout_rate=0 here: the flag is still checked (a truthy "no" used to pass silently)
    "deterministic": (
        dict(deterministic="no"),
        dc.DamchaTypeError,
        r"^Invalid argument `deterministic`: expected a bool\. Received: deterministic='no'$",
    ),
    "mask-rank-3": (dict(mask=np.ones((B, N, N), bool)), dc.DamchaValueError, r"`mask`.*mask\[:, None\]"),
    "mask-dtype": (
        dict(mask=np.ones((N, N), np.complex64)),
        dc.DamchaTypeError,
        "Invalid argument `mask`: expected a mask that is boolean",
    ),
    "inputs_k-batch": (dict(inputs_k=np.ones((3, N, E), np.float32)), dc.DamchaValueError, "`inputs_k`"),
    "inputs_v-without-k": (
        dict(inputs_v=np.ones((B, N, E), np.float32)),
        dc.DamchaValueError,
        "Invalid argument `inputs_k`: expected the key tokens when `inputs_v` is given",
    ),
    "inputs_v-length": (dict(inputs_k=X, inputs_v=np.ones((B, 3, E), np.float32)), dc.DamchaValueError, "`inputs_v`"),
    "inputs_v-int": (dict(inputs_k=X, inputs_v=np.ones((B, N, E), np.int32)), dc.DamchaTypeError, "`inputs_v`"),
}


@pytest.mark.parametrize("case", list(BAD_CALL))
def test_every_bad_call_argument_is_named(case: str) -> None:
    kwargs, error, name = BAD_CALL[case]
    with pytest.raises(error, match=name):
        _layer()(X, **kwargs)


@pytest.mark.parametrize("dropout_rate", [0.0, 0.5])
@pytest.mark.parametrize("kind", ["attention", "block", "encoder"])
def test_deterministic_is_a_bool_with_or_without_dropout(kind: str, dropout_rate: float) -> None:
    """One rule whether or not a dropout would read the flag: bool or np.bool_ (None: the module's own)."""
    if kind == "attention":
        module = dj.DamchaAttention(2, 8, dropout_rate=dropout_rate, rngs=nnx.Rngs(0))
    elif kind == "block":
        module = dj.DamchaEncoderBlock(8, 2, 16, dropout_rate=dropout_rate, rngs=nnx.Rngs(0))
    else:
        module = dj.DamchaEncoder(1, 8, 2, 16, dropout_rate=dropout_rate, rngs=nnx.Rngs(0))
    for bad in ("no", 0, jnp.asarray(True)):
        with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `deterministic`: expected a bool\. Received"):
            module(X, deterministic=bad)
    np.testing.assert_array_equal(module(X, deterministic=np.bool_(True)), module(X, deterministic=True))


def test_bad_dropout_and_cache_arguments_are_named() -> None:
    layer = dj.DamchaAttention(2, 8, dropout_rate=0.5, keep_rngs=False, rngs=nnx.Rngs(0))
    with pytest.raises(
        dc.DamchaValueError,
        match="Invalid argument `deterministic`: expected a bool, given to __call__ or the constructor",
    ):
        layer(X)
    with pytest.raises(dc.DamchaValueError, match="Invalid argument `rngs`: expected an nnx.Rngs passed to __call__"):
        layer(X, deterministic=False)
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `rngs`: expected an nnx.Rngs"):
        layer(X, deterministic=False, rngs=3)
    with pytest.raises(dc.DamchaValueError, match="`input_shape`"):
        layer.init_cache((8,))
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `dtype`: expected a floating dtype"):
        layer.init_cache((B, N, E), jnp.int32)
    layer.init_cache((B, N, E))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `inputs_q`: expected the batch axes of the cache.*\(2,\).*"
        r"\(cached_key\.shape=\(2, 4, 2, 4\)\)",  # the layer's attribute, by its name
    ):
        layer(X[:1, :1], decode=True, deterministic=True)
    with pytest.raises(dc.DamchaValueError, match="`mask`"):
        layer(X[:, :1], decode=True, deterministic=True, mask=np.ones((1, 3), bool))  # the mask spans the cache (T, L)


@pytest.mark.parametrize("module", ["block", "encoder"])
@pytest.mark.parametrize(
    "x, error, expected",
    [
        (
            np.zeros((2, 3, 7), np.float32),
            dc.DamchaValueError,
            r"expected 8 features \(in_features\)\. Received: x\.shape=\(2, 3, 7\)",
        ),
        (np.zeros((8,), np.float32), dc.DamchaValueError, r"rank >= 2\)\. Received: x\.shape=\(8,\)"),
        ([1.0, 2.0], dc.DamchaTypeError, r"expected an array.*Received: x=\[1\.0, 2\.0\]"),
        # Int and bool tokens were silently promoted by the block's LayerNorm.
        (np.ones((2, 3, 8), np.int32), dc.DamchaTypeError, r"expected a real floating.*dtype=int32"),
        (np.ones((2, 3, 8), bool), dc.DamchaTypeError, r"expected a real floating.*dtype=bool"),
    ],
    ids=["features", "rank-1", "list", "int", "bool"],
)
def test_block_input_errors_name_x(module: str, x: object, error: type, expected: str) -> None:
    """The blocks' argument is ``x``: its mistakes are named so (not ``inputs_q``,
    the attention's name inside), and a wrong feature size is not a LayerNorm
    reshape error."""
    m = (
        dj.DamchaEncoderBlock(8, 2, 16, rngs=nnx.Rngs(0))
        if module == "block"
        else dj.DamchaEncoder(1, 8, 2, 16, rngs=nnx.Rngs(0))
    )
    with pytest.raises(error, match=r"Invalid argument `x`: " + ".*" + expected):
        m(x)


@pytest.mark.parametrize("module", ["block", "encoder"])
@pytest.mark.parametrize(
    "shape",
    [(8,), (2, 3, 7), (3, 7), (2, 2, 3, 7), (2, 0, 7)],
    ids=["rank-1", "features", "unbatched-features", "two-batch-axes-features", "empty-and-features"],
)
def test_block_x_is_refused_as_the_attention_refuses_inputs_q(module: str, shape: tuple) -> None:
    """The blocks' ``x`` and the attention's ``inputs_q`` follow one rule: each
    refusal of the block is the attention layer's (its own in-module check, an
    independent caller) with ``x`` for ``inputs_q``."""
    x = np.zeros(shape, np.float32)
    m = (
        dj.DamchaEncoderBlock(8, 2, 16, rngs=nnx.Rngs(0))
        if module == "block"
        else dj.DamchaEncoder(1, 8, 2, 16, rngs=nnx.Rngs(0))
    )
    with pytest.raises(dc.DamchaValueError) as want:
        _layer()(x)
    with pytest.raises(dc.DamchaValueError) as got:
        m(x)
    assert "inputs_q" in str(want.value)
    assert str(got.value) == str(want.value).replace("inputs_q", "x")


@pytest.mark.parametrize("module", ["block", "encoder"])
@pytest.mark.parametrize(
    "shape",
    [(2, 0, 8), (0, 3, 8), (0, 8), (2, 2, 0, 8), (2, 0, 3, 8)],
    ids=["empty-sequence", "empty-batch", "unbatched-empty", "two-batch-axes-empty", "two-batch-axes-empty-batch"],
)
def test_block_x_empty_gives_the_empty_output_as_the_attention(module: str, shape: tuple) -> None:
    """An empty batch or sequence is no error (as in Flax's MHA): the attention
    and the blocks return the empty output of ``x``'s shape and dtype."""
    x = np.zeros(shape, np.float32)
    m = (
        dj.DamchaEncoderBlock(8, 2, 16, rngs=nnx.Rngs(0))
        if module == "block"
        else dj.DamchaEncoder(1, 8, 2, 16, rngs=nnx.Rngs(0))
    )
    want = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))(x)
    for y in (_layer()(x), m(x)):
        assert (y.shape, y.dtype) == (want.shape, want.dtype) == (shape, np.float32)


def test_blocks_and_attention_share_one_token_shape_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks' ``_check_x`` repeated the attention's rank/feature/empty rules
    in a copy of its own; both now call ``_layer.check_token_shape`` with their
    argument's name, so the two cannot drift apart."""
    from damcha_jax import _blocks
    from damcha_jax import _layer as layer_module

    calls: list[str] = []
    real = layer_module.check_token_shape

    def spy(name, shape, *args, **kwargs):
        calls.append(name)
        return real(name, shape, *args, **kwargs)

    monkeypatch.setattr(layer_module, "check_token_shape", spy)
    monkeypatch.setattr(_blocks, "check_token_shape", spy)
    dj.DamchaEncoderBlock(8, 2, 16, rngs=nnx.Rngs(0))(X)
    assert calls[0] == "x" and "inputs_q" in calls
    calls.clear()
    _layer()(X, X[:, :3])
    assert {"inputs_q", "inputs_k"} <= set(calls)


def test_bad_dropout_key_and_block_arguments_are_named() -> None:
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `dropout_rng`: expected a JAX PRNG key"):
        dj.damcha_attention(PARAMS, CFG.replace(dropout=0.5), X, deterministic=False, dropout_rng=3)
    with pytest.raises(dc.DamchaTypeError, match="`mlp_features`"):
        dj.DamchaEncoderBlock(8, 2, "32", rngs=nnx.Rngs(0))
    with pytest.raises(dc.DamchaValueError, match="`dropout_rate`"):
        dj.DamchaEncoderBlock(8, 2, 32, dropout_rate=1.0, rngs=nnx.Rngs(0))
    with pytest.raises(dc.DamchaTypeError, match="`share_metric`"):
        dj.DamchaEncoder(2, 8, 2, 32, share_metric="yes", rngs=nnx.Rngs(0))
    # A raw uint32 key and a typed key both work.
    for key in (jax.random.PRNGKey(0), jax.random.key(0)):
        y = dj.damcha_attention(PARAMS, CFG.replace(dropout=0.5), X, deterministic=False, dropout_rng=key)
        assert np.all(np.isfinite(np.asarray(y)))


def _custom_attention_fn(q, k, v, **kw):
    return nnx.dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize("attention", ["default", "custom-attention-fn"])
@pytest.mark.parametrize(
    "refused, match",
    [
        (lambda layer: layer(X[:1, :1]), "batch axes of the cache"),
        (lambda layer: layer(X[:, :1], X[:, :2]), "one key token per query token"),
        (lambda layer: layer(np.concatenate([X, X[:, :1]], axis=1)), "at most 4 new tokens"),
    ],
    ids=["batch-axes", "keys-per-query", "no-room"],
)
@pytest.mark.parametrize("stream", ["layer-rngs", "call-rngs"])
def test_a_refused_decode_step_leaves_the_dropout_stream_as_it_was(attention, refused, match, stream) -> None:
    """The decode checks (cache batch axes, one key per query, room left) ran after the dropout key
    was drawn: a refused step advanced the rng stream, so the next good step dropped other weights
    than it would have. Now the stream, the cache and the next step are those of a layer that was
    never given the bad call."""
    fn = None if attention == "default" else _custom_attention_fn

    def make() -> tuple[dj.DamchaAttention, nnx.Rngs | None]:
        layer = dj.DamchaAttention(
            H, E, dropout_rate=0.5, deterministic=False, decode=True, attention_fn=fn, rngs=nnx.Rngs(0, dropout=1)
        )
        layer.init_cache((B, N, E))
        return layer, (nnx.Rngs(dropout=7) if stream == "call-rngs" else None)

    def counter(layer: dj.DamchaAttention, rngs: nnx.Rngs | None) -> int:
        return int((layer.rngs if rngs is None else rngs.dropout).count[...])

    refusing, refusing_rngs = make()
    clean, clean_rngs = make()
    with pytest.raises(dc.DamchaValueError, match=match):
        refused(functools.partial(refusing, rngs=refusing_rngs))
    assert counter(refusing, refusing_rngs) == counter(clean, clean_rngs) == 0
    assert int(refusing.cache_index[...]) == 0
    got = refusing(X[:, :2], rngs=refusing_rngs)
    want = clean(X[:, :2], rngs=clean_rngs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
