"""A counting stand-in for damcha_torch's C decoding kernel, for the tests that
pin which steps and sites it maps (monkeypatched in as ``_functional._HEADMIX``)."""

from __future__ import annotations

from typing import Any

from damcha_torch import _functional as fn

# The built kernel, read at import (before any test patches it); None without a C compiler.
KERNEL = fn._HEADMIX


class KernelCalls:
    """``fn._HEADMIX``'s stand-in: counts the kernel's calls and forwards them."""

    def __init__(self) -> None:
        self.calls = 0

    def map(self, *args: Any) -> Any:
        self.calls += 1
        return KERNEL.map(*args)
