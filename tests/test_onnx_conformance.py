"""The conformance catalogue on damcha_onnx exports in onnxruntime, one test
per opset and check (forward, decode, bad input) and dtype, so a failure names
its case (``-k "opset17 and float16"`` selects). Opsets 17 and 18 export the
decomposed MatMul/Softmax graph, 23 and 24 the standard ``Attention`` op. ONNX
graphs carry no autodiff and compute no training loss: outputs and attention
weights (``return_weights=True`` exports), no gradients and no metric penalty."""

from __future__ import annotations

import pytest

from damcha_conformance import CATALOGUE, WEIGHTS_CASES
from damcha_conformance.adapters import BUILTIN, OnnxAdapter
from damcha_conformance.pytest_plugin import assert_check, checks

OPSETS = (17, 18, 23, 24)
DTYPES = ("float32", "float64", "float16")
PLAN = [(opset, check) for opset in OPSETS for check in checks(DTYPES, gradients=False, penalty=False)]


def test_adapter_declares_its_dtypes():
    adapter = OnnxAdapter()
    assert tuple(adapter.dtypes) == DTYPES == BUILTIN["onnxruntime"].dtypes
    assert not adapter.supports_gradients and callable(adapter.decode) and callable(adapter.weights)
    # No penalty: an inference graph has no training loss, which `damcha conform` states as a limit.
    assert not hasattr(adapter, "metric_penalty") and set(BUILTIN["onnxruntime"].limits) == {"gradients", "penalty"}


@pytest.fixture(scope="module")
def adapters():
    return {opset: OnnxAdapter(opset=opset) for opset in OPSETS}


@pytest.mark.parametrize(("opset", "check"), PLAN, ids=[f"opset{o}-{c.id}" for o, c in PLAN])
def test_conformance(opset, check, adapters):
    assert_check(adapters[opset], check)  # unsupported fails too: the exporter claims every case


def test_the_plan_covers_every_case_in_every_dtype_and_opset():
    ids = {(opset, check.id) for opset, check in PLAN}
    for opset in OPSETS:
        for dtype in DTYPES:
            for case in CATALOGUE:
                # The large-activation cases run in float16 only (their Case.dtypes).
                assert ((opset, f"forward-{dtype}-{case.name}") in ids) == case.runs_in(dtype)
            for case in WEIGHTS_CASES:
                assert (opset, f"weights-{dtype}-{case.name}") in ids
    assert any(case.dtypes == ("float16",) for case in CATALOGUE)
