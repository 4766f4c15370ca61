"""The framework-free ONNX exporter against the NumPy reference.

Every catalogue case runs in onnx.reference.ReferenceEvaluator (in
onnxruntime: tests/test_onnx_conformance.py, one test per check); batch and sequence lengths change
after export; bad input fails loudly.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors
import pytest

import damcha_core as dc
import damcha_onnx as do
from damcha_conformance import CATALOGUE, case_params, materialise, tolerance

SHORT = [c for c in CATALOGUE if max(c.query_len, c.context_len or 0) <= 64]


def _inputs(data):
    inputs = {"query": data.query}
    if data.context is not None:
        inputs["context"] = data.context
    if data.value is not None:
        inputs["value"] = data.value
    if data.mask is not None:
        inputs["mask"] = data.mask
    return inputs


def _export_case(data, opset, dtype):
    return do.export(
        data.params,
        data.config,
        None,
        opset=opset,
        causal=data.causal,
        cross=data.context is not None,
        mask=data.mask is not None,
        dtype=dtype,
    )


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("case", SHORT, ids=lambda c: c.name)
def test_reference_evaluator_matches(case, opset):
    data = materialise(case)
    model = _export_case(data, opset, "float64")
    out = do.run_reference(model, _inputs(data))
    _, ratio = tolerance("float64").output_ratio(out, data.expected)
    assert ratio <= 1, f"ReferenceEvaluator error ratio {ratio}"


def test_uses_standard_attention_op_only_at_opset_23():
    data = materialise(CATALOGUE[2])
    ops23 = {n.op_type for n in _export_case(data, 23, "float32").graph.node}
    ops17 = {n.op_type for n in _export_case(data, 17, "float32").graph.node}
    assert "Attention" in ops23 and "Softmax" not in ops23
    assert "Attention" not in ops17 and "Softmax" in ops17


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
@pytest.mark.parametrize(
    "kw",
    [dict(metric="heads"), dict(metric="lowrank", metric_rank=2, coupling="separate", num_kv_heads=2, context_dim=12)],
    ids=["heads-tied", "lowrank-separate-gqa"],
)
def test_dynamic_batch_and_lengths_after_export(kw, opset):
    config = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, **kw)
    params = case_params(config, 5)
    cross = config.context_dim != config.query_dim
    model = do.export(params, config, None, opset=opset, cross=cross, mask=True, causal=not cross)
    session = do.ort_session(model)
    rng = np.random.default_rng(0)
    for B, N, M in [(1, 1, 1), (3, 9, 4), (2, 5, 11)]:
        M = M if cross else N
        x = rng.normal(size=(B, N, 16))
        c = rng.normal(size=(B, M, config.context_dim)) if cross else None
        mask = rng.random((B, 1, 1, M)) < 0.6
        inputs = {"query": x, "mask": mask} | ({"context": c} if cross else {})
        out = do.run_ort(model, inputs, session=session)
        expected = dc.damcha_attention(params, config, x, c, mask=mask, causal=not cross)
        _, ratio = tolerance("float32").output_ratio(out, expected)
        assert ratio <= 1, (B, N, M, ratio)


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("runtime", ["onnxruntime", "reference"])
def test_all_masked_rows_give_output_bias_not_nan(opset, runtime):
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = case_params(config, 1)
    model = do.export(params, config, None, opset=opset, mask=True, dtype="float64")
    x = np.random.default_rng(1).normal(size=(2, 4, 8))
    mask = np.ones((2, 2, 4, 4), dtype=bool)
    mask[0, :, 2, :] = False  # every head of one query row
    mask[1, 1, :, :] = False  # one whole head
    run = do.run_ort if runtime == "onnxruntime" else do.run_reference
    out = run(model, {"query": x, "mask": mask})
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[0, 2], params["output.bias"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(out, dc.damcha_attention(params, config, x, mask=mask), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
def test_static_export_fixes_shapes_and_validates(tmp_path, opset):
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, metric="none")
    params = case_params(config, 2)
    path = tmp_path / "layer.onnx"
    do.export(params, config, path, opset=opset, dynamic=False, batch_size=2, query_len=3)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [2, 3, 8]
    x = np.random.default_rng(2).normal(size=(2, 3, 8))
    np.testing.assert_allclose(
        do.run_ort(model, {"query": x}), dc.damcha_attention(params, config, x), atol=2e-5, rtol=2e-4
    )


# ------------------------------------------------------------------ errors

CFG = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)


def test_params_not_matching_config_are_rejected():
    params = dc.init_params(CFG)
    del params["metric.qk.gate"]
    with pytest.raises(dc.DamchaValueError, match=r"missing \['metric.qk.gate'\]"):
        do.export(params, CFG, None)
    params = dc.init_params(CFG)
    params["query.kernel"] = np.zeros((8, 2, 5))
    with pytest.raises(dc.DamchaValueError, match=r"query.kernel.*\(8, 2, 4\).*\(8, 2, 5\)"):
        do.export(params, CFG, None)


@pytest.mark.parametrize("opset", [16, 11, 1000], ids=["opset16", "opset11", "opset1000"])
def test_opset_out_of_range_is_rejected(opset):
    with pytest.raises(
        dc.DamchaValueError, match=rf"Invalid argument `opset`: expected an int in \[17, \d+\].*opset={opset}"
    ):
        do.export(dc.init_params(CFG), CFG, None, opset=opset)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(opset="23"), dc.DamchaTypeError, r"Invalid argument `opset`: expected an int.*'23'"),
        (
            dict(form="attention", opset=18),
            dc.DamchaValueError,
            r"Invalid argument `opset`: expected an int >= 23 with form='attention'",
        ),
        (dict(dtype="int8"), dc.DamchaValueError, r"Invalid argument `dtype`: expected one of.*'int8'"),
        (dict(dtype="bfloat16"), dc.DamchaValueError, r"`dtype`.*bfloat16.*no bfloat16 kernels"),
        (dict(causal=1), dc.DamchaTypeError, r"Invalid argument `causal`: expected a bool"),
        (
            dict(dynamic=False),
            dc.DamchaValueError,
            r"Invalid argument `batch_size`: expected an int >= 1 with dynamic=False",
        ),
        (
            dict(batch_size=2),
            dc.DamchaValueError,
            r"Invalid argument `batch_size`: expected None with dynamic=True \(it fixes a dimension, so it needs dynamic=False\)",
        ),
        (
            dict(mask=None),
            dc.DamchaTypeError,
            r"Invalid argument `mask`: expected True or '4d' \(a 4-D mask input\), 'padding' \(a \(B, M\) key padding "
            r"mask\) or False/'none'\. Received: mask=None$",
        ),
        (dict(mask="4D"), dc.DamchaValueError, r"Invalid argument `mask`: expected True or '4d'.*Received: mask='4D'$"),
        (
            dict(external_data=1),
            dc.DamchaTypeError,
            r"Invalid argument `external_data`: expected True, False or None .*Received: external_data=1$",
        ),
    ],
    ids=[
        "opset-type",
        "attention-form-old-opset",
        "dtype",
        "bfloat16",
        "causal-type",
        "static-needs-sizes",
        "sizes-need-static",
        "mask-none",
        "mask-unknown-name",
        "external-data-int",
    ],
)
def test_bad_export_options_are_rejected(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        do.export(dc.init_params(CFG), CFG, None, **kwargs)


def test_mask_takes_the_names_the_cli_and_the_metadata_use():
    # The CLI's --mask 4d / none and the model's damcha_mask metadata ("4d", "none", "padding") were refused by the API.
    params = dc.init_params(CFG)
    for name, value in (("4d", True), ("none", False), ("padding", "padding")):
        model = do.export(params, CFG, None, mask=name)
        assert model.SerializeToString() == do.export(params, CFG, None, mask=value).SerializeToString()
        assert {p.key: p.value for p in model.metadata_props}["damcha_mask"] == name


def test_self_attention_export_needs_equal_dims():
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, context_dim=6, coupling="query")
    with pytest.raises(dc.DamchaValueError, match="pass cross=True"):
        do.export(dc.init_params(config), config, None)


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
@pytest.mark.parametrize(
    "bad",
    ["features", "rank", "context-batch", "mask-rank3", "mask-batch-larger", "mask-heads"],
)
def test_onnxruntime_rejects_wrong_input_shapes(bad, opset):
    # Nothing may broadcast silently: each of these must raise in the runtime.
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, coupling="separate", context_dim=6)
    model = do.export(dc.init_params(config), config, None, opset=opset, cross=True, mask=True)
    session = do.ort_session(model)
    rng = np.random.default_rng(0)
    feeds = {
        "query": rng.normal(size=(2, 3, 8)).astype(np.float32),
        "context": rng.normal(size=(2, 5, 6)).astype(np.float32),
        "mask": np.ones((2, 1, 1, 5), dtype=bool),
    }
    session.run(None, feeds)  # the well-formed feed runs
    if bad == "features":
        feeds["query"] = feeds["query"][..., :7]
    elif bad == "rank":
        feeds["query"] = feeds["query"][0]
    elif bad == "context-batch":
        feeds["context"] = feeds["context"][:1]
    elif bad == "mask-rank3":
        feeds["mask"] = feeds["mask"][:, 0]
    elif bad == "mask-batch-larger":
        feeds["query"], feeds["context"] = feeds["query"][:1], feeds["context"][:1]
    else:
        feeds["mask"] = np.ones((2, 3, 1, 5), dtype=bool)
    with pytest.raises((ort_errors.Fail, ort_errors.InvalidArgument, ort_errors.RuntimeException)):
        session.run(None, feeds)
    # run_ort checks the feeds first and names the input and the shape it received.
    name = {"features": "query", "rank": "query", "context-batch": "context", "mask-batch-larger": "mask"}.get(
        bad, "mask"
    )
    with pytest.raises(dc.DamchaValueError, match=rf"`{name}`.*Received: .*{name}.shape="):
        do.run_ort(model, feeds, session=session)


@pytest.mark.parametrize(
    "kind, pattern",
    [
        (
            "decode-mask-short",
            r"Invalid argument `mask`: expected (the size of `query` on|a span over the cache and the new tokens)",
        ),
        (
            "decode-batch",
            r"Invalid argument `past_key`: expected the size of `query` on batch|Invalid argument `query`: expected the size of `past_key` on batch",
        ),
        (
            "stack-mask-heads",
            r"Invalid argument `mask`: expected a shape broadcastable to \(2, 2, 3, 3\) \(axis 1, heads, must be 1 or 2\)",
        ),
    ],
)
def test_run_ort_checks_decode_and_stack_feeds(kind, pattern):
    rng = np.random.default_rng(1)
    if kind.startswith("decode"):
        config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, coupling="query", num_kv_heads=1)
        model = do.export(dc.init_params(config), config, None, causal=True, kv_cache=True, mask=True)
        feeds = {
            "query": rng.normal(size=(2, 2, 8)),
            "past_key": np.zeros((2, 1, 3, 4)),
            "past_value": np.zeros((2, 1, 3, 4)),
            "mask": np.ones((2, 1, 1, 5), bool),
        }
        do.run_ort(model, feeds)  # the well-formed step runs
        if kind == "decode-mask-short":
            feeds["mask"] = feeds["mask"][..., :2]  # spans the new tokens only, not the cache
        else:
            feeds["past_key"] = feeds["past_value"] = np.zeros((1, 1, 3, 4))
    else:
        config = do.EncoderConfig(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), num_layers=1, ffn_dim=8)
        model = do.export_encoder(do.init_encoder_params(config), config, None, mask=True)
        feeds = {"query": rng.normal(size=(2, 3, 8)), "mask": np.ones((2, 2, 3, 3), bool)}
        do.run_ort(model, feeds)
        feeds["mask"] = np.ones((2, 3, 3, 3), bool)
    with pytest.raises(dc.DamchaValueError, match=pattern):
        do.run_ort(model, feeds)


def test_wrong_input_dtypes_are_rejected_by_feeds_helper():
    model = do.export(dc.init_params(CFG), CFG, None, mask=True)
    x = np.zeros((1, 2, 8))
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `mask`: expected a mask that is boolean"):
        do.run_ort(model, {"query": x, "mask": np.ones((1, 1, 2, 2))})
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `query`: expected a real floating tensor"):
        do.run_ort(model, {"query": np.zeros((1, 2, 8), dtype=np.int64), "mask": np.ones((1, 1, 2, 2), bool)})
    with pytest.raises(dc.DamchaValueError, match=r"missing=\['mask'\]"):
        do.run_ort(model, {"query": x})


def test_feeds_a_cast_would_change_are_refused():
    """run_ort casts feeds to the model's dtype: float16 turned 7e4 into inf (an
    all-NaN output), int64 turned a uint64 id of 2**64 - 1 into -1 (then reported
    as the id received)."""
    model = do.export(dc.init_params(CFG), CFG, None, dtype="float16")
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `query`: expected values within float16's range \(\|x\| <= 65504\).*"
        r"Received: query with \|x\| up to 70000",
    ):
        do.run_ort(model, {"query": np.full((1, 2, 8), 7e4)})
    do.run_ort(model, {"query": np.full((1, 2, 8), 6e4)})  # within the range: runs
    config = do.TokenModelConfig(
        do.EncoderConfig(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), num_layers=1, ffn_dim=8),
        vocab_size=11,
        max_len=4,
        num_classes=2,
    )
    tokens_model = do.export_token_model(do.init_token_model_params(config, 1), config, None)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `tokens`: expected values that int64 holds.*\[1, 18446744073709551615\]",
    ):
        do.run_ort(tokens_model, {"tokens": np.array([[1, 2**64 - 1, 3]], np.uint64)})


def test_run_ort_checks_the_session_it_is_given(tmp_path):
    """A session that is not one, or one of another model, failed inside onnxruntime."""
    model = do.export(dc.init_params(CFG), CFG, None, mask=True)
    other = do.export(dc.init_params(CFG), CFG, None)
    feeds = {"query": np.zeros((1, 2, 8)), "mask": np.ones((1, 1, 2, 2), bool)}
    np.testing.assert_array_equal(do.run_ort(model, feeds, session=do.ort_session(model)), do.run_ort(model, feeds))
    with pytest.raises(
        dc.DamchaTypeError, match=r"Invalid argument `session`: expected an onnxruntime\.InferenceSession"
    ):
        do.run_ort(model, feeds, session="not a session")
    with pytest.raises(
        dc.DamchaValueError,
        match=r"`session`: expected a session of this model \(inputs \['query', 'mask'\].*Received: a session with inputs \['query'\]",
    ):
        do.run_ort(model, feeds, session=do.ort_session(other))


def test_helpers_take_a_saved_model_path(tmp_path):
    # ort_session and quantize_int8 took a path, but run_ort/run_reference/
    # empty_kv_cache crashed on it with AttributeError ('str' has no 'graph').
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, coupling="query", num_kv_heads=1)
    params = case_params(config, 4)
    path = tmp_path / "step.onnx"
    model = do.export(params, config, path, causal=True, kv_cache=True, dtype="float64")
    x = np.random.default_rng(4).normal(size=(2, 3, 8))
    expected = dc.damcha_attention(params, config, x, causal=True)
    for where in (path, str(path)):
        cache = do.empty_kv_cache(where, 2)
        assert cache.keys() == do.empty_kv_cache(model, 2).keys()
        for run in (do.run_ort, do.run_reference):
            out = run(where, {"query": x, **cache})
            _, ratio = tolerance("float64").output_ratio(out, expected)
            assert ratio <= 1, (run.__name__, ratio)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (
            lambda m: do.run_ort(42, {}),
            dc.DamchaTypeError,
            r"Invalid argument `model`: expected an onnx.ModelProto or the path.*Received: model=42",
        ),
        (
            lambda m: do.run_reference("/nonexistent/m.onnx", {}),
            dc.DamchaValueError,
            r"Invalid argument `model`: expected .*Received: model='/nonexistent/m.onnx' \(no such file\)",
        ),
        (
            lambda m: do.run_ort(m, [np.zeros((1, 2, 8))]),
            dc.DamchaTypeError,
            r"Invalid argument `inputs`: expected a mapping.*Received: inputs=",
        ),
        (
            lambda m: do.ort_session(m, threads="2"),
            dc.DamchaTypeError,
            r"Invalid argument `threads`: expected an int >= 1 or None. Received: threads='2'",
        ),
        (
            lambda m: do.ort_session(m, threads=0),
            dc.DamchaValueError,
            r"Invalid argument `threads`: expected an int >= 1 or None. Received: threads=0",
        ),
        (
            lambda m: do.quantize_int8(42),
            dc.DamchaTypeError,
            r"Invalid argument `model`: expected an onnx.ModelProto.*Received: model=42",
        ),
        (
            lambda m: do.quantization_error(m, m, {"query": np.zeros((1, 2, 8))}, np.zeros((1, 3, 8))),
            dc.DamchaValueError,
            r"Invalid argument `reference`: expected the model's output shape \(1, 2, 8\). Received: reference.shape=\(1, 3, 8\)",
        ),
        (
            lambda m: do.export(dc.init_params(CFG), CFG, 7),
            dc.DamchaTypeError,
            r"Invalid argument `path`: expected a file path or None. Received: path=7",
        ),
        (
            lambda m: do.init_encoder_params(CFG),
            dc.DamchaTypeError,
            r"Invalid argument `config`: expected an EncoderConfig. Received: config=DamchaConfig",
        ),
        (
            lambda m: do.init_token_model_params(do.EncoderConfig(CFG, 1, 4)),
            dc.DamchaTypeError,
            r"Invalid argument `config`: expected a TokenModelConfig. Received: config=EncoderConfig",
        ),
        (
            lambda m: do.init_encoder_params(do.EncoderConfig(CFG, 1, 4), seed="0"),
            dc.DamchaTypeError,
            r"Invalid argument `seed`: expected an int >= 0. Received: seed='0'",
        ),
    ],
    ids=[
        "run-ort-model-type",
        "run-reference-missing-file",
        "inputs-not-mapping",
        "threads-type",
        "threads-zero",
        "quantize-model-type",
        "quantization-error-reference-shape",
        "export-path-type",
        "init-encoder-config",
        "init-token-model-config",
        "init-seed",
    ],
)
def test_helper_errors_name_the_argument(call, error, pattern):
    # Each of these raised a raw TypeError/AttributeError/ValueError (or, for
    # threads='2', was silently int()-ed) instead of naming the argument.
    with pytest.raises(error, match=pattern):
        call(do.export(dc.init_params(CFG), CFG, None))


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_tied_cross_attention_stores_its_generator_once(metric):
    # Tied coupling runs one generator on the query and on the context; the
    # export used to store its weights twice (qk.gen.kernel and qk.gen.kernel_2, ...).
    config = dc.DamchaConfig(
        query_dim=8, num_heads=2, key_dim=4, metric=metric, metric_rank=2 if metric == "lowrank" else None
    )
    params = case_params(config, 6)
    model = do.export(params, config, None, cross=True, dtype="float64")
    stored = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer]
    for key, value in do.fold_params(params, config).items():
        if key.startswith("qk."):
            copies = sum(a.shape == value.shape and np.array_equal(a, value) for a in stored)
            assert copies == 1, (key, copies)
    rng = np.random.default_rng(6)
    x, c = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 5, 8))
    _, ratio = tolerance("float64").output_ratio(
        do.run_ort(model, {"query": x, "context": c}), dc.damcha_attention(params, config, x, c)
    )
    assert ratio <= 1


# ------------------------------------- opset edges and onnxruntime's graph optimisations

#: The highest opset the exporter accepts (the installed onnx's newest): as tested as the lowest.
NEWEST_OPSET = onnx.defs.onnx_opset_version()
ORT_LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")


def _ort_session(model_or_path, level, optimized_path=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.log_severity_level = 3
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    source = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _edge_exports(opset):
    """(name, model, run(session) -> output, expected) for each export kind at ``opset``."""
    rng = np.random.default_rng(opset)
    config = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, num_kv_heads=2, coupling="query")
    params = case_params(config, 2)
    x = rng.normal(size=(2, 6, 16))
    mask = rng.random((2, 1, 6, 6)) < 0.7
    mask[1, 0, 2] = False  # a query with no visible key: output.bias, never NaN
    layer = do.build_model(params, config, opset=opset, causal=True, mask=True)

    step = do.build_model(params, config, opset=opset, causal=True, kv_cache=True)

    def decode(session):
        cache, out = do.empty_kv_cache(step, 2), []
        for a, b in [(0, 3), (3, 4), (4, 6)]:  # a prefill, then smaller steps
            y, key, value = session.run(None, {"query": x[:, a:b].astype(np.float32), **cache})
            cache = {"past_key": key, "past_value": value}
            out.append(y)
        return np.concatenate(out, axis=1)

    enc = dc.EncoderConfig(config, num_layers=2, ffn_dim=24, share_metric=True, causal=True)
    enc_params = dc.init_encoder_params(enc, 4)
    padding = np.ones((2, 6), bool)
    padding[1, 4:] = False
    encoder = do.export_encoder(enc_params, enc, None, opset=opset, mask="padding")
    tm = dc.TokenModelConfig(enc, vocab_size=11, max_len=8, num_classes=3)
    tm_params = dc.init_token_model_params(tm, 5)
    tokens = rng.integers(0, 11, size=(2, 6))
    token_model = do.export_token_model(tm_params, tm, None, opset=opset)
    return [
        (
            "layer",
            layer,
            lambda s: s.run(None, {"query": x.astype(np.float32), "mask": mask})[0],
            dc.damcha_attention(params, config, x, mask=mask, causal=True),
        ),
        ("decode", step, decode, dc.damcha_attention(params, config, x, causal=True)),
        (
            "encoder",
            encoder,
            lambda s: s.run(None, {"query": x.astype(np.float32), "mask": padding})[0],
            dc.encoder_forward(enc_params, enc, x, mask=padding[:, None, None, :]),
        ),
        (
            "token_model",
            token_model,
            lambda s: s.run(None, {"tokens": tokens})[0],
            dc.token_model_forward(tm_params, tm, tokens),
        ),
    ]


@pytest.mark.parametrize("opset", [do.MIN_OPSET, do.ATTENTION_OPSET, NEWEST_OPSET], ids=lambda o: f"opset{o}")
def test_every_export_kind_at_the_opset_edges_under_every_ort_optimisation_level(tmp_path, opset):
    # Users pick a level (ORT_DISABLE_ALL to debug, ORT_ENABLE_ALL in production) and save the
    # optimised graph (SessionOptions.optimized_model_filepath) to skip optimising at each load:
    # every level gives the reference's outputs, and the saved graph loads and runs again.
    for name, model, run, expected in _edge_exports(opset):
        assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {opset}
        outputs = {}
        for level in ORT_LEVELS:
            saved = tmp_path / f"{name}.{level}.onnx" if level != "ORT_DISABLE_ALL" else None
            outputs[level] = run(_ort_session(model, level, saved))
            assert np.isfinite(outputs[level]).all(), (name, level)
            _, ratio = tolerance("float32").output_ratio(outputs[level], expected)
            assert ratio <= 1, (name, level, ratio)
            if saved is not None:
                again = run(_ort_session(saved, "ORT_DISABLE_ALL"))
                np.testing.assert_allclose(again, outputs[level], rtol=1e-5, atol=1e-6, err_msg=f"{name} {level}")
        for level in ORT_LEVELS[1:]:  # fusions may reorder float32 sums, nothing more
            np.testing.assert_allclose(outputs[level], outputs["ORT_DISABLE_ALL"], rtol=1e-4, atol=1e-5)


def _initialisers(model: onnx.ModelProto) -> dict[str, tuple[str, bytes]]:
    return {t.name: (str(onnx.numpy_helper.to_array(t).dtype), t.raw_data) for t in model.graph.initializer}


@pytest.mark.parametrize("graph_dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize(
    "param_dtype", ["float64", "float32", "float16", ">f4", "bfloat16", "longdouble", "fortran-float32"]
)
@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_weights_cast_from_the_callers_dtype_equal_those_cast_from_float64(metric, param_dtype, graph_dtype):
    # The exporter casts the weights it does not fold straight from the caller's arrays (no float64
    # copy of the layer); the graph must hold the very bytes that casting validate_params' float64
    # copies gives.
    import ml_dtypes

    config = dc.DamchaConfig(
        query_dim=8, num_heads=2, key_dim=4, metric=metric, metric_rank=2 if metric == "lowrank" else None
    )
    rng = np.random.default_rng(3)
    base = {k: v + 0.37 * rng.standard_normal(v.shape) for k, v in dc.init_params(config, 2).items()}
    if param_dtype == "fortran-float32":
        params = {k: np.asfortranarray(v.astype(np.float32)) for k, v in base.items()}
    elif param_dtype == "bfloat16":
        params = {k: v.astype(ml_dtypes.bfloat16) for k, v in base.items()}
    elif param_dtype == "longdouble":
        # Past float64's precision, just above a float32 tie: cast straight to float32 such a value
        # rounds up, through float64 (where it is the tie) to even; it must be rounded as validate_params does.
        params = {}
        for k, v in base.items():
            v32 = v.astype(np.float32).astype(np.longdouble)
            half = np.spacing(np.abs(v.astype(np.float32))).astype(np.longdouble) / 2
            params[k] = v32 + half + half * np.longdouble(2.0) ** -30
    else:
        params = {k: v.astype(param_dtype) for k, v in base.items()}
    direct = do.build_model(params, config, dtype=graph_dtype)
    via_float64 = do.build_model(dc.validate_params(params, config), config, dtype=graph_dtype)
    assert _initialisers(direct) == _initialisers(via_float64)


def test_a_value_is_read_once_by_the_exporter():
    # A lazy array that answers a second read differently must not get past the finiteness check.
    class Lazy:
        def __init__(self, value):
            self.value, self.reads, self.shape, self.dtype = value, 0, value.shape, value.dtype

        def __array__(self, dtype=None, copy=None):
            self.reads += 1
            out = self.value if self.reads == 1 else np.full_like(self.value, np.nan)
            return out if dtype is None else out.astype(dtype)

    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = dc.init_params(config, 1)
    params["key.kernel"] = Lazy(params["key.kernel"])
    model = do.build_model(params, config, dtype="float64")
    assert all(np.isfinite(onnx.numpy_helper.to_array(t)).all() for t in model.graph.initializer)


@pytest.mark.parametrize("kind", ["encoder", "token_model"])
def test_stack_weights_cast_from_float32_equal_those_cast_from_float64(kind):
    attn = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, metric="lowrank", metric_rank=2)
    encoder = do.EncoderConfig(attn, num_layers=2, ffn_dim=12, share_metric=True)
    rng = np.random.default_rng(8)
    if kind == "encoder":
        config, base = encoder, do.init_encoder_params(encoder, 3)
        build = do.export_encoder
    else:
        config = do.TokenModelConfig(encoder, vocab_size=11, max_len=9, num_classes=3)
        base, build = do.init_token_model_params(config, 3), do.export_token_model
    params = {k: (v + 0.37 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
    for dtype in ("float64", "float32", "float16"):
        direct = build(params, config, None, dtype=dtype)
        via_float64 = build(dc.validate_stack_params(params, config), config, None, dtype=dtype)
        assert _initialisers(direct) == _initialisers(via_float64), dtype
