"""Public names that moved, kept importable for one release with a warning.

A port's package ``__init__`` sets ``__getattr__ = moved_names(__name__, {...})``:
reading an old name warns (``DeprecationWarning`` at the reader's line) and
returns the object from its new place, imported only then, so the port does
not import the package that now holds it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names"]


def moved_names(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for names that moved.

    Args:
        module: the module's import name (``__name__``), for messages.
        moved: old name -> its new place, ``"package.module.Name"``.

    Returns:
        ``__getattr__(name)``: the moved object with a ``DeprecationWarning``
        for an old name; an ``AttributeError`` for any other name.
    """

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated; use {target}", DeprecationWarning, stacklevel=2)
        where, _, attr = target.rpartition(".")
        return getattr(importlib.import_module(where), attr)

    return __getattr__
