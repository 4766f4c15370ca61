"""The PyTorch backend passes the conformance catalogue: one test per check
(forward, gradients, decode, bad input) and dtype, through the suite's pytest
parametrisation (``-k "gradients and bfloat16"`` selects)."""

from __future__ import annotations

import pytest
import torch
from _devices import TORCH_DEVICES

from damcha_conformance.adapters import BUILTIN, TorchAdapter
from damcha_conformance.pytest_plugin import assert_check, check_id, checks

DTYPES = ("float64", "float32", "bfloat16")


def test_adapter_declares_its_dtypes():
    adapter = TorchAdapter()
    assert adapter.name == "torch"
    assert TorchAdapter(device="meta").name == "torch-meta"  # a non-CPU device is named in the report
    assert tuple(adapter.dtypes) == DTYPES == BUILTIN["torch"].dtypes == BUILTIN["torch-cuda"].dtypes
    assert adapter.supports_gradients and callable(adapter.decode)
    # The weights, the metric penalty and its gradients are checked too (tests below).
    assert all(callable(getattr(adapter, m)) for m in ("weights", "metric_penalty", "metric_penalty_gradients"))


@pytest.fixture(scope="module")
def adapters():
    return {device: TorchAdapter(device=device) for device in TORCH_DEVICES}


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("check", checks(DTYPES), ids=check_id)
def test_conformance(check, device, adapters):
    assert torch.get_default_dtype() == torch.float32  # the adapter casts explicitly, nothing leaks
    assert_check(adapters[device], check)  # unsupported fails too: the torch port claims every case
