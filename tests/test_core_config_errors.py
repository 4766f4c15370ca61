"""Config validation and the reference's input errors: every rule names the
argument, the value received and what was expected."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import damcha_core as dc
from damcha_core._reference import dense_map

BASE = dict(query_dim=8, num_heads=4, key_dim=2)


# A table, one case a line (not reformatted).
# fmt: off
@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(query_dim=0), dc.DamchaValueError, r"Invalid argument `query_dim`: expected an int >= 1\. Received: query_dim=0"),
        (dict(num_heads=2.0), dc.DamchaTypeError, r"^Invalid argument `num_heads`: expected an int >= 1\. Received: num_heads=2\.0$"),
        (dict(key_dim=True), dc.DamchaTypeError, r"^Invalid argument `key_dim`: expected an int >= 1\. Received: key_dim=True$"),
        (dict(num_kv_heads=3, coupling="query"), dc.DamchaValueError, r"^Invalid argument `num_heads`: expected a multiple of `num_kv_heads`.*Received: num_heads=4, num_kv_heads=3$"),
        (dict(num_kv_heads=2, coupling="tied"), dc.DamchaValueError, r"coupling='tied'.*num_kv_heads == num_heads.*num_heads=4, num_kv_heads=2"),
        (dict(context_dim=6, coupling="tied"), dc.DamchaValueError, r"coupling='tied'.*context_dim == query_dim.*query_dim=8, context_dim=6"),
        (dict(metric="full"), dc.DamchaValueError, r"Invalid argument `metric`: expected one of \('heads', 'lowrank', 'none'\)\. Received: metric='full'"),
        (dict(coupling=3), dc.DamchaTypeError, r"Invalid argument `coupling`: expected one of \('tied', 'separate', 'query', 'auto'\)\. Received: coupling=3"),
        (dict(metric="lowrank"), dc.DamchaValueError, r"Invalid argument `metric_rank`: expected an int >= 1 with metric='lowrank'"),
        (dict(metric="lowrank", metric_rank=0), dc.DamchaValueError, r"Invalid argument `metric_rank`: expected an int >= 1\. Received: metric_rank=0"),
        (dict(metric_rank=2), dc.DamchaValueError, r"only used with metric='lowrank'.*metric='heads', metric_rank=2"),
        (dict(scale=0.0), dc.DamchaValueError, r"Invalid argument `scale`: expected a finite number > 0.*scale=0\.0"),
        (dict(scale=float("nan")), dc.DamchaValueError, r"Invalid argument `scale`: expected a finite number > 0"),
        (dict(scale="1"), dc.DamchaTypeError, r"Invalid argument `scale`: expected a real number"),
        (dict(dropout=1.0), dc.DamchaValueError, r"Invalid argument `dropout`: expected a number in \[0, 1\)\. Received: dropout=1\.0"),
        (dict(use_bias=1), dc.DamchaTypeError, r"Invalid argument `use_bias`: expected a bool\. Received: use_bias=1"),
        (dict(value_dim=-1), dc.DamchaValueError, r"Invalid argument `value_dim`: expected an int >= 1 or None\. Received: value_dim=-1"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
# fmt: on
def test_invalid_config_raises_clear_error(kwargs, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        dc.DamchaConfig(**{**BASE, **kwargs})
    assert isinstance(info.value, dc.DamchaError)


def test_errors_are_value_and_type_error_subclasses():
    assert issubclass(dc.DamchaValueError, ValueError) and issubclass(dc.DamchaValueError, dc.DamchaError)
    assert issubclass(dc.DamchaTypeError, TypeError) and issubclass(dc.DamchaTypeError, dc.DamchaError)


def test_metric_none_lifts_coupling_constraints():
    cfg = dc.DamchaConfig(**BASE, metric="none", num_kv_heads=1, context_dim=5)
    assert cfg.metric_sides == ()
    assert not any(n.startswith("metric.") for n in cfg.param_shapes())


def test_defaults_are_resolved():
    cfg = dc.DamchaConfig(**BASE)
    assert (cfg.value_dim, cfg.num_kv_heads, cfg.context_dim, cfg.output_dim) == (2, 4, 8, 8)
    assert cfg.scale is None and cfg.softmax_scale == pytest.approx(1 / np.sqrt(2))
    assert cfg == dc.DamchaConfig(**BASE, value_dim=2, num_kv_heads=4, context_dim=8, output_dim=8)


configs = st.builds(
    lambda H, per, d, metric, coupling, r, bias, scale, drop: dict(
        query_dim=6, num_heads=H * per if coupling != "tied" else H, key_dim=d,
        num_kv_heads=H if coupling != "tied" else None, metric=metric,
        metric_rank=r if metric == "lowrank" else None, coupling=coupling, use_bias=bias, scale=scale, dropout=drop,
        context_dim=None if coupling == "tied" else 5,
    ),
    st.integers(1, 4), st.integers(1, 3), st.integers(1, 8), st.sampled_from(dc.METRICS), st.sampled_from(dc.COUPLINGS),
    st.integers(1, 4), st.booleans(), st.one_of(st.none(), st.floats(0.01, 10)), st.floats(0, 0.9),
)


@given(configs)
def test_to_dict_from_dict_round_trip_through_json(kwargs):
    cfg = dc.DamchaConfig(**kwargs)
    again = dc.DamchaConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.param_shapes() == cfg.param_shapes()


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `data`: expected DamchaConfig fields as keys.*Received: data with unknown keys \['heads'\]$"):
        dc.DamchaConfig.from_dict({**BASE, "heads": 3})


def test_param_shapes_follow_the_canonical_table():
    cfg = dc.DamchaConfig(query_dim=8, num_heads=6, key_dim=2, value_dim=3, num_kv_heads=2, context_dim=5,
                          output_dim=7, metric="lowrank", metric_rank=4, coupling="separate")
    assert cfg.param_shapes() == {
        "query.kernel": (8, 6, 2), "query.bias": (6, 2),
        "key.kernel": (5, 2, 2), "key.bias": (2, 2),
        "value.kernel": (5, 2, 3), "value.bias": (2, 3),
        "output.kernel": (6, 3, 7), "output.bias": (7,),
        "metric.q.gate": (6,), "metric.q.kernel": (8, 4), "metric.q.bias": (4,), "metric.q.u": (6, 2, 4), "metric.q.v": (6, 2, 4),
        "metric.k.gate": (2,), "metric.k.kernel": (5, 4), "metric.k.bias": (4,), "metric.k.u": (2, 2, 4), "metric.k.v": (2, 2, 4),
    }
    heads = dc.DamchaConfig(**BASE, use_bias=False)
    assert heads.param_shapes() == {
        "query.kernel": (8, 4, 2), "key.kernel": (8, 4, 2), "value.kernel": (8, 4, 2), "output.kernel": (4, 2, 8),
        "metric.qk.gate": (4,), "metric.qk.kernel": (8, 4, 4), "metric.qk.bias": (4, 4),
    }


# ----------------------------------------------------------------- input errors

CFG = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, coupling="separate", context_dim=6)
P = dc.init_params(CFG)
X = np.zeros((2, 3, 8))
C = np.zeros((2, 5, 6))


# A table, one case a line (not reformatted).
# fmt: off
@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: dc.damcha_attention(P, CFG, X[0], C), dc.DamchaValueError, r"Invalid argument `query`: expected rank 3.*Received: query.shape=\(3, 8\)"),
        (lambda: dc.damcha_attention(P, CFG, X[..., :7], C), dc.DamchaValueError, r"Invalid argument `query`: expected 8 features \(config.query_dim\)\. Received: query.shape=\(2, 3, 7\)"),
        (lambda: dc.damcha_attention(P, CFG, X, C[..., :5]), dc.DamchaValueError, r"Invalid argument `context`: expected 6 features.*context.shape=\(2, 5, 5\)"),
        (lambda: dc.damcha_attention(P, CFG, X, C[:1]), dc.DamchaValueError, r"^Invalid argument `context`: expected the batch size of `query`\. Received: query.shape=\(2, 3, 8\), context.shape=\(1, 5, 6\)$"),
        (lambda: dc.damcha_attention(P, CFG, X), dc.DamchaValueError, r"^Invalid argument `context`: expected a tensor when config.context_dim != config.query_dim .*Received: context=None, query_dim=8, context_dim=6$"),
        (lambda: dc.damcha_attention(P, CFG, X, C[:, :0]), dc.DamchaValueError, r"^Invalid argument `context`: expected at least one key \(M >= 1\).*Received: context.shape=\(2, 0, 6\)$"),
        (lambda: dc.damcha_attention(P, CFG, X.astype(int), C), dc.DamchaTypeError, r"Invalid argument `query`: expected a real floating tensor.*dtype=int64"),
        (lambda: dc.damcha_attention(P, CFG, X, C.astype(complex)), dc.DamchaTypeError, r"Invalid argument `context`: expected a real floating"),
        (lambda: dc.damcha_attention(P, CFG, X, C, mask=np.ones((2, 3, 5))), dc.DamchaTypeError, r"Invalid argument `mask`: expected a mask that is boolean.*dtype=float64"),
        (lambda: dc.damcha_attention(P, CFG, X, C, mask=np.ones((2, 3, 5), bool)), dc.DamchaValueError, r"pass mask\[:, None\].*mask.shape=\(2, 3, 5\)"),
        (lambda: dc.damcha_attention(P, CFG, X, C, mask=np.ones((2, 4, 3, 4), bool)), dc.DamchaValueError, r"broadcastable to \(B, H, N, M\) = \(2, 4, 3, 5\).*mask.shape=\(2, 4, 3, 4\)"),
        (lambda: dc.damcha_attention(P, CFG, X, C, mask=np.ones((3, 5), bool)[None]), dc.DamchaValueError, r"mask.shape=\(1, 3, 5\)"),
        (lambda: dc.damcha_attention(P, CFG, X, C, causal=1), dc.DamchaTypeError, r"Invalid argument `causal`: expected a bool\. Received: causal=1"),
        (lambda: dc.damcha_attention(P, CFG, X, C, return_weights="yes"), dc.DamchaTypeError, r"Invalid argument `return_weights`: expected a bool"),
        (lambda: dc.damcha_attention(P, CFG, X, C, query_offset=-1), dc.DamchaValueError, r"Invalid argument `query_offset`: expected an int >= 0\. Received: query_offset=-1"),
        (lambda: dc.damcha_attention(P, CFG, X, C, path="slow"), dc.DamchaValueError, r"Invalid argument `path`: expected one of \('fast', 'explicit'\)"),
        (lambda: dc.damcha_attention(P, {"query_dim": 8}, X, C), dc.DamchaTypeError, r"Invalid argument `config`: expected a DamchaConfig"),
        (lambda: dc.damcha_attention({k: v for k, v in P.items() if k != "key.bias"}, CFG, X, C), dc.DamchaValueError, r"missing \['key.bias'\]"),
        (lambda: dc.damcha_attention({**P, "extra": np.zeros(1)}, CFG, X, C), dc.DamchaValueError, r"unexpected \['extra'\]"),
        (lambda: dc.damcha_attention({**P, "metric.q.gate": np.zeros(3)}, CFG, X, C), dc.DamchaValueError, r"Invalid argument `params\['metric.q.gate'\]`: expected shape \(4,\).*Received: params\['metric.q.gate'\].shape=\(3,\)"),
        (lambda: dc.damcha_attention({**P, "query.bias": np.zeros((4, 2), int)}, CFG, X, C), dc.DamchaTypeError, r"Invalid argument `params\['query.bias'\]`: expected a real floating array"),
        (lambda: dc.damcha_attention({**P, "query.bias": np.full((4, 2), np.nan)}, CFG, X, C), dc.DamchaValueError, r"^Invalid argument `params\['query.bias'\]`: expected finite values \(no NaN or inf\)\. Received: 8 NaN and 0 inf of 8 entries, shape=\(4, 2\)"),
        (lambda: dc.init_params(CFG, seed=1.5), dc.DamchaTypeError, r"Invalid argument `seed`: expected an int >= 0\. Received: seed=1\.5"),
        (lambda: dc.init_params(CFG, seed=-1), dc.DamchaValueError, r"Invalid argument `seed`: expected an int >= 0\. Received: seed=-1"),
        (lambda: dc.init_params(CFG, seed=None), dc.DamchaTypeError, r"Invalid argument `seed`: expected an int >= 0\. Received: seed=None"),
        (lambda: dc.metric_penalty(P, CFG, X), dc.DamchaValueError, r"^Invalid argument `context`: expected a tensor when"),
    ],
    ids=lambda v: None,
)
# fmt: on
def test_bad_input_raises_clear_error(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_importing_damcha_core_imports_no_framework():
    code = (
        "import sys, damcha_core, damcha_conformance;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'tensorflow', 'keras', 'flax', 'onnx', 'onnxruntime', 'safetensors')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_api_all_is_sorted_and_importable():
    import damcha_conformance

    for module in (dc, damcha_conformance):
        assert list(module.__all__) == sorted(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name), name


class _FakeTensor:
    """Stands in for a framework tensor: shape and dtype, values unreadable."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype

    def __array__(self, *args, **kwargs):
        raise AssertionError("check_params must not read values")


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16", np.dtype("float16"), "float64"])
def test_check_params_reads_only_shapes_and_dtypes(dtype):
    fake = {k: _FakeTensor(s, dtype) for k, s in CFG.param_shapes().items()}
    dc.check_params(fake, CFG)


def test_check_params_rejects_like_validate_params():
    fake = {k: _FakeTensor(s, "torch.float32") for k, s in CFG.param_shapes().items()}
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `params\['query.kernel'\]`: expected a real floating array"):
        dc.check_params({**fake, "query.kernel": _FakeTensor((8, 4, 2), "torch.int64")}, CFG)
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `params\['key.bias'\]`: expected shape \(4, 2\)"):
        dc.check_params({**fake, "key.bias": _FakeTensor((4, 3), "torch.float32")}, CFG)


def test_from_dict_names_missing_required_fields():
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `data`: expected the required DamchaConfig fields \['num_heads'\] among its keys\. Received: data with keys \['key_dim', 'query_dim'\]$"):
        dc.DamchaConfig.from_dict({"query_dim": 8, "key_dim": 4})


@pytest.mark.parametrize(
    "value, want",
    [
        (np.zeros((2, 3), np.float32), "ndarray(shape=(2, 3), dtype=float32)"),
        (np.float32(0.5), "0.5"),
        (np.bool_(True), "True"),
        ((1, 16), "(1, 16)"),
        ([[0.5] * 16] * 3, "list(len=3, element type list)"),
        ([0.25] * 1000, "list(len=1000, element type float)"),
        ((1, "a", None, 2.0, 3, 4, 5, 6, 7), "tuple(len=9, element types NoneType, float, int, str)"),
        ({"q": 1, "k": 2}, "dict(len=2, keys=['q', 'k'])"),
        ("x" * 300, "'" + "x" * 60 + "...' (str of length 300)"),
        ("heads", "'heads'"),
        (None, "None"),
    ],
    ids=["array", "np-float", "np-bool", "shape-tuple", "nested-list", "long-list", "mixed-tuple", "dict", "long-str", "str", "none"],
)
def test_describe_never_prints_large_contents(value, want):
    assert dc.describe(value) == want


def test_messages_stay_one_line_for_list_inputs():
    """A query passed as a nested Python list of the wrong shape: one line, no contents."""
    nested = [[[0.125] * 8] * 50]  # (1, 50, 8): the wrong feature size for CFG below
    cfg = dc.DamchaConfig(query_dim=4, num_heads=2, key_dim=2)
    with pytest.raises(dc.DamchaValueError) as info:
        dc.damcha_attention(dc.init_params(cfg), cfg, nested)
    assert "\n" not in str(info.value) and "0.125" not in str(info.value)
    with pytest.raises(dc.DamchaTypeError) as info:
        dc.check_bool("causal", nested)
    assert str(info.value) == "Invalid argument `causal`: expected a bool. Received: causal=list(len=1, element type list)"


def test_replace_lets_defaulted_fields_follow_the_fields_they_derive_from():
    """replace kept defaults resolved at construction: C(8,2,4).replace(num_heads=4)
    failed on num_kv_heads=2 (never set), key_dim=8 kept value_dim 4, and
    query_dim=16 silently became cross-attention from 8-feature context."""
    base = dc.DamchaConfig(8, 2, 4)
    assert base.replace(num_heads=4) == dc.DamchaConfig(8, 4, 4)
    assert base.replace(key_dim=8) == dc.DamchaConfig(8, 2, 8)
    assert base.replace(query_dim=16, coupling="auto") == dc.DamchaConfig(16, 2, 4)
    assert base.replace(query_dim=16).context_dim == 16
    # Values that differ from their default are kept ...
    gqa = dc.DamchaConfig(8, 4, 4, num_kv_heads=2, value_dim=3, output_dim=5, context_dim=6)
    changed = gqa.replace(num_heads=8, key_dim=2, query_dim=10)
    assert (changed.num_kv_heads, changed.value_dim, changed.output_dim, changed.context_dim) == (2, 3, 5, 6)
    assert changed.coupling == "separate"
    # ... as is any field given in the changes.
    assert base.replace(num_heads=4, num_kv_heads=2).num_kv_heads == 2
    # Equal configs replace alike, however they were built.
    explicit = dc.DamchaConfig(8, 2, 4, value_dim=4, num_kv_heads=2, context_dim=8, output_dim=8, coupling="tied")
    assert explicit == base and explicit.replace(num_heads=4) == base.replace(num_heads=4)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(scale=10**400), dc.DamchaValueError, r"^Invalid argument `scale`: expected a finite number > 0 or None"),
        (dict(dropout=10**400), dc.DamchaValueError, r"^Invalid argument `dropout`: expected a number in \[0, 1\)"),
        (dict(dropout=-(10**400)), dc.DamchaValueError, r"^Invalid argument `dropout`: expected a number in \[0, 1\)"),
    ],
    ids=["scale", "dropout", "dropout-negative"],
)
def test_ints_beyond_float_range_are_refused_by_name(kwargs, error, pattern):
    """float(10**400) raised a bare OverflowError from check_real/check_rate."""
    with pytest.raises(error, match=pattern):
        dc.DamchaConfig(**{**BASE, **kwargs})
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `lam`: expected a finite number >= 0"):
        dc.check_finite_nonneg("lam", 10**400)


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda: dc.DamchaConfig(**BASE, heads=4), r"^Invalid argument `heads`: expected DamchaConfig fields"),
        (lambda: dc.DamchaConfig(**BASE).replace(heads=4), r"^Invalid argument `heads`: expected DamchaConfig fields"),
        (lambda: dc.DamchaConfig(8, 4, 2, *([None] * 12)), r"^Invalid argument `DamchaConfig`: expected at most 14"),
        (lambda: dc.DamchaConfig(8, 4), r"^Invalid argument `key_dim`: expected an int >= 1 \(it is required\)"),
        (lambda: dc.DamchaConfig(8, 4, 2, query_dim=8), r"^Invalid argument `query_dim`: expected one value"),
    ],
    ids=["unknown-keyword", "replace-unknown", "too-many-positional", "missing-required", "given-twice"],
)
def test_config_calls_python_cannot_bind_raise_damcha_type_error(build, pattern):
    """The dataclass __init__ raised Python's bare TypeError ("unexpected keyword argument"),
    where make_config names the field with a DamchaTypeError."""
    with pytest.raises(dc.DamchaTypeError, match=pattern):
        build()


def test_config_init_still_binds_like_the_dataclass():
    import copy
    import dataclasses
    import inspect
    import pickle

    cfg = dc.DamchaConfig(8, 4, 2, metric="none")
    assert cfg == dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, metric="none")
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg) == dataclasses.replace(cfg)
    assert list(inspect.signature(dc.DamchaConfig).parameters)[:3] == ["query_dim", "num_heads", "key_dim"]


@pytest.mark.parametrize("rank, span", [(1, 1), (2, 2), (3, 3), (4, 4), (6, 4)], ids=lambda v: str(v))
def test_a_lowrank_rank_above_s_times_d_is_accepted_because_it_still_adds_maps(rank: int, span: int) -> None:
    """metric_rank is not bounded by S*d (an audit asked): each Delta(t) = U diag(u(t)) V^T has rank
    <= S*d = 2 here, but the maps over tokens span min(r, (S*d)^2) dimensions, so r = 3 and 4 reach
    maps r = 2 cannot; r = 6 adds nothing over 4 (every affine map phi -> Delta is reachable at
    r = S*d * min(S*d, E + 1) = 4) and is accepted as an over-parameterisation (the config's docs)."""
    config = dc.DamchaConfig(query_dim=4, num_heads=2, key_dim=1, metric="lowrank", metric_rank=rank)
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=np.shape(v)) for k, v in dc.init_params(config, 0).items()}  # open gates
    tokens = rng.normal(size=(1, 32, 4))
    deltas = dense_map(params, config, "qk", tokens).reshape(32, 2, 2) - np.eye(2)
    assert max(np.linalg.matrix_rank(d) for d in deltas) <= 2  # S*d, whatever the rank
    assert np.linalg.matrix_rank(deltas.reshape(32, 4)) == span
    y = dc.damcha_attention(params, config, tokens[:, :5])
    assert y.shape == (1, 5, 4) and np.all(np.isfinite(y))


@pytest.mark.parametrize(
    ("x", "error", "pattern"),
    [
        (np.zeros((2, 5, 4)), dc.DamchaValueError, r"expected 8 features \(config\.attention\.query_dim\)\. Received: x\.shape=\(2, 5, 4\)"),
        (np.zeros((5, 8)), dc.DamchaValueError, r"expected rank 3, \(batch, length, features\)\. Received: x\.shape=\(5, 8\)"),
        (np.zeros((2, 5, 8), np.int64), dc.DamchaTypeError, r"expected a real floating.*dtype=int64"),
        ("tokens", dc.DamchaTypeError, r"expected a real floating.*Received: x='tokens'"),
    ],
    ids=["features", "rank-2", "int", "string"],
)
def test_encoder_forward_checks_x(x, error, pattern):
    """encoder_forward names its tokens `x` as damcha_attention names its query:
    not a NumPy broadcast error, and int tokens are not silently cast."""
    ec = dc.EncoderConfig(attention=dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), num_layers=1, ffn_dim=16)
    params = dc.init_encoder_params(ec, seed=0)
    with pytest.raises(error, match=r"Invalid argument `x`: " + pattern):
        dc.encoder_forward(params, ec, x)


@pytest.mark.parametrize(
    ("offset", "error"),
    [(-1, dc.DamchaValueError), (1.5, dc.DamchaValueError), (True, dc.DamchaValueError), ("2", dc.DamchaTypeError)],
    ids=["negative", "float", "bool", "string"],
)
def test_check_offset_classes(offset, error):
    """Numbers that are no offset are value errors (the JAX port's traced offsets
    give the same); what is no number at all is a type error."""
    with pytest.raises(error, match=r"Invalid argument `query_offset`: expected an int >= 0"):
        dc.check_offset("query_offset", offset)
    assert dc.check_offset("query_offset", np.int64(3)) == 3
