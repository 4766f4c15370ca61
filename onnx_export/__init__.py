"""damcha_onnx: work in progress."""

from __future__ import annotations

__all__: list[str] = []
