"""safetensors I/O: round trips, and loud rejection of anything that does not match."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import damcha_core as dc

CFG = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, metric="lowrank", metric_rank=3, coupling="separate", context_dim=6)


def test_round_trip_is_exact_and_keeps_config(tmp_path):
    params = dc.init_params(CFG, seed=7)
    params["metric.q.gate"] = np.linspace(-1, 1, 4)
    path = tmp_path / "layer.safetensors"
    dc.save_params(path, params, CFG)
    loaded, cfg = dc.load_params(path)
    assert cfg == CFG
    assert set(loaded) == set(params)
    for k in params:
        assert loaded[k].dtype == np.float64
        np.testing.assert_array_equal(loaded[k], params[k])
    # an independent reader sees canonical names and the config in the metadata
    raw = load_file(str(path))
    assert set(raw) == set(CFG.param_shapes())
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "damcha-v1"
    assert dc.DamchaConfig.from_dict(json.loads(meta["damcha_config"])) == CFG


def test_float32_tensors_keep_their_dtype(tmp_path):
    params = {k: v.astype(np.float32) for k, v in dc.init_params(CFG).items()}
    dc.save_params(tmp_path / "f32.safetensors", params, CFG)
    loaded, _ = dc.load_params(tmp_path / "f32.safetensors")
    assert all(v.dtype == np.float32 for v in loaded.values())


def _rewrite(path, tensors):
    meta = {"format": "damcha-v1", "damcha_config": json.dumps(CFG.to_dict())}
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t: t.pop("metric.k.u"), r"missing \['metric.k.u'\]"),
        (lambda t: t.__setitem__("metric.qk.gate", np.zeros(4)), r"unexpected \['metric.qk.gate'\]"),
        (lambda t: t.__setitem__("value.bias", np.zeros((4, 2), np.int32)), r"\['value.bias'\]` must be a real floating array"),
        (lambda t: t.__setitem__("key.kernel", np.zeros((6, 4, 3))), r"`tensors in .*\['key.kernel'\]` must have shape \(6, 4, 2\)"),
    ],
    ids=["missing", "extra", "integer-tensor", "misshaped"],
)
def test_load_rejects_missing_extra_or_misshaped(tmp_path, edit, pattern):
    tensors = dc.init_params(CFG)
    edit(tensors)
    path = tmp_path / "bad.safetensors"
    _rewrite(path, tensors)
    with pytest.raises(dc.DamchaError, match=pattern):
        dc.load_params(path)


def test_load_rejects_files_without_damcha_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": np.zeros(2)}, str(path))
    with pytest.raises(dc.DamchaValueError, match=r"not a DAMCHA parameter file.*metadata keys=\[\]"):
        dc.load_params(path)


def test_save_rejects_params_that_do_not_match_config(tmp_path):
    params = dc.init_params(CFG)
    params["output.kernel"] = params["output.kernel"][:3]
    with pytest.raises(dc.DamchaValueError, match=r"output.kernel.*must have shape \(4, 2, 8\)"):
        dc.save_params(tmp_path / "x.safetensors", params, CFG)
    assert not (tmp_path / "x.safetensors").exists()
