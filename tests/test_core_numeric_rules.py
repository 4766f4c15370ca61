"""docs/spec.md section 9 in the core: every place where canonical parameters enter
rejects NaN/inf naming the parameter; NaN in an input gives NaN out; all-masked rows
give y = output.bias."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import damcha_core as dc

CFG = dc.DamchaConfig(
    query_dim=8, num_heads=4, key_dim=2, metric="lowrank", metric_rank=2, coupling="separate", context_dim=6
)
X = np.random.default_rng(0).normal(size=(2, 3, 8))
C = np.random.default_rng(1).normal(size=(2, 5, 6))


def _params(bad_name, bad_value):
    p = dc.init_params(CFG, seed=0)
    p[bad_name] = p[bad_name].copy()
    p[bad_name].flat[1] = bad_value
    return p


def _load(params, tmp_path):
    path = tmp_path / "p.safetensors"
    save_file(params, str(path), metadata={"format": "damcha-v1", "damcha_config": json.dumps(CFG.to_dict())})
    return dc.load_params(path)


ENTRIES = {
    "damcha_attention": lambda p, t: dc.damcha_attention(p, CFG, X, C),
    "metric_penalty": lambda p, t: dc.metric_penalty(p, CFG, X, C),
    "validate_params": lambda p, t: dc.validate_params(p, CFG),
    "fold_static_metric": lambda p, t: dc.fold_static_metric(p, CFG),
    "params_from_mha": lambda p, t: dc.params_from_mha({k: p[k] for k in dc.projection_names(CFG)}, CFG),
    "load_params": _load,
}


# params_from_mha takes only the projections (its metric tensors are fresh), so no metric name there.
CASES = [
    (entry, name)
    for entry in ENTRIES
    for name in ("query.kernel", "output.bias", "metric.k.u")
    if not (entry == "params_from_mha" and name.startswith("metric."))
]


@pytest.mark.parametrize("entry, name", CASES, ids=[f"{e}-{n}" for e, n in CASES])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_parameters_entering_are_checked_and_named(tmp_path, entry, name, bad):
    with pytest.raises(dc.DamchaValueError, match=rf"\['{name}'\]`: expected finite values \(no NaN or inf\)") as info:
        ENTRIES[entry](_params(name, bad), tmp_path)
    if entry == "load_params":
        assert str(tmp_path / "p.safetensors") in str(info.value)


def test_check_params_does_not_read_values():
    """The rule a port may run on traced arrays: shapes and dtypes only, so NaN passes."""
    dc.check_params(_params("query.kernel", np.nan), CFG)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NumPy notes the inf - inf it is asked to compute
@pytest.mark.parametrize("path", ["fast", "explicit"])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_inputs_give_non_finite_outputs(path, bad):
    p = dc.init_params(CFG, seed=1)
    for k in p:
        if k.startswith("metric."):
            p[k] = p[k] + 0.1
    x = X.copy()
    x[0, 1, 3] = bad
    y = dc.damcha_attention(p, CFG, x, C, path=path)
    assert np.all(~np.isfinite(y[0, 1])), "the query row holding the bad value"
    assert np.all(np.isfinite(y[1])), "another batch entry is untouched"
    c = C.copy()
    c[1, 2, 0] = bad
    mask = np.ones((3, 5), bool)
    mask[0, 2] = False  # query 0 does not see the bad key
    y = dc.damcha_attention(p, CFG, X, c, mask=mask, path=path)
    assert np.all(~np.isfinite(y[1, 1:])), "rows that see the bad key"
    assert np.all(np.isfinite(y[1, 0])), "the row that does not see the bad key (hidden keys have no influence)"
    assert np.all(np.isfinite(y[0])), "another batch entry is untouched"


def test_all_masked_rows_give_the_output_bias():
    p = dc.init_params(CFG, seed=2)
    p["output.bias"] = np.arange(8.0)
    mask = np.ones((3, 5), bool)
    mask[1] = False
    y, w = dc.damcha_attention(p, CFG, X, C, mask=mask, return_weights=True)
    np.testing.assert_array_equal(y[:, 1], np.broadcast_to(np.arange(8.0), (2, 8)))
    assert np.all(w[:, :, 1] == 0) and np.all(np.isfinite(y))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("path", ["fast", "explicit"])
def test_an_all_masked_row_is_the_bias_even_when_its_own_token_is_nan(path):
    # Self-attention: token 0 is NaN and is also key 0. Query 0 sees no key at all
    # (causal leaves key 0, the mask hides it), so its output is the defined 0 + b_o;
    # query 1 sees key 1 only, so the NaN key 0 must not reach it either.
    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    p = dc.init_params(cfg, seed=3)
    p["output.bias"] = np.arange(8.0)
    p["metric.qk.gate"] = np.full(2, 0.5)
    x = np.random.default_rng(4).normal(size=(1, 3, 8))
    x[0, 0, 0] = np.nan
    mask = np.array([False, True, True])
    y = dc.damcha_attention(p, cfg, x, mask=mask[None, None, None], causal=True, path=path)
    np.testing.assert_array_equal(y[0, 0], np.arange(8.0))
    assert np.all(np.isfinite(y[0, 1:]))
