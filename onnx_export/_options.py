"""``ExportOptions``: the export keywords of every exporter, validated in one place.

``export``/``build_model`` (one layer), ``export_encoder`` and
``export_token_model`` take the same keywords; each builds one
``ExportOptions`` (checked on construction) and the graph builders read only
that object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from damcha_core import (
    DamchaNotIntegerError,
    DamchaTypeError,
    DamchaValueError,
    check_bool,
    describe,
    invalid_argument,
)

from ._graph import ATTENTION_OPSET, DTYPES, MIN_OPSET

FORMS = ("auto", "attention", "decomposed")
#: What an exporter builds: one layer, an encoder stack, or the token model.
KINDS = ("layer", "encoder", "token_model")
#: Symbolic dims of the cache: P cached tokens, P + N after the step.
PAST_LEN, TOTAL_LEN = "past_len", "total_len"


def _not_an_int(value: Any) -> type[DamchaTypeError]:
    """The error class of an int argument given ``value``, which is no int: a
    real number (2.0, 1.5) is ``DamchaNotIntegerError`` (a ``DamchaTypeError``
    and a ``ValueError``, as damcha_core's ``check_int`` raises it), anything
    else a ``DamchaTypeError``."""
    real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    return DamchaNotIntegerError if real else DamchaTypeError


def check_opset(opset: Any, form: str = "auto") -> tuple[int, str]:
    """Validate ``opset``/``form``; returns (opset, resolved form)."""
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, (bool, np.bool_)) or not isinstance(opset, numbers.Integral):
        raise _not_an_int(opset)(
            invalid_argument("opset", f"an int in [{MIN_OPSET}, {newest}]", f"opset={describe(opset)}")
        )
    opset = int(opset)
    if not MIN_OPSET <= opset <= newest:
        raise DamchaValueError(
            invalid_argument(
                "opset",
                f"an int in [{MIN_OPSET}, {newest}]: {MIN_OPSET}-{ATTENTION_OPSET - 1} export a decomposed MatMul/Softmax graph, >= {ATTENTION_OPSET} the standard Attention op",
                f"opset={opset}",
            )
        )
    if form not in FORMS:
        raise DamchaValueError(invalid_argument("form", f"one of {FORMS}", f"form={describe(form)}"))
    if form == "auto":
        form = "attention" if opset >= ATTENTION_OPSET else "decomposed"
    elif form == "attention" and opset < ATTENTION_OPSET:
        raise DamchaValueError(
            invalid_argument(
                "opset",
                f"an int >= {ATTENTION_OPSET} with form='attention' (the first opset with the Attention op)",
                f"opset={opset}, form='attention'",
            )
        )
    return int(opset), form


def check_dtype(dtype: Any) -> str:
    """``dtype``'s name ("float32", "float64" or "float16") from a name or any
    NumPy dtype-like (``np.float16``, ``np.dtype("float16")``, ``"f2"``)."""
    name = dtype
    # None and bools are not dtype-likes here, though np.dtype(None) is float64.
    if dtype is not None and not isinstance(dtype, bool):
        with contextlib.suppress(TypeError, ValueError):
            name = np.dtype(dtype).name
    if name == "bfloat16":
        raise DamchaValueError(
            invalid_argument(
                "dtype",
                f"one of {tuple(DTYPES)}: bfloat16 graphs are not exported because onnxruntime's CPU provider has no bfloat16 kernels for MatMul, Add, Mul, Softmax, Where, ReduceMean, Erf (nor does its Python API take bfloat16 feeds), so they could not be validated",
                f"dtype={describe(dtype)}",
            )
        )
    if not isinstance(name, str) or name not in DTYPES:
        raise DamchaValueError(
            invalid_argument("dtype", f"one of {tuple(DTYPES)} or its NumPy dtype", f"dtype={describe(dtype)}")
        )
    return name


def _dim(dynamic: bool, name: str, symbol: str, value: Any) -> str | int:
    if dynamic:
        if value is not None:
            raise DamchaValueError(
                invalid_argument(
                    name,
                    "None with dynamic=True (it fixes a dimension, so it needs dynamic=False)",
                    f"{name}={describe(value)}",
                )
            )
        return symbol
    message = invalid_argument(name, "an int >= 1 with dynamic=False", f"{name}={describe(value)}")
    # None is a size not given, which dynamic=False needs: a value missing, not a wrong type.
    if value is not None and (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)):
        raise _not_an_int(value)(message)
    if value is None or value < 1:
        raise DamchaValueError(message)
    return int(value)


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """How a layer, stack or token model is exported; validated on construction.

    Args:
        opset: 17-22 export a decomposed MatMul/Softmax graph; >= 23 (default)
            one standard ``Attention`` op per layer.
        form: "auto" (by opset), "attention" or "decomposed".
        dtype: "float32" (default), "float64" or "float16" (or a NumPy
            dtype-like of one: ``np.float16``, ``np.dtype("float16")``) for inputs,
            weights and outputs (float16 accumulates the RMS statistic and
            the softmax in float32).
        causal: hide key j from query i when j > i (layers; a stack's comes
            from its config).
        cross: a ``context`` input (layers only).
        mask: a boolean ``mask`` input, True = may attend: ``True`` for a 4-D
            (B|1, H|1, N|1, M) mask, ``"padding"`` for a 2-D (B, M) key
            padding mask (as a tokenizer's attention mask), ``False`` for none
            (``"4d"`` and ``"none"`` too: the names of the CLI's ``--mask`` and
            of the model's ``damcha_mask`` metadata).
        dynamic: symbolic batch and sequence dims; ``False`` fixes them to
            ``batch_size``, ``query_len`` (and ``context_len``).
        batch_size, query_len, context_len: the fixed sizes with ``dynamic=False``.
        kv_cache: export one decode step with a key/value cache (causal
            self-attention only).
        return_weights: an extra output with the attention probabilities,
            ``weights`` (B, H, N, M) for a layer, ``weights.{i}`` per layer of
            a stack.
        external_data: where a saved model keeps its weights: ``None``
            (default) in the ``.onnx`` file unless the model is too large for
            one protobuf (2 GiB), then in ``<path>.data`` beside it; ``True``
            always there; ``False`` never (refused for a model over 2 GiB).
        kind: "layer", "encoder" or "token_model" (which rules apply).
    """

    opset: int = ATTENTION_OPSET
    form: str = "auto"
    dtype: npt.DTypeLike = "float32"  # stored as its name
    causal: bool = False
    cross: bool = False
    mask: bool | str = False
    dynamic: bool = True
    batch_size: int | None = None
    query_len: int | None = None
    context_len: int | None = None
    kv_cache: bool = False
    return_weights: bool = False
    external_data: bool | None = None
    kind: str = "layer"

    @classmethod
    def keywords(cls, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The export options among an exporter's arguments, for ``resolve``.

        Args:
            arguments: the exporter's ``locals()``, taken before it binds a
                name of an option to anything but its argument; only the
                names of option fields (``kind`` and ``options`` never) are
                read, so each exporter passes exactly the options its
                signature has, with no list of them to keep in step.
        """
        return {f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.name != "kind" and f.name in arguments}

    @property
    def dtype_name(self) -> str:
        """``dtype`` as stored: its name, "float32", "float64" or "float16"."""
        return str(self.dtype)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DamchaValueError(invalid_argument("kind", f"one of {KINDS}", f"kind={describe(self.kind)}"))
        opset, form = check_opset(self.opset, self.form)
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        set_("opset", opset)
        set_("form", form)
        set_("dtype", check_dtype(self.dtype))
        for name in ("causal", "cross", "dynamic", "kv_cache", "return_weights"):
            set_(name, check_bool(name, getattr(self, name)))
        # The names the CLI's --mask and the model's damcha_mask metadata use are taken too.
        mask = {"4d": True, "none": False}.get(self.mask, self.mask) if isinstance(self.mask, str) else self.mask
        if mask != "padding":
            if not isinstance(mask, (bool, np.bool_)):
                raise (DamchaValueError if isinstance(mask, str) else DamchaTypeError)(
                    invalid_argument(
                        "mask",
                        "True or '4d' (a 4-D mask input), 'padding' (a (B, M) key padding mask) or False/'none'",
                        f"mask={describe(self.mask)}",
                    )
                )
            set_("mask", bool(mask))
        if self.external_data is not None:
            if not isinstance(self.external_data, (bool, np.bool_)):
                raise DamchaTypeError(
                    invalid_argument(
                        "external_data",
                        "True, False or None (external only for a model past protobuf's 2 GiB)",
                        f"external_data={describe(self.external_data)}",
                    )
                )
            set_("external_data", bool(self.external_data))
        stack = self.kind != "layer"
        if stack and self.cross:
            raise DamchaValueError(
                invalid_argument("cross", f"False: a {self.kind.replace('_', ' ')} is self-attention", "cross=True")
            )
        if self.kv_cache:
            causal_name = "config.causal" if stack else "causal"
            if not self.causal:
                raise DamchaValueError(
                    invalid_argument(
                        "kv_cache",
                        f"False unless {causal_name}=True: it exports an autoregressive decode step (query i of a "
                        "step sees cached and new keys j <= P + i)",
                        f"kv_cache=True, {causal_name}={self.causal}",
                    )
                )
            if self.cross:
                raise DamchaValueError(
                    invalid_argument(
                        "kv_cache",
                        "False with cross=True: it caches the layer's own keys and values, so it needs "
                        "self-attention (a cross-attention context is not a growing sequence)",
                        "kv_cache=True, cross=True",
                    )
                )
        # Validates batch_size/query_len/context_len against `dynamic` (raises here, not at build time).
        self.batch_dim, self.query_dim  # noqa: B018
        if self.cross:
            _dim(self.dynamic, "context_len", "context_len", self.context_len)
        elif self.context_len is not None:
            raise DamchaValueError(
                invalid_argument(
                    "context_len", "None without cross=True", f"context_len={describe(self.context_len)}, cross=False"
                )
            )

    @property
    def batch_dim(self) -> str | int:
        """B: the symbol ``"batch"`` or ``batch_size``."""
        return _dim(self.dynamic, "batch_size", "batch", self.batch_size)

    @property
    def query_dim(self) -> str | int:
        """N: the symbol ``"query_len"`` or ``query_len``."""
        return _dim(self.dynamic, "query_len", "query_len", self.query_len)

    @property
    def key_dim(self) -> str | int:
        """M: the context length (cross), P + N with a cache (always symbolic:
        P changes every step), else N."""
        if self.cross:
            return _dim(self.dynamic, "context_len", "context_len", self.context_len)
        return TOTAL_LEN if self.kv_cache else self.query_dim

    @classmethod
    def resolve(cls, options: ExportOptions | None, kind: str, **keywords: Any) -> ExportOptions:
        """``options`` itself (checked against ``kind``), or one built from an
        exporter's keywords; passing both ``options`` and a keyword that
        differs from its default is refused (one of them would be ignored)."""
        if options is None:
            return cls(kind=kind, **keywords)
        if not isinstance(options, ExportOptions):
            raise DamchaTypeError(
                invalid_argument("options", "an ExportOptions or None", f"options={describe(options)}")
            )
        if options.kind != kind:
            raise DamchaValueError(
                invalid_argument(
                    "options", f"options of kind {kind!r} for this exporter", f"options.kind={options.kind!r}"
                )
            )
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        given = sorted(
            name for name, value in keywords.items() if value is not defaults[name] and value != defaults[name]
        )
        if given:
            raise DamchaValueError(
                invalid_argument(
                    "options",
                    "None when export options are passed as keywords (pass them one way, not both)",
                    f"options and keywords {given}",
                )
            )
        return options
