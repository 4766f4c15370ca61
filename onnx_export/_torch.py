"""``torch.onnx.export`` (dynamo) of PyTorch models, validated like our own exports.

torch is imported only when ``export_torch`` is called.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx

from damcha_core import DamchaTypeError, DamchaValueError, check_bool, describe, invalid_argument

from ._graph import ATTENTION_OPSET
from ._io import DIGEST_KEY, check_path, content_digest, is_large, save_model, set_metadata, validate_model
from ._options import check_opset

#: The oldest opset torch.onnx.export(dynamo=True) writes: its op library (torchlib) is
#: built at opset 18, and an older request came back as an opset-18 model, silently.
TORCH_MIN_OPSET = 18


def _default_opset(proto: onnx.ModelProto) -> int | None:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def export_torch(
    model: Any,
    args: Sequence[Any] | Any,
    path: str | os.PathLike | None = None,
    *,
    opset: int = ATTENTION_OPSET,
    dynamic: bool = True,
    input_names: str | Sequence[str] | None = None,
    output_names: str | Sequence[str] | None = None,
    dynamic_shapes: Any = None,
) -> onnx.ModelProto:
    """Export a ``torch.nn.Module`` (e.g. one containing ``damcha_torch.DamchaAttention``)
    with the dynamo exporter, then validate it like ``export`` does.

    Args:
        model: the module, put in eval mode by the caller.
        args: example positional inputs (tensors), a tuple or list; one tensor
            is one input (as ``torch.onnx.export`` takes it).
        path: where to save (checked first, written atomically); ``None`` only returns the model.
        opset: ONNX opset (>= 18, torch's oldest; default 23). A request that
            torch's version converter does not reach (it stops below the
            newest opset onnx knows) is refused, never exported at another opset.
        dynamic: dims 0 and 1 (batch and sequence) of every tensor input are
            dynamic (``torch.export.Dim.DYNAMIC``), so batch and lengths can
            change after export. A model that fixes one of them (an input
            such as a (B, 1, N, M) mask, whose dim 1 is 1 and whose static N
            fixes the query's length) is refused with a ``DamchaValueError``
            naming ``dynamic``: pass ``dynamic_shapes`` or ``dynamic=False``.
        input_names, output_names: graph input/output names, in order; a str
            is one name (the first input's or output's).
        dynamic_shapes: ``torch.export``'s own spec (one entry per positional
            input), used instead of the default above, e.g. to make a mask's
            key-length dim dynamic: ``({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},
            {0: Dim.DYNAMIC, 2: Dim.DYNAMIC, 3: Dim.DYNAMIC})``.

    Returns:
        The validated ``onnx.ModelProto``.
    """
    import torch  # lazy: the framework-free exporter never needs torch

    if not isinstance(model, torch.nn.Module):
        raise DamchaTypeError(invalid_argument("model", "a torch.nn.Module", f"model={describe(model)}"))
    path = check_path(path)
    dynamic = check_bool("dynamic", dynamic)
    opset, _ = check_opset(opset)
    if opset < TORCH_MIN_OPSET:
        raise DamchaValueError(
            invalid_argument(
                "opset",
                f"an int >= {TORCH_MIN_OPSET} for export_torch (torch.onnx.export's dynamo exporter writes opset "
                f"{TORCH_MIN_OPSET} at the oldest; damcha_onnx.export builds opsets from 17 without torch)",
                f"opset={opset}",
            )
        )
    # One tensor is one input, as torch.onnx.export takes it; tuple(tensor) would
    # have split it along its batch into one input per row.
    if isinstance(args, torch.Tensor):
        args = (args,)
    # Any other iterable of inputs (dict.values() of one's feeds) as a tuple, as tuple(args) took it;
    # not a str or a mapping, whose iteration gives characters or keys.
    if not isinstance(args, Iterable) or isinstance(args, (str, bytes, Mapping)):
        raise DamchaTypeError(
            invalid_argument(
                "args",
                "a tuple, list or other iterable of the example positional inputs, or one tensor",
                f"args={describe(args)}",
            )
        )
    args = tuple(args)
    input_names = _names("input_names", input_names)
    output_names = _names("output_names", output_names)
    if dynamic_shapes is not None:
        if not dynamic:
            raise DamchaValueError(
                invalid_argument(
                    "dynamic_shapes", "None unless dynamic=True", "dynamic=False and a dynamic_shapes spec"
                )
            )
        if not isinstance(dynamic_shapes, (tuple, list)) or len(dynamic_shapes) != len(args):
            raise DamchaValueError(
                invalid_argument(
                    "dynamic_shapes",
                    f"one entry per positional input ({len(args)})",
                    f"dynamic_shapes={describe(dynamic_shapes)}",
                )
            )
        dynamic_shapes = tuple(dynamic_shapes)
    default_dims = dynamic_shapes is None and dynamic
    if default_dims:
        Dim = torch.export.Dim
        dynamic_shapes = tuple(
            {0: Dim.DYNAMIC, 1: Dim.DYNAMIC} if isinstance(a, torch.Tensor) and a.ndim >= 2 else None for a in args
        )
    try:
        program = torch.onnx.export(
            model,
            args,
            dynamo=True,
            opset_version=opset,
            dynamic_shapes=dynamic_shapes,
            input_names=input_names,
            output_names=output_names,
            verbose=False,
        )
    except Exception as exc:
        conflict = _dim_conflict(exc) if default_dims else None
        if conflict is None:
            raise
        # The default marks dims 0 and 1 of every tensor input dynamic; a model that
        # ties one of them to a fixed size (a (B, 1, N, M) mask: its head dim is 1,
        # and its static N fixes the query's length) cannot keep that promise.
        raise DamchaValueError(
            invalid_argument(
                "dynamic",
                "dynamic=True only for a model whose tensor inputs all have variable dims 0 and 1 (batch and "
                "length; the default marks exactly those dynamic); for other inputs, such as a (B, 1, N, M) mask, "
                "pass dynamic_shapes= (torch.export's spec, one entry per input, e.g. {0: Dim.DYNAMIC, "
                "2: Dim.DYNAMIC, 3: Dim.DYNAMIC} for that mask) or dynamic=False (every dim fixed at the example's)",
                f"dynamic=True, inputs {[describe(a) for a in args]}; torch.export: {conflict}",
            )
        ) from exc
    if program is None:  # torch.onnx.export returns None only when it writes to a file itself
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNXProgram")
    proto = program.model_proto
    written = _default_opset(proto)
    if written != opset:
        # torch's version converter leaves the model at opset 18 where it cannot
        # convert an op (the Attention op past opset 25 with torch 2.13): onnx.checker
        # then failed on that op, with a raw ValidationError.
        raise DamchaValueError(
            invalid_argument(
                "opset",
                f"an opset torch.onnx.export can convert this model to (torch {torch.__version__} wrote opset "
                f"{written} instead: its version converter stops at an op it cannot convert; torch 2.13 takes "
                "DamchaAttention's Attention op to opset 25 at most)",
                f"opset={opset}",
            )
        )
    _name_dynamic_dims(proto)
    validate_model(proto)
    if not is_large(proto):  # the identity run_ort(..., session=) compares; a model past 2 GiB goes without
        set_metadata(proto, DIGEST_KEY, content_digest(proto.SerializeToString(), ()))
    if path is not None:
        save_model(proto, path)  # atomic: a failure keeps an earlier file at path
    return proto


def _names(name: str, names: Any) -> list[str] | None:
    """``input_names``/``output_names`` as a list: a str is one name (``list("query")``
    named the input "q"), a sequence of non-empty, distinct strs as given."""
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    expected = "a str (one name), an iterable of distinct non-empty strs (a list, dict.keys()), or None"
    if not isinstance(names, Iterable) or isinstance(names, (bytes, Mapping)):
        raise DamchaTypeError(invalid_argument(name, expected, f"{name}={describe(names)}"))
    names = list(names)
    if not all(isinstance(n, str) for n in names):
        raise DamchaTypeError(invalid_argument(name, expected, f"{name}={describe(names)}"))
    if not all(names) or len(set(names)) != len(names):
        raise DamchaValueError(invalid_argument(name, expected, f"{name}={list(names)!r}"))
    return list(names) or None


def _dim_conflict(exc: BaseException) -> str | None:
    """torch.export's report that a dim marked dynamic is fixed by the model, from
    the causes of ``exc`` (torch.onnx wraps it in a TorchExportError), or None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = str(cause)
        for marker in ("Found the following conflicts", "Constraints violated"):
            if marker in text:
                lines = [line.strip() for line in text[text.index(marker) :].splitlines() if line.strip()]
                return " ".join(lines[:4])[:600]
        cause = cause.__cause__ or cause.__context__
    return None


#: torch.export's own symbols for dynamic dims (s77, s27): named after the input they size instead.
_TORCH_SYMBOL = re.compile(r"\bs\d+\b")


def _name_dynamic_dims(proto: onnx.ModelProto) -> None:
    """Rename torch.export's dynamic dims (``s77``) as the native exporter names
    them: dim 0 ``batch``, dim 1 ``<input>_len`` (``query_len``, ``context_len``),
    others ``<input>_dim<k>``; one symbol keeps one name everywhere (inputs,
    outputs, value_info, expressions such as ``s48*s83``), and a name already
    taken by another symbol gets the input's name appended."""
    inputs = [v for v in proto.graph.input if v.type.HasField("tensor_type")]
    used = {
        d.dim_param
        for v in inputs
        for d in v.type.tensor_type.shape.dim
        if d.dim_param and not _TORCH_SYMBOL.fullmatch(d.dim_param)
    }
    names: dict[str, str] = {}
    for value in inputs:
        for k, dim in enumerate(value.type.tensor_type.shape.dim):
            symbol = dim.dim_param
            if not _TORCH_SYMBOL.fullmatch(symbol) or symbol in names:
                continue
            base = "batch" if k == 0 else f"{value.name}_len" if k == 1 else f"{value.name}_dim{k}"
            name = base if base not in used else f"{base}_{value.name}"
            n = 2
            while name in used:
                name, n = f"{base}_{n}", n + 1
            names[symbol] = name
            used.add(name)
    if not names:
        return
    graph = proto.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param:
                    dim.dim_param = _TORCH_SYMBOL.sub(lambda m: names.get(m.group(), m.group()), dim.dim_param)


def encoder_from_torch(encoder: Any, *, causal: bool = False) -> tuple[dict[str, Any], Any]:
    """Stack parameters and ``EncoderConfig`` of a trained ``damcha_torch`` encoder.

    The encoder's own public ``to_canonical(causal=...)`` (damcha_core's stack
    format): any ``damcha_torch.build_encoder`` stack converts, pre- or
    post-norm layers (``norm_first``), ReLU or GELU (exact or tanh)
    feed-forward, with or without a final LayerNorm, as long as every layer
    has the same attention config, activation, norm placement and LayerNorm
    epsilon, and biases (otherwise a DamchaValueError saying what differs).
    ``share_metric`` is read from the encoder; a shared generator is stored
    once. Pass the result to ``export_encoder`` (or ``encoder_forward`` for the
    NumPy reference).

    Args:
        encoder: a ``damcha_torch.DamchaTransformerEncoder``.
        causal: whether the exported stack applies the causal rule.

    Returns:
        ``(params, config)`` with float64 NumPy arrays.
    """
    import damcha_torch as dt

    if not isinstance(encoder, dt.DamchaTransformerEncoder):
        raise DamchaTypeError(
            invalid_argument("encoder", "a damcha_torch.DamchaTransformerEncoder", f"encoder={describe(encoder)}")
        )
    return encoder.to_canonical(causal=causal)
