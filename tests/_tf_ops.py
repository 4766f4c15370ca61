"""Counting the TensorFlow ops a call runs eagerly (test helper)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def eager_op_types(fn: Callable[[], Any]) -> list[str]:
    """The types of the TensorFlow ops ``fn()`` runs eagerly, in order (a compiled
    function's call counts as one op, named after its graph)."""
    from tensorflow.python.framework import op_callbacks

    seen: list[str] = []

    def record(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is None:
            seen.append(op_type)

    op_callbacks.add_op_callback(record)
    try:
        fn()
    finally:
        op_callbacks.remove_op_callback(record)
    return seen
