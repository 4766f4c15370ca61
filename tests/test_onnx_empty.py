"""Empty shapes and the exported ONNX models. onnxruntime cannot run an empty
batch or no query (its Attention kernel needs batch and query length >= 1, the
decomposed graph's Reshape cannot infer a dim of an empty tensor), so
``run_ort`` and ``run_reference`` return the empty outputs themselves, of the
declared shapes and dtypes, as the reference and the framework ports do;
queries over no key are refused naming the input, never an onnxruntime error."""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest

import damcha_core as dc
import damcha_onnx as do

CROSS = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, context_dim=6, coupling="separate", output_dim=5)
SELF = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)

# (config, B, N, M, opset): the exported graph's symbolic dims given a size 0.
EMPTY = {
    "B0-cross-opset23": (CROSS, 0, 3, 5, 23),
    "N0-cross-opset23": (CROSS, 2, 0, 5, 23),
    "B0-N0-cross-opset23": (CROSS, 0, 0, 5, 23),
    "B0-self-opset23": (SELF, 0, 4, None, 23),
    "N0-self-opset23": (SELF, 2, 0, None, 23),
    "B0-cross-decomposed": (CROSS, 0, 3, 5, 17),
    "N0-self-decomposed": (SELF, 2, 0, None, 17),
}


def _model_and_feeds(config, B, N, M, opset, **kw):
    model = do.export(
        dc.init_params(config, 0), config, None, opset=opset, cross=M is not None, mask=True, return_weights=True, **kw
    )
    feeds = {"query": np.zeros((B, N, 8), np.float32), "mask": np.ones((B, 1, N, N if M is None else M), bool)}
    if M is not None:
        feeds["context"] = np.zeros((B, M, 6), np.float32)
    return model, feeds


@pytest.mark.parametrize("runner", ["run_ort", "run_reference"])
@pytest.mark.parametrize("case", list(EMPTY.values()), ids=list(EMPTY))
def test_runtime_helpers_return_the_empty_outputs(case, runner) -> None:
    config, B, N, M, opset = case
    model, feeds = _model_and_feeds(*case)
    out = getattr(do, runner)(model, feeds, all_outputs=True)
    y, w = dc.damcha_attention(
        dc.init_params(config, 0), config, feeds["query"], feeds.get("context"), mask=feeds["mask"], return_weights=True
    )
    assert (out["output"].shape, out["output"].dtype) == (y.shape, np.float32)
    assert (out["weights"].shape, out["weights"].dtype) == (w.shape, np.float32)


@pytest.mark.parametrize("B", [0, 2], ids=["B0", "B2"])
def test_decode_step_with_no_token_returns_the_cache_as_it_was(B) -> None:
    model = do.export(dc.init_params(SELF, 0), SELF, None, kv_cache=True, causal=True)
    rng = np.random.default_rng(0)
    past = {"past_key": rng.normal(size=(B, 2, 3, 4)), "past_value": rng.normal(size=(B, 2, 3, 4))}
    out = do.run_ort(model, {"query": np.zeros((B, 0, 8), np.float32), **past}, all_outputs=True)
    assert out["output"].shape == (B, 0, 8)
    for name in ("key", "value"):
        np.testing.assert_array_equal(out[f"present_{name}"], past[f"past_{name}"].astype(np.float32))
    # An empty batch's first step: every output empty.
    first = do.run_ort(
        model,
        {
            "query": np.zeros((0, 2, 8), np.float32),
            "past_key": np.zeros((0, 2, 0, 4), np.float32),
            "past_value": np.zeros((0, 2, 0, 4), np.float32),
        },
        all_outputs=True,
    )
    assert {k: v.shape for k, v in first.items()} == {
        "output": (0, 2, 8),
        "present_key": (0, 2, 2, 4),
        "present_value": (0, 2, 2, 4),
    }


@pytest.mark.parametrize(
    "case",
    [EMPTY["B0-cross-opset23"], EMPTY["N0-cross-opset23"], EMPTY["B0-cross-decomposed"]],
    ids=["B0-opset23", "N0-opset23", "B0-decomposed"],
)
def test_onnxruntime_itself_fails_on_empty_feeds(case) -> None:
    """Why the helpers do not run them: a raw session fails inside a node.
    (Should a later onnxruntime run these, this test fails: the helpers can
    then hand them to onnxruntime.)"""
    model, feeds = _model_and_feeds(*case)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=r"Attention|Reshape|batch|sequence"):
        session.run(None, feeds)


@pytest.mark.parametrize("B", [2, 0], ids=["B2", "B0"])
def test_queries_over_no_key_are_refused_naming_context(B) -> None:
    model, feeds = _model_and_feeds(CROSS, B, 3, 0, 23)
    pattern = rf"^Invalid argument `context`: expected at least one key \(M >= 1\).*Received: context.shape={re.escape(str((B, 0, 6)))}$"
    for runner in (do.run_ort, do.run_reference):
        with pytest.raises(dc.DamchaValueError, match=pattern):
            runner(model, feeds)
