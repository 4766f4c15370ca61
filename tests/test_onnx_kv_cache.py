"""Incremental decoding (key/value cache) in the ONNX exports.

A ``kv_cache=True`` export is one decode step; feeding a sequence through it
token by token, or in chunks, must give the full causal forward of the NumPy
reference (query i of a step sees keys j <= P + i, bottom-right), in
onnxruntime and in onnx.reference.ReferenceEvaluator, for the decomposed form
(opset 17) and the Attention op (opsets 23, 24). The cache itself must hold
what damcha_torch.DamchaKVCache holds: k~ = L_k(c) k in spec units.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import damcha_core as dc
import damcha_onnx as do
from damcha_conformance import case_params, tolerance

OPSETS = [17, 23, 24]
RUNTIMES = ["onnxruntime", "reference"]
DTYPES = ["float32", "float64"]

CONFIGS = {
    "heads-tied": dict(query_dim=8, num_heads=2, key_dim=4),
    "lowrank-separate": dict(query_dim=8, num_heads=2, key_dim=4, metric="lowrank", metric_rank=2, coupling="separate"),
    # GQA, and d_v != d so a swapped key/value layout cannot pass.
    "heads-query-gqa": dict(query_dim=8, num_heads=4, num_kv_heads=2, key_dim=3, value_dim=5, coupling="query"),
}

B, N = 2, 6
SCHEDULES = {"tokenwise": (1,) * N, "chunks-3-1-2": (3, 1, 2), "prefill": (N,)}


def _ids(name: str) -> Callable[[object], str]:
    return lambda value: f"{name}{value}"


def _runner(model: onnx.ModelProto, runtime: str) -> Callable[[dict], dict[str, np.ndarray]]:
    """All outputs of one step by name; the session/evaluator is built once per model."""
    if runtime == "onnxruntime":
        session = do.ort_session(model)
        return lambda feeds: do.run_ort(model, feeds, session=session, all_outputs=True)
    evaluator = ReferenceEvaluator(model)
    return lambda feeds: do.run_reference(model, feeds, evaluator=evaluator, all_outputs=True)


def _decode(
    model: onnx.ModelProto,
    runtime: str,
    inputs: np.ndarray,
    chunks: Sequence[int],
    mask: np.ndarray | None = None,
    input_name: str = "query",
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Feed ``inputs`` (B, N, ...) step by step from an empty cache.

    Returns the first output over the whole sequence and the last step's
    outputs. ``mask`` is the full (B|1, H|1, N, N) mask; each step gets its
    rows and the P + n keys it can reach.
    """
    run = _runner(model, runtime)
    first = model.graph.output[0].name
    cache = do.empty_kv_cache(model, inputs.shape[0])
    outs, start, step = [], 0, {}
    for n in chunks:
        stop = start + n
        feeds = {input_name: inputs[:, start:stop], **cache}
        if mask is not None:
            feeds["mask"] = mask[:, :, start:stop, :stop]
        step = run(feeds)
        outs.append(step[first])
        cache = {name.replace("present_", "past_"): v for name, v in step.items() if name.startswith("present_")}
        start = stop
    assert start == inputs.shape[1]
    return np.concatenate(outs, axis=1), step


def _assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    err, ratio = tolerance(dtype).output_ratio(actual, expected)
    assert ratio <= 1, f"max |error| {err:.3g} is {ratio:.3g} x the {dtype} tolerance"


# ------------------------------------------------------------------ one layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("opset", OPSETS, ids=_ids("opset"))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_matches_full_causal_forward(name, opset, runtime, dtype):
    config = dc.DamchaConfig(**CONFIGS[name])
    params = case_params(config, 3)
    x = np.random.default_rng(0).normal(size=(B, N, config.query_dim))
    expected = dc.damcha_attention(params, config, x, causal=True)
    model = do.export(params, config, None, opset=opset, causal=True, kv_cache=True, dtype=dtype)
    for schedule, chunks in SCHEDULES.items():
        out, last = _decode(model, runtime, x, chunks)
        err, ratio = tolerance(dtype).output_ratio(out, expected)
        assert ratio <= 1, (schedule, err, ratio)
        G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
        assert last["present_key"].shape == (B, G, N, d) and last["present_value"].shape == (B, G, N, d_v), schedule


@pytest.mark.parametrize("opset", OPSETS, ids=_ids("opset"))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_present_cache_equals_torch_kv_cache(name, opset):
    # The cache's layout and units: what damcha_torch's DamchaKVCache holds
    # after the same tokens (k~ = L_k(c) k, no softmax scale folded in).
    import torch

    import damcha_torch

    config = dc.DamchaConfig(**CONFIGS[name])
    params = case_params(config, 4)
    x = np.random.default_rng(1).normal(size=(B, N, config.query_dim))
    model = do.export(params, config, None, opset=opset, causal=True, kv_cache=True, dtype="float64")
    _, last = _decode(model, "onnxruntime", x, SCHEDULES["chunks-3-1-2"])

    layer = damcha_torch.DamchaAttention.from_canonical(params, config, batch_first=True, dtype=torch.float64).eval()
    cache, start = damcha_torch.DamchaKVCache(), 0
    with torch.no_grad():
        for n in SCHEDULES["chunks-3-1-2"]:
            chunk = torch.from_numpy(x[:, start : start + n])
            layer(chunk, chunk, chunk, is_causal=True, need_weights=False, kv_cache=cache)
            start += n
    _assert_close(last["present_key"], cache.key.numpy(), "float64")
    _assert_close(last["present_value"], cache.value.numpy(), "float64")


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("opset", OPSETS, ids=_ids("opset"))
def test_user_mask_with_a_hidden_row_gives_output_bias(opset, runtime):
    config = dc.DamchaConfig(**CONFIGS["heads-query-gqa"])
    params = case_params(config, 5)
    H = config.num_heads
    x = np.random.default_rng(2).normal(size=(B, N, config.query_dim))
    mask = np.ones((B, H, N, N), dtype=bool)
    mask[0, :, 2, :] = False  # row 2 hides every key (prefill chunk, no past)
    mask[1, :, 4, :] = False
    mask[1, :, 4, 5] = True  # row 4 only allows a future key: empty once causal applies (P = 4 in its step)
    mask[1, 0, 1, :] = False  # one head of one row
    expected = dc.damcha_attention(params, config, x, mask=mask, causal=True)
    np.testing.assert_allclose(expected[0, 2], params["output.bias"], rtol=0, atol=1e-12)
    model = do.export(params, config, None, opset=opset, causal=True, kv_cache=True, mask=True, dtype="float64")
    for schedule, chunks in SCHEDULES.items():
        out, _ = _decode(model, runtime, x, chunks, mask=mask)
        assert np.all(np.isfinite(out)), schedule
        np.testing.assert_allclose(out[0, 2], params["output.bias"], rtol=0, atol=1e-12, err_msg=schedule)
        np.testing.assert_allclose(out[1, 4], params["output.bias"], rtol=0, atol=1e-12, err_msg=schedule)
        _assert_close(out, expected, "float64")


@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("opset", OPSETS, ids=_ids("opset"))
def test_io_names_layouts_and_ops(opset, mask):
    config = dc.DamchaConfig(**CONFIGS["heads-query-gqa"])
    model = do.export(case_params(config, 6), config, None, opset=opset, causal=True, kv_cache=True, mask=mask)

    def dims(values):
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}

    expected_in = {
        "query": ["batch", "query_len", 8],
        "past_key": ["batch", 2, "past_len", 3],
        "past_value": ["batch", 2, "past_len", 5],
    }
    if mask:
        expected_in["mask"] = ["mask_batch", "mask_heads", "mask_query", "total_len"]
    assert dims(model.graph.input) == expected_in
    assert dims(model.graph.output) == {
        "output": ["batch", "query_len", 8],
        "present_key": ["batch", 2, "total_len", 3],
        "present_value": ["batch", 2, "total_len", 5],
    }
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    if opset >= 23:
        # The standard op carries the cache and its own (bottom-right) causal
        # rule: without a user mask no explicit causal mask is built.
        (node,) = attention
        assert list(node.input[4:]) == ["past_key", "past_value"]
        assert list(node.output[1:]) == ["present_key", "present_value"]
        assert {a.name: a.i for a in node.attribute}["is_causal"] == 1
        assert (node.input[3] != "") == mask
        if not mask:
            assert "Range" not in {n.op_type for n in model.graph.node}
    else:
        assert not attention
        concat_outputs = {o for n in model.graph.node if n.op_type == "Concat" for o in n.output}
        assert {"present_key", "present_value"} <= concat_outputs


@pytest.mark.parametrize("opset", [17, 23], ids=_ids("opset"))
def test_static_single_token_step(opset):
    # The common deployment: B and n = 1 fixed, the cache length free.
    config = dc.DamchaConfig(**CONFIGS["lowrank-separate"])
    params = case_params(config, 7)
    model = do.export(
        params, config, None, opset=opset, causal=True, kv_cache=True, dynamic=False, batch_size=B, query_len=1
    )
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [B, 1, 8]
    x = np.random.default_rng(3).normal(size=(B, N, 8))
    out, _ = _decode(model, "onnxruntime", x, SCHEDULES["tokenwise"])
    _assert_close(out, dc.damcha_attention(params, config, x, causal=True), "float32")


# ------------------------------------------------------------------ stacks

ENCODERS = {
    "heads-tied-shared": (dict(query_dim=16, num_heads=4, key_dim=4), True),
    "lowrank-separate-gqa-unshared": (
        dict(
            query_dim=16, num_heads=4, num_kv_heads=2, key_dim=4, metric="lowrank", metric_rank=3, coupling="separate"
        ),
        False,
    ),
}


def _open_gates(params: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    # Fresh stacks have gates at 0 (plain MHA); open them so the metric matters.
    rng = np.random.default_rng(seed)
    return {k: rng.uniform(-1.0, 1.0, v.shape) if k.endswith(".gate") else v for k, v in params.items()}


def _encoder(name: str, causal: bool = True) -> do.EncoderConfig:
    attn, share = ENCODERS[name]
    return do.EncoderConfig(dc.DamchaConfig(**attn), num_layers=2, ffn_dim=24, share_metric=share, causal=causal)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("opset", OPSETS, ids=_ids("opset"))
@pytest.mark.parametrize("name", list(ENCODERS))
def test_encoder_decode_matches_full_forward(name, opset, runtime):
    config = _encoder(name)
    params = _open_gates(do.init_encoder_params(config, 1), 1)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, N, config.width))
    mask = rng.random((B, 1, N, N)) < 0.8
    model = do.export_encoder(params, config, None, opset=opset, mask=True, kv_cache=True)
    assert [i.name for i in model.graph.input] == [
        "query",
        "past_key.0",
        "past_value.0",
        "past_key.1",
        "past_value.1",
        "mask",
    ]
    assert [o.name for o in model.graph.output] == [
        "output",
        "present_key.0",
        "present_value.0",
        "present_key.1",
        "present_value.1",
    ]
    expected = do.encoder_forward(params, config, x, mask=mask)
    for schedule in ("tokenwise", "chunks-3-1-2"):
        out, last = _decode(model, runtime, x, SCHEDULES[schedule], mask=mask)
        err, ratio = tolerance("float32").output_ratio(out, expected)
        assert ratio <= 1, (schedule, err, ratio)
        assert last["present_value.1"].shape == (B, config.attention.num_kv_heads, N, config.attention.value_dim)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("opset", OPSETS, ids=_ids("opset"))
def test_token_model_decode_matches_full_forward(opset, runtime):
    # Positions must continue at P: the logits of a token decoded after P
    # others equal those of the full sequence.
    config = do.TokenModelConfig(_encoder("lowrank-separate-gqa-unshared"), vocab_size=13, max_len=N, num_classes=3)
    params = _open_gates(do.init_token_model_params(config, 2), 2)
    tokens = np.random.default_rng(5).integers(0, 13, size=(B, N))
    model = do.export_token_model(params, config, None, opset=opset, kv_cache=True)
    assert [i.name for i in model.graph.input] == ["tokens", "past_key.0", "past_value.0", "past_key.1", "past_value.1"]
    expected = do.token_model_forward(params, config, tokens)
    for schedule in ("tokenwise", "chunks-3-1-2"):
        out, _ = _decode(model, runtime, tokens, SCHEDULES[schedule], input_name="tokens")
        err, ratio = tolerance("float32").output_ratio(out, expected)
        assert ratio <= 1, (schedule, err, ratio)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("opset", OPSETS, ids=_ids("opset"))
def test_decode_of_an_empty_batch_matches_the_reference(opset, runtime):
    """empty_kv_cache refused batch_size=0 although run_ort/run_reference give an empty batch its
    empty outputs (empty_outputs) and every port's cache takes B = 0: a caller decoding a batch
    that happens to be empty had to special-case it. Now the empty batch decodes step by step
    like any other, each output of the reference's shape (0, N, ...) and dtype, the cache
    growing (0, G, P, d)."""
    config = dc.DamchaConfig(**CONFIGS["heads-query-gqa"])
    params = case_params(config, 3)
    x = np.zeros((0, N, config.query_dim))
    expected = dc.damcha_attention(params, config, x, causal=True)
    model = do.export(params, config, None, opset=opset, causal=True, kv_cache=True)
    cache = do.empty_kv_cache(model, 0)
    G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
    assert {k: v.shape for k, v in cache.items()} == {"past_key": (0, G, 0, d), "past_value": (0, G, 0, d_v)}
    out, last = _decode(model, runtime, x, SCHEDULES["chunks-3-1-2"])
    assert out.shape == expected.shape == (0, N, config.query_dim) and out.dtype == np.float32
    assert last["present_key"].shape == (0, G, N, d) and last["present_value"].shape == (0, G, N, d_v)

    tm = do.TokenModelConfig(_encoder("lowrank-separate-gqa-unshared"), vocab_size=13, max_len=N, num_classes=3)
    tm_params = do.init_token_model_params(tm, 2)
    tokens = np.zeros((0, N), np.int64)
    model = do.export_token_model(tm_params, tm, None, opset=opset, kv_cache=True)
    out, _ = _decode(model, runtime, tokens, SCHEDULES["tokenwise"], input_name="tokens")
    assert out.shape == do.token_model_forward(tm_params, tm, tokens).shape


def test_token_model_decode_past_max_len_fails():
    config = do.TokenModelConfig(_encoder("heads-tied-shared"), vocab_size=13, max_len=4, num_classes=3)
    model = do.export_token_model(do.init_token_model_params(config, 3), config, None, kv_cache=True)
    session = do.ort_session(model)
    tokens = np.random.default_rng(6).integers(0, 13, size=(1, 5))
    cache = do.empty_kv_cache(model, 1)
    step = do.run_ort(model, {"tokens": tokens[:, :3], **cache}, session=session, all_outputs=True)
    cache = {k.replace("present_", "past_"): v for k, v in step.items() if k.startswith("present_")}
    # Positions 3, 4 of max_len 4, and 4 alone: a clamped position table would
    # be 1 or 0 rows and broadcast silently, so each must raise.
    # The graph refuses (raw onnxruntime users), and run_ort says why before running it.
    with pytest.raises(Exception, match="ONNXRuntimeError"):
        session.run(None, {"tokens": tokens[:, 3:], **cache})
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `tokens`: expected positions within the position table \(max_len=4\); they reach 4.*after 3 cached",
    ):
        do.run_ort(model, {"tokens": tokens[:, 3:], **cache}, session=session)
    step = do.run_ort(model, {"tokens": tokens[:, 3:4], **cache}, session=session, all_outputs=True)
    cache = {k.replace("present_", "past_"): v for k, v in step.items() if k.startswith("present_")}
    with pytest.raises(Exception, match="ONNXRuntimeError"):
        session.run(None, {"tokens": tokens[:, 4:], **cache})
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `tokens`: .*they reach 4"):
        do.run_ort(model, {"tokens": tokens[:, 4:], **cache}, session=session)


# ------------------------------------------------------------------ errors

CFG = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
CROSS_CFG = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, context_dim=6, coupling="query")


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (
            lambda: do.export(dc.init_params(CFG), CFG, None, kv_cache=True),
            dc.DamchaValueError,
            r"Invalid argument `kv_cache`: expected False unless causal=True.*Received: kv_cache=True, causal=False",
        ),
        (
            lambda: do.build_model(dc.init_params(CFG), CFG, kv_cache=True),
            dc.DamchaValueError,
            r"Invalid argument `kv_cache`: .*Received: kv_cache=True, causal=False",
        ),
        (
            lambda: do.export(dc.init_params(CROSS_CFG), CROSS_CFG, None, causal=True, cross=True, kv_cache=True),
            dc.DamchaValueError,
            r"Invalid argument `kv_cache`: .*self-attention.*Received: kv_cache=True, cross=True",
        ),
        (
            lambda: do.export(dc.init_params(CFG), CFG, None, causal=True, kv_cache=1),
            dc.DamchaTypeError,
            r"Invalid argument `kv_cache`: expected a bool. Received: kv_cache=1",
        ),
        (
            lambda: do.export_encoder(
                do.init_encoder_params(_encoder("heads-tied-shared", False)),
                _encoder("heads-tied-shared", False),
                None,
                kv_cache=True,
            ),
            dc.DamchaValueError,
            r"Invalid argument `kv_cache`: expected False unless config.causal=True.*Received: kv_cache=True, config.causal=False",
        ),
        (
            lambda: do.export_token_model(
                do.init_token_model_params(do.TokenModelConfig(_encoder("heads-tied-shared", False), 5, 4, 2)),
                do.TokenModelConfig(_encoder("heads-tied-shared", False), 5, 4, 2),
                None,
                kv_cache=True,
            ),
            dc.DamchaValueError,
            r"Received: kv_cache=True, config.causal=False",
        ),
        (
            lambda: do.empty_kv_cache(do.export(dc.init_params(CFG), CFG, None), 1),
            dc.DamchaValueError,
            r"Invalid argument `model`: expected a model with past_key/past_value inputs.*Received: model with inputs \['query'\]",
        ),
        (
            lambda: do.empty_kv_cache(do.export(dc.init_params(CFG), CFG, None, causal=True, kv_cache=True), -1),
            dc.DamchaValueError,
            r"Invalid argument `batch_size`: expected an int >= 0. Received: batch_size=-1",
        ),
        (
            # A float is a type error here as for every other int argument (it was a DamchaValueError).
            lambda: do.empty_kv_cache(do.export(dc.init_params(CFG), CFG, None, causal=True, kv_cache=True), 1.5),
            dc.DamchaTypeError,
            r"Invalid argument `batch_size`: expected an int >= 0. Received: batch_size=1.5",
        ),
    ],
    ids=[
        "layer-not-causal",
        "build-model-not-causal",
        "layer-cross",
        "layer-flag-type",
        "encoder-not-causal",
        "token-model-not-causal",
        "empty-cache-no-cache-inputs",
        "empty-cache-batch",
        "empty-cache-batch-float",
    ],
)
def test_kv_cache_errors(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


# ------------------------------------------------------------------ CLI


@pytest.fixture()
def saved_params(tmp_path):
    params = case_params(CFG, 8)
    path = tmp_path / "p.safetensors"
    dc.save_params(path, params, CFG)
    return str(path)


@pytest.mark.parametrize("opset", [17, 23], ids=_ids("opset"))
def test_cli_kv_cache_exports_and_validates_by_decoding(saved_params, tmp_path, capsys, opset):
    from damcha_onnx._cli import main

    out = tmp_path / "m.onnx"
    rc = main(["--params", saved_params, "--out", str(out), "--opset", str(opset), "--causal", "--kv-cache", "--mask"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.count("decoded in chunks") == 2 and text.count("-> ok") == 2
    model = onnx.load(out)
    assert [o.name for o in model.graph.output] == ["output", "present_key", "present_value"]


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--kv-cache"], "--kv-cache: needs --causal"),
        (["--kv-cache", "--causal", "--cross"], "--kv-cache: cannot be combined with --cross"),
    ],
    ids=["no-causal", "cross"],
)
def test_cli_kv_cache_bad_flags(saved_params, tmp_path, capsys, flags, pattern):
    from damcha_onnx._cli import main

    rc = main(["--params", saved_params, "--out", str(tmp_path / "m.onnx"), *flags])
    assert rc == 2 and pattern in capsys.readouterr().err
