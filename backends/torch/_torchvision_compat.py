"""Make ``import timm`` work beside a CPU-only torch whose torchvision has no ops.

timm imports torchvision at import time (it uses only its Python parts for
ViTs). The torchvision wheels on PyPI for x86_64 Linux are CUDA builds: beside
the CPU torch this project pins, their compiled ops cannot load, and
torchvision's import then fails on the fake-tensor registration of
``torchvision::nms`` (an operator that was never defined). When, and only
when, torchvision's extension cannot load, this declares the schemas of the
two operators that registration needs, without kernels: torchvision's Python
part imports, and calling ``torchvision.ops.nms`` raises torch's "no kernel"
error instead of silently doing anything. Where torchvision's ops load
(a matching CPU or CUDA build), this does nothing.

Call ``damcha_torch.ensure_torchvision_importable()`` before importing
``timm`` or ``transformers`` (which imports torchvision whenever it is
installed). Why torchvision mismatches: docs/models.md, "Installing on a
CPU-only machine".
"""

from __future__ import annotations

import importlib.util
import os
import sys


def ensure_torchvision_importable() -> bool:
    """Make ``import torchvision`` (hence ``timm``, ``transformers``) work beside a torchvision
    whose compiled ops cannot load; a no-op where they load or torchvision is not installed.

    Returns True when the operator schemas had to be declared."""
    if "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False  # not installed: `import timm` reports that itself
    import torch

    folder = list(spec.submodule_search_locations)[0]
    library = next((f for f in os.listdir(folder) if f.startswith("_C.") and f.endswith((".so", ".pyd"))), None)
    if library is not None:
        try:
            torch.ops.load_library(os.path.join(folder, library))
            return False  # the real ops are there
        except (ImportError, OSError):
            pass
    if hasattr(torch.ops.torchvision, "nms"):
        return False
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    # Kept alive for the process: dropping the Library object would undefine them.
    ensure_torchvision_importable._library = lib  # type: ignore[attr-defined]
    return True
