"""The PyTorch backend passes the conformance catalogue: outputs and gradients."""

from __future__ import annotations

import pytest
from _devices import TORCH_DEVICES

from damcha_conformance import run_conformance
from damcha_conformance.adapters import TorchAdapter as ConformanceAdapter


def test_adapter_declares_its_dtypes():
    adapter = ConformanceAdapter()
    assert adapter.name == "torch"
    assert ConformanceAdapter(device="meta").name == "torch-meta"  # a non-CPU device is named in the report
    assert tuple(adapter.dtypes) == ("float64", "float32", "bfloat16")
    assert adapter.supports_gradients


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_catalogue_passes(dtype, device):
    report = run_conformance(ConformanceAdapter(device=device), dtypes=[dtype])
    assert report.passed, report.summary()
    ran = [r for r in report.results if r.status != "unsupported"]
    assert len(ran) == len(report.results)  # the torch port claims every case
    assert any(r.check == "gradients" for r in ran)
