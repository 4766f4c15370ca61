"""``damcha_torch.ensure_torchvision_importable``: installed with the package (it lived in
examples/, so a user's ``from transformers import GPT2LMHeadModel`` beside the pinned CPU
torch and PyPI's torchvision failed with "operator torchvision::nms does not exist"
and the fix was not importable). Each case in a fresh process: the fix acts once per process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

# Not importorskip: importing torchvision here is what fails (and the fix acts once per process).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision not installed")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_torchvision_imports_after_the_installed_fix_and_its_ops_still_refuse():
    # Two fresh processes (a few seconds each, torch's import): the fix acts once per process.
    plain = run("import torchvision")
    fixed = run(
        "import damcha_torch, torch\n"
        "patched = damcha_torch.ensure_torchvision_importable()\n"
        "import torchvision\n"
        "print('patched', patched, 'again', damcha_torch.ensure_torchvision_importable())\n"
        "try:\n"
        "    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
        "    print('nms ran')\n"
        "except (NotImplementedError, RuntimeError) as exc:\n"
        "    print('nms refused', type(exc).__name__)\n"
    )
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    if plain.returncode == 0:  # a torchvision whose ops load: the fix does nothing, nms computes
        assert "patched False again False" in fixed.stdout and "nms ran" in fixed.stdout
    else:  # this project's pinned CPU torch beside PyPI's torchvision
        assert "torchvision::nms does not exist" in plain.stderr, plain.stderr[-2000:]
        assert "patched True again False" in fixed.stdout and "nms refused" in fixed.stdout, fixed.stdout
