"""The ONNX adapter: ``damcha_onnx`` exports run in onnxruntime (forward only)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from damcha_core import DamchaValueError, invalid_argument
from damcha_onnx import ATTENTION_OPSET, build_model, check_opset, empty_kv_cache, run_ort, run_reference

from .._cases import Case, CaseData

RUNTIMES = ("onnxruntime", "reference")


class OnnxAdapter:
    """Exports each catalogue case and runs it in onnxruntime's CPU provider.

    Args:
        opset: export opset; the default 23 uses the standard ``Attention``
            op, 17-22 the decomposed MatMul/Softmax graph.
        runtime: "onnxruntime" (default) or "reference"
            (``onnx.reference.ReferenceEvaluator``; slow, a cross-check).

    ONNX graphs carry no autodiff, so only outputs are checked (and the
    attention weights, a ``return_weights=True`` export's ``weights`` output;
    an inference graph computes no metric penalty: ``damcha conform`` states
    both limits). float32,
    float64 and float16 graphs are exported: the softmax scale is folded into
    the query weights in float64, so no float32 attribute limits float64
    accuracy; float16 graphs accumulate the RMS statistic and the softmax in
    float32. (bfloat16 is not exported: onnxruntime's CPU provider has no
    bfloat16 kernels.)
    """

    supports_gradients = False
    dtypes: Sequence[str] = ("float32", "float64", "float16")

    def __init__(self, opset: int = ATTENTION_OPSET, runtime: str = "onnxruntime") -> None:
        self.opset, self.form = check_opset(opset)
        if runtime not in RUNTIMES:
            raise DamchaValueError(invalid_argument("runtime", f"one of {RUNTIMES}", f"runtime={runtime!r}"))
        self.runtime = runtime
        base = "onnxruntime" if runtime == "onnxruntime" else "onnx-reference"
        self.name = base if opset == ATTENTION_OPSET else f"{base}-opset{opset}"

    def unsupported(self, case: Case) -> str | None:
        if self.runtime == "reference" and max(case.query_len, case.context_len or 0) > 64:
            return "ReferenceEvaluator is pure Python; long cases are left to onnxruntime"
        return None  # every catalogue case (masks, causal, GQA/MQA, cross) is expressible

    def _outputs(self, data: CaseData, dtype: str, weights: bool) -> dict[str, np.ndarray]:
        cross = data.context is not None
        model = build_model(
            data.params,
            data.config,
            opset=self.opset,
            causal=data.causal,
            cross=cross,
            mask=data.mask is not None,
            dtype=dtype,
            return_weights=weights,
        )
        inputs = {"query": data.query}
        if data.context is not None:
            inputs["context"] = data.context
        if data.value is not None:
            inputs["value"] = data.value  # value tokens of their own size (E_v != E_kv): a third input
        if data.mask is not None:
            inputs["mask"] = data.mask
        run = run_ort if self.runtime == "onnxruntime" else run_reference
        outputs = run(model, inputs, all_outputs=True)
        assert isinstance(outputs, dict)  # every output by name when all_outputs
        return outputs

    def forward(self, data: CaseData, dtype: str) -> np.ndarray:
        return self._outputs(data, dtype, weights=False)["output"]

    def weights(self, data: CaseData, dtype: str) -> np.ndarray:
        """The ``weights`` output (B, H, N, M) of a ``return_weights=True`` export."""
        return self._outputs(data, dtype, weights=True)["weights"]

    def decode(self, data: CaseData, dtype: str) -> np.ndarray:
        """``data.case.steps`` through a ``kv_cache=True`` export from an empty
        cache, feeding each step's present_* back as past_*; every step's outputs."""
        model = build_model(data.params, data.config, opset=self.opset, causal=True, kv_cache=True, dtype=dtype)
        run = run_ort if self.runtime == "onnxruntime" else run_reference
        x = data.query
        cache, outs = empty_kv_cache(model, x.shape[0]), []
        for start, stop in data.case.steps:
            step = run(model, {"query": x[:, start:stop], **cache}, all_outputs=True)
            cache = {"past_key": step["present_key"], "past_value": step["present_value"]}
            outs.append(step["output"])
        return np.concatenate(outs, axis=1)

    def gradients(self, data: CaseData, dtype: str) -> dict[str, np.ndarray]:
        raise NotImplementedError("exported ONNX inference graphs have no gradients")
