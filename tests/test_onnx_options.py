"""One options object for every exporter, and the stack format living in damcha_core."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import damcha_core as dc
import damcha_onnx as do

ATTN = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
ENC = dc.EncoderConfig(ATTN, num_layers=1, ffn_dim=8, causal=True)
TM = dc.TokenModelConfig(ENC, vocab_size=5, max_len=6, num_classes=3)


def _causal(kw):
    # Layers take causal as a keyword (stacks from their config): added unless an options object holds it.
    return kw if "options" in kw else {"causal": True, **kw}


def _exporters():
    return {
        "export": lambda **kw: do.export(dc.init_params(ATTN, 0), ATTN, None, **_causal(kw)),
        "build_model": lambda **kw: do.build_model(dc.init_params(ATTN, 0), ATTN, **_causal(kw)),
        "export_encoder": lambda **kw: do.export_encoder(dc.init_encoder_params(ENC, 0), ENC, None, **kw),
        "export_token_model": lambda **kw: do.export_token_model(dc.init_token_model_params(TM, 0), TM, None, **kw),
    }


def test_stack_format_is_the_cores_and_reexported_by_damcha_onnx():
    for name in (
        "EncoderConfig",
        "TokenModelConfig",
        "encoder_forward",
        "init_encoder_params",
        "init_token_model_params",
        "token_model_forward",
        "validate_stack_params",
    ):
        assert getattr(do, name) is getattr(dc, name), name
        assert name in dc.__all__
    # The core stays NumPy-only: importing it (and building a stack reference) loads no ONNX or framework.
    code = (
        "import sys, numpy as np, damcha_core as dc\n"
        "c = dc.EncoderConfig(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), num_layers=2, ffn_dim=4)\n"
        "dc.encoder_forward(dc.init_encoder_params(c), c, np.zeros((1, 3, 8)))\n"
        "bad = [m for m in ('onnx', 'onnxruntime', 'torch', 'jax', 'tensorflow', 'keras') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


BAD = [
    ("opset", 12, dc.DamchaValueError, "opset"),
    ("opset", "23", dc.DamchaTypeError, "opset"),
    ("form", "fast", dc.DamchaValueError, "form"),
    ("dtype", "int8", dc.DamchaValueError, "dtype"),
    ("mask", 1, dc.DamchaTypeError, "mask"),
    ("dynamic", "no", dc.DamchaTypeError, "dynamic"),
    ("kv_cache", None, dc.DamchaTypeError, "kv_cache"),
    ("batch_size", 2, dc.DamchaValueError, "batch_size"),
]


@pytest.mark.parametrize("exporter", list(_exporters()))
@pytest.mark.parametrize("field,value,error,named", BAD, ids=[f"{f}={v!r}" for f, v, _, _ in BAD])
def test_every_exporter_rejects_a_bad_option_alike(exporter, field, value, error, named):
    with pytest.raises(error, match=rf"`{named}`|{named}="):
        _exporters()[exporter](**{field: value})


@pytest.mark.parametrize("exporter", list(_exporters()))
def test_numpy_dtypes_are_taken_like_their_names(exporter):
    by_name = _exporters()[exporter](dtype="float16")
    for dtype in (np.float16, np.dtype("float16"), "f2"):
        assert _exporters()[exporter](dtype=dtype).graph == by_name.graph, dtype
    assert do.ExportOptions(dtype=np.float64).dtype == "float64"
    # A class is named as such in the message (it read `type(shape=<attribute 'shape' ...>, ...)`).
    with pytest.raises(dc.DamchaValueError, match=r"Received: dtype=numpy\.int32$"):
        _exporters()[exporter](dtype=np.int32)
    with pytest.raises(dc.DamchaValueError, match=r"bfloat16 graphs are not exported"):
        _exporters()[exporter](dtype="bfloat16")
    with pytest.raises(dc.DamchaValueError, match=r"Received: dtype=None$"):
        _exporters()[exporter](dtype=None)  # not np.dtype(None), which is float64


def test_describe_names_a_class():
    assert dc.describe(np.float32) == "numpy.float32"
    assert dc.describe(int) == "int"
    assert dc.describe(np.dtype("float16")) == "dtype('float16')"


@pytest.mark.parametrize("exporter", list(_exporters()))
def test_options_object_equals_the_keywords(exporter):
    kind = {"export": "layer", "build_model": "layer", "export_encoder": "encoder", "export_token_model": "token_model"}
    options = do.ExportOptions(
        kind=kind[exporter], opset=17, mask=True, causal=True, dynamic=False, batch_size=2, query_len=3
    )
    a = _exporters()[exporter](options=options)
    b = _exporters()[exporter](opset=17, mask=True, dynamic=False, batch_size=2, query_len=3)
    assert a.graph == b.graph
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `options`: expected None when export options are passed as keywords.*'opset'",
    ):
        _exporters()[exporter](options=options, opset=18)


def test_options_are_checked_on_construction():
    with pytest.raises(dc.DamchaValueError, match="expected False unless causal=True"):
        do.ExportOptions(kv_cache=True)
    with pytest.raises(dc.DamchaValueError, match="expected False unless config.causal=True"):
        do.ExportOptions(kind="encoder", kv_cache=True)
    with pytest.raises(dc.DamchaValueError, match="Invalid argument `context_len`: expected None without cross=True"):
        do.ExportOptions(context_len=3, dynamic=False, batch_size=1, query_len=1)
    with pytest.raises(dc.DamchaValueError, match="is self-attention"):
        do.ExportOptions(kind="encoder", cross=True)
    with pytest.raises(dc.DamchaValueError, match="kind 'encoder'"):
        do.export_encoder(dc.init_encoder_params(ENC, 0), ENC, None, options=do.ExportOptions(causal=True))
    with pytest.raises(dc.DamchaValueError, match="options.causal"):
        do.export_encoder(dc.init_encoder_params(ENC, 0), ENC, None, options=do.ExportOptions(kind="encoder"))
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `options`: expected an ExportOptions"):
        do.export(dc.init_params(ATTN, 0), ATTN, None, options={"opset": 23})
    options = do.ExportOptions(kind="encoder", causal=True, mask=True)
    assert (options.batch_dim, options.query_dim, options.key_dim) == ("batch", "query_len", "query_len")


def test_layer_params_checks_the_index():
    params = dc.init_encoder_params(ENC, 0)
    assert set(ENC.layer_params(params, 0)) == set(ATTN.param_shapes())
    with pytest.raises(dc.DamchaValueError, match="Invalid argument `index`: expected an int < num_layers=1"):
        ENC.layer_params(params, 1)


def test_stack_reference_returns_each_layers_weights():
    enc = dc.EncoderConfig(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), num_layers=2, ffn_dim=8, causal=True)
    params = dc.init_encoder_params(enc, 3)
    x = np.random.default_rng(0).normal(size=(2, 4, 8))
    h, weights = dc.encoder_forward(params, enc, x, return_weights=True)
    np.testing.assert_array_equal(h, dc.encoder_forward(params, enc, x))
    assert len(weights) == 2 and all(w.shape == (2, 2, 4, 4) for w in weights)
    np.testing.assert_allclose(weights[0].sum(-1), 1.0)
    assert np.all(np.triu(weights[1], 1) == 0)  # causal
