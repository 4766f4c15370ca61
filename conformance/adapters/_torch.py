"""The PyTorch adapter: runs catalogue cases through ``damcha_torch.DamchaAttention``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from damcha_torch import DamchaAttention, DamchaKVCache

if TYPE_CHECKING:  # pragma: no cover
    from .._cases import Case, CaseData

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


class TorchAdapter:
    """``damcha_conformance.BackendAdapter`` for PyTorch.

    Each case builds ``DamchaAttention.from_canonical`` (batch_first) on
    ``device`` in the asked dtype and takes the fused path
    (``need_weights=False``); the catalogue's True = may-attend masks are
    inverted to torch's True = masked-out ``attn_mask`` at this boundary.
    ``weights`` takes the explicit path (``need_weights=True``,
    ``average_attn_weights=False``: one map per head); ``metric_penalty`` is
    the layer's ``metric_penalty(query, key)``.
    """

    name = "torch"
    dtypes: Sequence[str] = ("float64", "float32", "bfloat16")
    supports_gradients = True

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu":
            self.name = f"torch-{self.device.type}"  # the report says where it ran

    def unsupported(self, case: Case) -> str | None:
        return None

    def _layer_inputs(self, data: CaseData, dtype: str, grad: bool):
        tdtype = _DTYPES[dtype]
        layer = DamchaAttention.from_canonical(
            data.params, data.config, batch_first=True, device=self.device, dtype=tdtype
        )
        layer.eval()  # conformance is the inference function: no dropout

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, tdtype).requires_grad_(grad)

        inputs = {"query": tensor(data.query)}
        if data.context is not None:
            inputs["context"] = tensor(data.context)
        if data.value is not None:  # vdim != kdim
            inputs["value"] = tensor(data.value)
        return layer, inputs

    def _run(self, data: CaseData, dtype: str, grad: bool, need_weights: bool = False):
        layer, inputs = self._layer_inputs(data, dtype, grad)
        key = inputs.get("context", inputs["query"])
        mask = None if data.mask is None else ~torch.from_numpy(data.mask).to(self.device)
        out, weights = layer(
            inputs["query"],
            key,
            inputs.get("value", key),
            attn_mask=mask,
            need_weights=need_weights,
            average_attn_weights=False,
            is_causal=data.causal,
        )
        return layer, inputs, (out, weights) if need_weights else out

    def forward(self, data: CaseData, dtype: str) -> np.ndarray:
        with torch.no_grad():
            _, _, out = self._run(data, dtype, grad=False)
        return out.to(torch.float64).cpu().numpy()

    def weights(self, data: CaseData, dtype: str) -> np.ndarray:
        with torch.no_grad():
            _, _, (_, weights) = self._run(data, dtype, grad=False, need_weights=True)
        return weights.to(torch.float64).cpu().numpy()

    def _penalty(self, data: CaseData, dtype: str, grad: bool):
        layer, inputs = self._layer_inputs(data, dtype, grad)
        return layer, inputs, layer.metric_penalty(inputs["query"], inputs.get("context"))

    def metric_penalty(self, data: CaseData, dtype: str) -> float:
        with torch.no_grad():
            return float(self._penalty(data, dtype, grad=False)[2])

    def metric_penalty_gradients(self, data: CaseData, dtype: str) -> dict[str, np.ndarray]:
        layer, inputs, penalty = self._penalty(data, dtype, grad=True)
        if penalty.requires_grad:  # metric "none": a constant 0 outside the graph, every gradient 0
            penalty.backward()
        # The values never enter the penalty (no .grad): their gradient is 0.
        grads = {
            name: np.zeros(t.shape) if t.grad is None else t.grad.to(torch.float64).cpu().numpy()
            for name, t in inputs.items()
        }
        grads.update(layer.canonical_grads())
        return grads

    def decode(self, data: CaseData, dtype: str) -> np.ndarray:
        """``data.case.steps`` through one ``DamchaKVCache``; every step's outputs."""
        layer = DamchaAttention.from_canonical(
            data.params, data.config, batch_first=True, device=self.device, dtype=_DTYPES[dtype]
        ).eval()
        x = torch.from_numpy(data.query).to(self.device, _DTYPES[dtype])
        cache, outs = DamchaKVCache(), []
        with torch.no_grad():
            for start, stop in data.case.steps:
                t = x[:, start:stop]
                outs.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
        return torch.cat(outs, dim=1).to(torch.float64).cpu().numpy()

    def gradients(self, data: CaseData, dtype: str) -> dict[str, np.ndarray]:
        layer, inputs, out = self._run(data, dtype, grad=True)
        cot = torch.from_numpy(data.cotangent).to(self.device, torch.float64)
        (out.to(torch.float64) * cot).sum().backward()
        grads = {name: t.grad.to(torch.float64).cpu().numpy() for name, t in inputs.items()}
        grads.update(layer.canonical_grads())
        return grads
