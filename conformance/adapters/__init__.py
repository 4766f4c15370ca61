"""The built-in adapters: each port of this project, held to the reference.

Each adapter lives in its own module and is imported on first use, so that
``import damcha_conformance.adapters`` imports no framework:

- ``ReferenceAdapter``: the NumPy reference itself (a check of the runner).
- ``TorchAdapter(device="cpu")``: ``damcha_torch.DamchaAttention`` (fused path).
- ``JaxAdapter()``: ``damcha_jax.damcha_attention`` (float64 with x64 enabled).
- ``KerasAdapter()``: ``damcha_keras.DamchaAttention`` on the current ``KERAS_BACKEND``.
- ``OnnxAdapter(opset=23, runtime="onnxruntime")``: ``damcha_onnx`` exports in onnxruntime.

``BUILTIN`` names the backends ``damcha conform --backend`` knows, with the
framework each needs and the environment its worker process runs in;
``load_adapter`` turns a backend name or a third party's ``module:attr`` into
an adapter.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from damcha_core import DamchaError, DamchaTypeError, DamchaValueError, invalid_argument

if TYPE_CHECKING:  # pragma: no cover
    from .._adapter import BackendAdapter
    from ._jax import JaxAdapter
    from ._keras import KerasAdapter
    from ._onnx import OnnxAdapter
    from ._reference import ReferenceAdapter
    from ._torch import TorchAdapter

__all__ = [
    "BUILTIN",
    "Builtin",
    "JaxAdapter",
    "KerasAdapter",
    "OnnxAdapter",
    "ReferenceAdapter",
    "TorchAdapter",
    "load_adapter",
]

# class name -> module of this package that defines it
_MODULES = {
    "JaxAdapter": "_jax",
    "KerasAdapter": "_keras",
    "OnnxAdapter": "_onnx",
    "ReferenceAdapter": "_reference",
    "TorchAdapter": "_torch",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULES))


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A backend ``damcha conform --backend NAME`` runs.

    Args:
        adapter: the class name in ``damcha_conformance.adapters``.
        requires: modules that must be importable (checked without importing them).
        extra: the smallest ``damcha[...]`` extra that installs them.
        env: environment of the backend's worker process (Keras reads its
            backend, JAX its x64 mode, once at import).
        kwargs: arguments of the adapter class.
        on_request: run only when named (``torch-cuda``: most machines have no GPU).
        limits: checks the backend cannot have, with the reason (an ONNX
            inference graph has no gradients and no metric penalty): keys
            "gradients", "weights", "penalty"; ``damcha conform`` states them
            and does not ask for them.
        dtypes: the dtypes its adapter declares in its worker's environment
            (JAX's x64 mode on), known without importing the framework:
            ``damcha conform`` refuses a ``--dtype`` selection that leaves the
            backend nothing to run (each backend's tests check the adapter
            declares exactly these).
    """

    adapter: str
    requires: tuple[str, ...]
    extra: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    on_request: bool = False
    limits: Mapping[str, str] = dataclasses.field(default_factory=dict)
    dtypes: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """The required modules that are not installed."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


_TORCH_DTYPES = ("float64", "float32", "bfloat16")
_KERAS_DTYPES = ("float32", "float64")

BUILTIN: dict[str, Builtin] = {
    "reference": Builtin(
        "ReferenceAdapter",
        ("numpy",),
        limits={"gradients": "the reference is what gradients are compared against"},
        dtypes=("float64",),
    ),
    "torch": Builtin("TorchAdapter", ("torch",), "torch", dtypes=_TORCH_DTYPES),
    "jax": Builtin(
        "JaxAdapter", ("jax", "flax"), "jax", {"JAX_ENABLE_X64": "1"}, dtypes=("float32", "bfloat16", "float64")
    ),
    "keras-tensorflow": Builtin(
        "KerasAdapter", ("keras", "tensorflow"), "keras", {"KERAS_BACKEND": "tensorflow"}, dtypes=_KERAS_DTYPES
    ),
    "keras-jax": Builtin(
        "KerasAdapter",
        ("keras", "jax"),
        "keras,jax",
        {"KERAS_BACKEND": "jax", "JAX_ENABLE_X64": "1"},
        dtypes=_KERAS_DTYPES,
    ),
    "keras-torch": Builtin(
        "KerasAdapter", ("keras", "torch"), "keras,torch", {"KERAS_BACKEND": "torch"}, dtypes=_KERAS_DTYPES
    ),
    "onnxruntime": Builtin(
        "OnnxAdapter",
        ("onnx", "onnxruntime"),
        "onnx",
        limits={
            "gradients": "exported ONNX inference graphs have no autodiff",
            "penalty": "exported ONNX inference graphs compute no training loss",
        },
        dtypes=("float32", "float64", "float16"),
    ),
    "torch-cuda": Builtin(
        "TorchAdapter", ("torch",), "torch", kwargs={"device": "cuda"}, on_request=True, dtypes=_TORCH_DTYPES
    ),
}


def load_adapter(spec: str) -> BackendAdapter:
    """The adapter named by ``spec``: a key of ``BUILTIN``, or ``module:attr``
    naming an adapter class, factory or instance (a third party's port).

    A built-in backend's environment (``KERAS_BACKEND``, ``JAX_ENABLE_X64``)
    is set here when it is not set yet; it takes effect only if the framework
    was not imported before, so a Keras adapter on another backend than the
    one asked for is refused rather than reported under the wrong name.

    Raises:
        DamchaValueError: an unknown name, a module that cannot be found or
            fails to import (chained from its exception),
            an attribute it does not have, or a class or factory that raises
            when called with no arguments (chained from its exception).
        DamchaTypeError: what ``module:attr`` names or builds is not an
            adapter (``check_adapter``: a missing attribute or method, or
            ``dtypes`` given as one string); a DamchaValueError when its
            ``dtypes`` is empty or names an unknown dtype.
    """
    if not isinstance(spec, str) or not spec:
        raise DamchaValueError(
            invalid_argument("spec", f"a built-in backend ({', '.join(BUILTIN)}) or module:attr", f"spec={spec!r}")
        )
    builtin = BUILTIN.get(spec)
    if builtin is not None:
        for key, value in builtin.env.items():
            os.environ.setdefault(key, value)
        adapter = __getattr__(builtin.adapter)(**builtin.kwargs)
        if spec.startswith("keras-") and adapter.name != spec:
            raise DamchaValueError(
                invalid_argument(
                    "spec",
                    f"a backend Keras runs on: {spec!r} needs KERAS_BACKEND={builtin.env['KERAS_BACKEND']} before "
                    "Keras is imported",
                    f"spec={spec!r}, Keras runs on {adapter.name.removeprefix('keras-')!r}",
                )
            )
        return adapter
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DamchaValueError(
            invalid_argument(
                "spec", f"a built-in backend ({', '.join(BUILTIN)}) or module:attr naming an adapter", f"spec={spec!r}"
            )
        )
    if importlib.util.find_spec(module_name.split(".")[0]) is None:
        raise DamchaValueError(
            invalid_argument(
                "spec",
                "module:attr naming an importable module",
                f"spec={spec!r} (not importable: no module named {module_name.split('.')[0]!r}; is it on "
                "PYTHONPATH? pytest and damcha do not look in the current folder, python -m pytest does)",
            )
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a third party's module may fail to import in any way: said, and chained
        raise DamchaValueError(
            invalid_argument(
                "spec",
                "module:attr naming an importable module",
                f"spec={spec!r}: importing it raised {type(exc).__name__}: {exc}",
            )
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise DamchaValueError(
            invalid_argument(
                "spec",
                f"module:attr naming an attribute of {module_name}",
                f"spec={spec!r} ({module_name} does not have {attr!r})",
            )
        ) from None
    if not callable(obj):
        return _checked(spec, obj, f"{module_name}.{attr} is")
    try:
        adapter = obj()
    except Exception as exc:  # a third party's constructor may raise anything: said, and chained
        raise DamchaValueError(
            invalid_argument(
                "spec",
                _EXPECTED,
                f"spec={spec!r}: calling {module_name}.{attr}() with no arguments raised {type(exc).__name__}: {exc}",
            )
        ) from exc
    return _checked(spec, adapter, f"calling {module_name}.{attr}() returned")


_EXPECTED = (
    "module:attr naming a conformance adapter (a class or factory that builds one when called with no "
    "arguments, or an instance) with name, dtypes, supports_gradients, unsupported(case) and "
    "forward(data, dtype) (see damcha_conformance.BackendAdapter)"
)


def _checked(spec: str, adapter: Any, what: str) -> BackendAdapter:
    """``adapter`` when it is usable, else the error naming ``spec``, what it gave and what it lacks.

    Refused here, before any check, so that the CLI and the pytest plugin report a usage error
    rather than a failed run (or an AttributeError inside pytest's configuration)."""
    from .._runner import check_adapter

    try:
        check_adapter(adapter)
    except DamchaError as exc:
        cls = type(adapter)
        kind = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        # "adapter lacks name: a conformance adapter has ...": what it has is said once, in _EXPECTED
        why = str(exc).split(": a conformance adapter has", 1)[0]
        error = DamchaValueError if isinstance(exc, DamchaValueError) else DamchaTypeError  # e.g. dtypes ("fp32",)
        raise error(invalid_argument("spec", _EXPECTED, f"spec={spec!r}: {what} {kind}: {why}")) from None
    return adapter
