"""The exception hierarchy shared by the reference and every backend.

Every port raises these same classes for the same rule, so a user (and the
conformance suite) can rely on ``except damcha_core.DamchaError`` everywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DamchaError(Exception):
    """Base class of every error raised by damcha on bad input."""


class DamchaValueError(DamchaError, ValueError):
    """An argument has the right type but a value or shape that breaks a rule."""


class DamchaTypeError(DamchaError, TypeError):
    """An argument has the wrong type or dtype."""


def describe(value: Any) -> str:
    """Short description of a received value for error messages.

    Arrays and tensors are described by shape and dtype, never by content, so
    messages stay one line long.
    """
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__}(shape={tuple(shape)}, dtype={dtype})"
    if isinstance(value, np.generic):
        value = value.item()
    return repr(value)
