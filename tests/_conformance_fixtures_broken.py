"""A third party's adapter module that fails to import (loaded as module:attr by the tests)."""

from __future__ import annotations

raise RuntimeError("this port needs CUDA 13")
