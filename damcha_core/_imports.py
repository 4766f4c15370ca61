"""The one-line error of a port whose framework is not installed (DECISIONS 7).

Each port's ``__init__`` calls ``require`` before anything else, so that
``import damcha_torch`` without PyTorch says, in one line, what to install::

    ModuleNotFoundError: damcha_torch needs PyTorch: pip install "damcha[torch]"
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._cliutil import install_hint

# How messages name a framework (its import name -> what users call it).
FRAMEWORK_NAMES = {
    "torch": "PyTorch",
    "jax": "JAX",
    "jaxlib": "JAX",
    "flax": "Flax",
    "keras": "Keras",
    "tensorflow": "TensorFlow",
    "onnx": "ONNX",
    "onnxruntime": "ONNX Runtime",
    "onnxscript": "onnxscript",
    "safetensors": "safetensors",
}


def missing_message(module: str, extra: str, package: str, missing: str | None = None) -> str:
    """``"<package> needs <Framework>: pip install "damcha[<extra>]""``; when the
    framework itself is installed but one of its own dependencies
    (``missing``) is not, that name is added."""
    what = FRAMEWORK_NAMES.get(module, module)
    top = (missing or module).split(".")[0]
    if top not in (module, module.split(".")[0]):
        what = f"{what} (which could not import {top})"
    return f"{package} needs {what}: {install_hint(module, extra)}"


def require(module: str, extra: str, package: str) -> ModuleType:
    """Import and return ``module``, or raise the port's one-line ImportError.

    Args:
        module: the framework's import name, e.g. ``"torch"``.
        extra: the ``damcha[...]`` extra that installs it, e.g. ``"torch"``.
        package: the port that needs it, e.g. ``"damcha_torch"``.

    Raises:
        ModuleNotFoundError: (an ImportError) ``module`` or one of its own
            dependencies is not installed; the message is one line naming the
            extra, e.g. ``damcha_torch needs PyTorch: pip install "damcha[torch]"``.
        ImportError: ``module`` is installed but failed to import for another
            reason; the message says so and the original error is chained.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(missing_message(module, extra, package, exc.name), name=exc.name or module) from None
    except ImportError as exc:
        what = FRAMEWORK_NAMES.get(module, module)
        reason = " ".join(str(exc).split())
        raise ImportError(
            f"{package} needs {what}, which is installed but failed to import ({reason}); "
            f"reinstalling may help: {install_hint(module, extra)}"
        ) from exc
