"""The exception hierarchy shared by the reference and every backend.

Every port raises these same classes for the same rule, so a user (and the
conformance suite) can rely on ``except damcha_core.DamchaError`` everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np


class DamchaError(Exception):
    """Base class of every error raised by damcha on bad input."""


class DamchaValueError(DamchaError, ValueError):
    """An argument has the right type but a value or shape that breaks a rule."""


class DamchaTypeError(DamchaError, TypeError):
    """An argument has the wrong type or dtype."""


class DamchaNotIntegerError(DamchaTypeError, ValueError):
    """A real number that is not an integer where an int is expected (``num_heads=1.5``).

    A ``TypeError`` by Python's convention and a ``ValueError`` as Keras'
    ``MultiHeadAttention`` reports the same argument, so code written against
    either framework catches it (the precedent: NumPy's ``AxisError`` is both
    a ``ValueError`` and an ``IndexError``)."""


def invalid_argument(name: str, expected: str, received: str) -> str:
    """The one wording of every argument error of the policy, in every port.

    ``Invalid argument `num_heads`: expected an int >= 1. Received:
    num_heads=1.5``: the argument as the caller named it (the port's own
    name), what a valid value is (with the reason where a rule needs one), and
    what was received (``describe``'d values; shapes and dtypes for arrays).
    Keras words its argument errors this way, so its own tests' patterns
    (``argument `num_heads```) match in every port.
    """
    return f"Invalid argument `{name}`: expected {expected}. Received: {received}"


_MAX_REPR = 80
_SCALARS = (int, float, complex, bool, str, type(None))


def describe(value: Any) -> str:
    """Short, one-line description of a received value for error messages.

    Never prints the contents of a large value: arrays and tensors (anything
    with ``shape`` and ``dtype``) by type, shape and dtype; lists, tuples and
    mappings by type and length (small flat ones of scalars, such as a shape
    tuple, as written); classes by their qualified name; strings and other
    objects by a ``repr`` cut to about 80 characters.
    """
    if isinstance(value, type):  # a class by its name: its attributes are descriptors, not a shape
        module = value.__module__
        return value.__qualname__ if module == "builtins" else f"{module}.{value.__qualname__}"
    if isinstance(value, np.generic):  # a NumPy scalar reads as the number it is
        value = value.item()
    try:
        shape = getattr(value, "shape", None)
    except RuntimeError:  # torch's strided nested tensor raises RuntimeError for .shape
        shape = None
        with contextlib.suppress(RuntimeError, AttributeError, TypeError):
            if getattr(value, "is_nested", False):
                return f"{type(value).__name__}(nested, dim={value.dim()}, dtype={value.dtype})"
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        with contextlib.suppress(TypeError):  # a symbolic shape that cannot be iterated
            shape = tuple(shape)
        return f"{type(value).__name__}(shape={shape}, dtype={dtype})"
    if isinstance(value, (str, bytes)):
        text = repr(value)
        if len(text) <= _MAX_REPR:
            return text
        return f"{repr(value[: _MAX_REPR - 20])[:-1]}...' ({type(value).__name__} of length {len(value)})"
    if isinstance(value, (list, tuple, set, frozenset)):
        if len(value) <= 8 and all(isinstance(v, _SCALARS) for v in value):
            text = repr(value)
            if len(text) <= _MAX_REPR:
                return text
        kinds = sorted({type(v).__name__ for v in value})
        elements = "" if not kinds else f", element type{'s' if len(kinds) > 1 else ''} {', '.join(kinds[:4])}"
        return f"{type(value).__name__}(len={len(value)}{elements})"
    if isinstance(value, Mapping):
        keys = [repr(k) if isinstance(k, str) else type(k).__name__ for k in list(value)[:4]]
        more = ", ..." if len(value) > 4 else ""
        return f"{type(value).__name__}(len={len(value)}, keys=[{', '.join(keys)}{more}])"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} object>"
    text = " ".join(text.split())  # one line
    if len(text) > _MAX_REPR:
        text = f"{text[: _MAX_REPR - 3]}... ({type(value).__name__})"
    return text
