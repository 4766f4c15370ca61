"""Running exported models: onnxruntime (CPU) and ``onnx.reference``."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import onnx
import onnx.external_data_helper

from damcha_core import (
    DamchaTypeError,
    DamchaValueError,
    check_bool,
    check_int,
    describe,
    invalid_argument,
    mask_dtype_error,
)
from damcha_core._policy import NO_KEYS_RULE

from ._io import DIGEST_KEY, EXTERNAL_DATA_MIN_BYTES, is_large, write_staged

if TYPE_CHECKING:  # imported lazily at run time: building a graph needs no runtime
    import onnxruntime


def describe_value(value: Any) -> str:
    """``describe``, extended to sequences and long reprs: arrays nested in a
    list or tuple are described by shape and dtype, never printed."""
    if isinstance(value, (list, tuple)):
        try:
            array = np.asarray(value)
        except (ValueError, TypeError):  # ragged: describe the items instead
            array = None
        if array is not None and array.dtype != object:
            return f"{type(value).__name__}(shape={array.shape}, dtype={array.dtype})"
        items = ", ".join(describe_value(v) for v in value[:3])
        return f"{type(value).__name__}(len={len(value)}: {items}{', ...' if len(value) > 3 else ''})"
    text = describe(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _model_error(name: str, path: str, what: str) -> DamchaValueError:
    return DamchaValueError(
        invalid_argument(name, "an onnx.ModelProto or the path of a readable .onnx file", f"{name}={path!r} ({what})")
    )


def as_model(model: Any, name: str = "model", *, load_weights: bool = True) -> onnx.ModelProto:
    """``model`` as a ModelProto: a ModelProto itself, or the path of an ``.onnx`` file.

    ``load_weights=False`` reads a file's graph and declarations without its
    external data (enough to check feeds), and drops the data of its inline
    weights once read: that proto is for reading declarations, not for running
    (a runtime is given the path), and a large model is then not held in
    memory beside the runtime's own copy.

    Raises:
        DamchaValueError: a path that is missing, a directory, or not a
            readable ONNX model (garbage, truncated), naming the path.
        DamchaTypeError: anything else.
    """
    if isinstance(model, onnx.ModelProto):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise DamchaTypeError(
            invalid_argument(name, "an onnx.ModelProto or the path of an .onnx file", f"{name}={describe_value(model)}")
        )
    path = os.fspath(model)
    if not isinstance(path, str) or not path:
        raise _model_error(name, str(path), "an empty path")
    if os.path.isdir(path):
        raise _model_error(name, path, "a directory")
    if not os.path.isfile(path):
        raise _model_error(name, path, "no such file")
    try:
        # A truncated file can still parse as a partial message: check it, from
        # the path, so external data files are looked up beside it. First: the
        # checker reads the file itself, best before a copy is held here.
        try:
            onnx.checker.check_model(path)
        except Exception:
            # A file protobuf cannot parse gets the parser's reason (the checker would
            # report a missing ir_version); a model that parses, the checker's.
            onnx.load(path, load_external_data=False)
            raise
        proto = onnx.load(path, load_external_data=False)
        if not load_weights:
            proto = _declarations_only(proto)
        else:
            onnx.external_data_helper.load_external_data_for_model(proto, os.path.dirname(os.path.abspath(path)))
    except Exception as exc:
        raise _model_error(name, path, f"{type(exc).__name__}: {_first_line(exc)}") from exc
    return proto


def _declarations_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the data of its large inline weights."""
    for tensor in model.graph.initializer:
        if len(tensor.raw_data) >= EXTERNAL_DATA_MIN_BYTES:
            tensor.ClearField("raw_data")
    # protobuf frees a cleared field's memory only with its whole message (and
    # any reference to a part of it keeps it all): a copy, so the caller drops it
    light = onnx.ModelProto()
    light.CopyFrom(model)
    return light


def external_data_files(model: onnx.ModelProto) -> list[str]:
    """The external data files ``model``'s initialisers name (relative to its ``.onnx`` file), sorted."""
    return sorted(
        {
            entry.value
            for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
            for entry in t.external_data
            if entry.key == "location"
        }
    )


def check_weights_inline(model: onnx.ModelProto, name: str = "model") -> None:
    """Refuse an in-memory model whose weights refer to an external data file.

    ``export(..., external_data=True)`` (or a model over 2 GiB) returns such a
    ModelProto: its tensors name ``<path>.data`` relative to the ``.onnx``
    file, which an in-memory model cannot locate, so every consumer (a
    session, the reference evaluator, the quantisers) must be given the path.

    Raises:
        DamchaValueError: naming ``name``, and the data file the model refers to.
    """
    files = external_data_files(model)
    if files:
        raise DamchaValueError(
            invalid_argument(
                name,
                "the path of the .onnx file of a model with external data (an in-memory model cannot locate "
                "its external data file)",
                f"{name}=a ModelProto with external data in {files}",
            )
        )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


def ort_session(
    model: onnx.ModelProto | str | os.PathLike,
    *,
    threads: int | None = None,
    optimize: bool = True,
    spinning: bool = True,
    name: str = "model",
) -> onnxruntime.InferenceSession:
    """An ``onnxruntime.InferenceSession`` on the CPU provider.

    ``model`` is a ModelProto or a path (``.onnx`` with or without an
    external data file beside it, or ``.ort``). ``threads`` sets intra-op
    threads (``None``: onnxruntime's default); ``spinning=False`` stops idle
    worker threads from busy-waiting, which matters when other work (another
    framework, a benchmark) shares the CPUs.

    Raises:
        DamchaValueError: a path that is not a model onnxruntime can load,
            naming the path and onnxruntime's reason.
    """
    import onnxruntime as ort  # lazy: building a graph needs no runtime

    optimize, spinning = check_bool("optimize", optimize), check_bool("spinning", spinning)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors surface as exceptions; no stderr noise
    if threads is not None:
        options.intra_op_num_threads = check_int("threads", threads, optional=True)
        options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = ["CPUExecutionProvider"]
    if isinstance(model, onnx.ModelProto):
        check_weights_inline(model, name)
        if not is_large(model):
            return ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        # Over protobuf's 2 GiB limit: onnxruntime reads it from files with external data.
        with tempfile.TemporaryDirectory(prefix="damcha-ort-") as tmp:
            return ort.InferenceSession(write_staged(model, tmp, "model.onnx"), options, providers=providers)
    path = os.fspath(as_path(model, name))
    if not path.endswith(".ort"):
        as_model(path, name, load_weights=False)  # a clear error for garbage, truncated files, directories
    try:
        return ort.InferenceSession(path, options, providers=providers)
    except Exception as exc:
        raise _model_error(name, path, f"onnxruntime: {_first_line(exc)}") from exc


def as_path(model: Any, name: str = "model") -> str:
    if not isinstance(model, (str, os.PathLike)):
        raise DamchaTypeError(
            invalid_argument(name, "an onnx.ModelProto or the path of an .onnx file", f"{name}={describe_value(model)}")
        )
    path = os.fspath(model)
    if not isinstance(path, str) or not os.path.isfile(path):
        raise _model_error(name, str(path), "a directory" if os.path.isdir(path) else "no such file")
    return path


def feeds_for(model: onnx.ModelProto, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Cast ``inputs`` to the model's declared input dtypes; names must match exactly."""
    if not isinstance(inputs, Mapping):
        raise DamchaTypeError(
            invalid_argument("inputs", "a mapping of input name -> array", f"inputs={describe_value(inputs)}")
        )
    declared = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    unknown = sorted(set(inputs) - set(declared))
    missing = sorted(set(declared) - set(inputs))
    if unknown or missing:
        raise DamchaValueError(
            invalid_argument(
                "inputs", f"exactly the model's inputs {sorted(declared)}", f"missing={missing}, unexpected={unknown}"
            )
        )
    out = {}
    for name, value in inputs.items():
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(declared[name])
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as exc:  # ragged nested lists
            raise DamchaTypeError(invalid_argument(name, "an array", f"{name}={describe_value(value)}")) from exc
        # Described as received, but lists by shape and dtype (never printed).
        shown = value if hasattr(value, "shape") else array
        if np_dtype == np.bool_ and array.dtype != np.bool_:
            raise mask_dtype_error(shown, name)
        if np.issubdtype(np_dtype, np.floating) and not np.issubdtype(array.dtype, np.floating):
            # Not damcha_core's float_dtype_error: it lists bfloat16, which the frameworks take
            # and onnxruntime's feeds do not (ml_dtypes' bfloat16 is no np.floating either).
            raise DamchaTypeError(
                invalid_argument(
                    name,
                    f"a real floating tensor: float16, float32 or float64 (cast to the model's "
                    f"{np.dtype(np_dtype).name}; onnxruntime takes no bfloat16 feeds, cast one to float32 first)",
                    f"{name}={describe(shown)}",
                )
            )
        if np.issubdtype(np_dtype, np.integer) and not np.issubdtype(array.dtype, np.integer):
            raise DamchaTypeError(invalid_argument(name, "an integer array", f"{name}={describe(shown)}"))
        # Float inputs are cast to the graph's dtype (e.g. float64 data into a float32 export).
        with np.errstate(over="ignore"):  # an overflow is refused below, by name
            cast = array.astype(np_dtype, copy=False)
        if np.issubdtype(np_dtype, np.floating) and cast.dtype.itemsize < array.dtype.itemsize and cast.size:
            # Finite values past the narrower type's range would become inf (all-NaN outputs).
            overflow = np.isinf(cast) & np.isfinite(array)
            if overflow.any():
                limit = float(np.finfo(np_dtype).max)
                raise DamchaValueError(
                    invalid_argument(
                        name,
                        f"values within {np.dtype(np_dtype).name}'s range (|x| <= {limit:g}), the model's input dtype",
                        f"{name} with |x| up to {float(np.max(np.abs(array[overflow]))):g} ({describe(shown)})",
                    )
                )
        if cast is not array and np.issubdtype(np_dtype, np.integer) and cast.size and not np.array_equal(cast, array):
            # A value the model's integer type cannot hold (a uint64 id past int64) would wrap.
            raise DamchaValueError(
                invalid_argument(
                    name,
                    f"values that {np.dtype(np_dtype).name} holds, the model's input dtype",
                    f"{name} in [{array.min()}, {array.max()}] ({describe(shown)})",
                )
            )
        out[name] = cast
    check_feed_shapes(model, out)
    return out


# A mask dim named mask_<x> broadcasts: it is 1 or the size of dim <x>.
_MASK_DIMS = {"mask_batch": "batch", "mask_query": "query_len", "mask_heads": "heads"}
# Dims a feed may give size 0: an empty cache (the first decode step), an empty batch
# or no query (the empty output, see empty_outputs), and no key when there is no query
# either (checked with the others: N >= 1 queries over no key are refused).
_MAY_BE_EMPTY = ("past_len", "batch", "query_len", "context_len")


def _dims(value: onnx.ValueInfoProto) -> list[str | int]:
    """A graph input's or output's declared dims: a symbolic one by its name, a fixed one by its size."""
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _model_facts(model: onnx.ModelProto) -> dict[str, int]:
    """Sizes the graph fixes but its input shapes do not show (heads, vocabulary, positions)."""
    props = {p.key: p.value for p in model.metadata_props}
    facts = {}
    for key in ("damcha_config", "damcha_attention_config"):
        if key in props:
            facts["heads"] = int(json.loads(props[key])["num_heads"])
    for key, fact in (("damcha_vocab_size", "vocab_size"), ("damcha_max_len", "max_len")):
        if key in props:
            facts[fact] = int(props[key])
    return facts


def check_feed_shapes(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Check ``feeds`` against the model's declared input shapes before running it.

    onnxruntime would reject most bad shapes itself, but from deep inside a
    node ("invalid expand shape") or not at all: a mask one key too long
    used to fail in an Expand, a context with one extra batch row in a
    Reshape, and token ids past the position table were clamped. Here each
    rule names the input and the shape received.

    Raises:
        DamchaValueError: wrong rank, a fixed dim that differs, a symbolic dim
            (batch, query_len, past_len, ...) that two inputs disagree on, keys
            of length 0 for queries of length >= 1, a mask dim that is neither 1 nor its target, or
            token ids outside the vocabulary or past the position table.
    """
    declared = {i.name: _dims(i) for i in model.graph.input}
    facts = _model_facts(model)
    sizes: dict[str, tuple[int, str]] = {}

    def shape_text(dims: list) -> str:
        return "(" + ", ".join(str(d) for d in dims) + ")"

    for name, dims in declared.items():
        array = feeds[name]
        if array.ndim != len(dims):
            # A tokenizer's (B, M) mask fed to a 4-D mask input: the padding export takes it.
            hint = (
                "; a (B, M) key padding mask needs a model exported with mask='padding' (--mask padding)"
                if name == "mask" and len(dims) == 4 and array.ndim == 2
                else ""
            )
            raise DamchaValueError(
                invalid_argument(
                    name,
                    f"rank {len(dims)}, shape {shape_text(dims)} as the model declares{hint}",
                    f"{name}.shape={array.shape}",
                )
            )
        for axis, (dim, size) in enumerate(zip(dims, array.shape)):
            if isinstance(dim, int) and dim > 0 and size != dim:
                raise DamchaValueError(
                    invalid_argument(
                        name, f"shape {shape_text(dims)} (axis {axis} is fixed at {dim})", f"{name}.shape={array.shape}"
                    )
                )
            if not isinstance(dim, str) or dim in _MASK_DIMS:
                continue
            if name == "mask" and len(dims) == 4 and axis == 3 and size == 1:
                continue  # broadcast over the keys (the reference's rule: any dim of a 4-D mask may be 1)
            if size == 0 and dim not in _MAY_BE_EMPTY:
                raise DamchaValueError(
                    invalid_argument(name, f"a non-empty axis {axis} ({dim} >= 1)", f"{name}.shape={array.shape}")
                )
            if dim in sizes and sizes[dim][0] != size:
                other = sizes[dim][1]
                raise DamchaValueError(
                    invalid_argument(
                        name,
                        f"the size of `{other}` on {dim} (the model declares {name} {shape_text(dims)}, "
                        f"{other} {shape_text(declared[other])})",
                        f"{name}.shape={array.shape}, {other}.shape={feeds[other].shape}",
                    )
                )
            sizes.setdefault(dim, (size, name))
    if "total_len" in sizes and "past_len" in sizes and "query_len" in sizes:
        total, owner = sizes["total_len"]
        if total != sizes["past_len"][0] + sizes["query_len"][0]:
            raise DamchaValueError(
                invalid_argument(
                    owner,
                    "a span over the cache and the new tokens, total_len = past_len + query_len = "
                    f"{sizes['past_len'][0]} + {sizes['query_len'][0]}",
                    f"{owner}.shape={feeds[owner].shape}",
                )
            )
    if sizes.get("context_len", (1, ""))[0] == 0 and sizes.get("query_len", (0, ""))[0] != 0:
        owner = sizes["context_len"][1]
        raise DamchaValueError(invalid_argument(owner, NO_KEYS_RULE, f"{owner}.shape={feeds[owner].shape}"))
    known = {dim: size for dim, (size, _) in sizes.items()}
    if "heads" in facts:
        known["heads"] = facts["heads"]
    for name, dims in declared.items():
        for axis, dim in enumerate(dims):
            target = _MASK_DIMS.get(dim) if isinstance(dim, str) else None
            size = feeds[name].shape[axis]
            if target in known and size not in (1, known[target]):
                full = tuple(known.get(_MASK_DIMS.get(d, d), d) if isinstance(d, str) else d for d in dims)
                raise DamchaValueError(
                    invalid_argument(
                        name,
                        f"a shape broadcastable to {full} (axis {axis}, {target}, must be 1 or {known[target]})",
                        f"{name}.shape={feeds[name].shape}",
                    )
                )
    tokens = feeds.get("tokens")
    if (
        tokens is not None
        and "vocab_size" in facts
        and tokens.size
        and not (tokens.min() >= 0 and tokens.max() < facts["vocab_size"])
    ):
        # Gather would read -1 as the last row: a silent wrap, not an error.
        raise DamchaValueError(
            invalid_argument(
                "tokens",
                f"ids in [0, {facts['vocab_size']}) (the vocabulary)",
                f"tokens in [{tokens.min()}, {tokens.max()}]",
            )
        )
    if tokens is not None and "max_len" in facts:
        last = known.get("past_len", 0) + tokens.shape[-1]
        if last > facts["max_len"]:
            raise DamchaValueError(
                invalid_argument(
                    "tokens",
                    f"positions within the position table (max_len={facts['max_len']}); they reach {last - 1}",
                    f"tokens.shape={tokens.shape}"
                    + (f" after {known['past_len']} cached" if known.get("past_len") else ""),
                )
            )


def empty_outputs(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray] | None:
    """The outputs of an empty batch or of no query; None when the batch and the
    query length are both >= 1 (onnxruntime is then run).

    onnxruntime cannot run them (its Attention kernel needs batch and query
    length >= 1, the decomposed graph's Reshape cannot infer a dim of an empty
    tensor), and their outputs hold no value to compute: each is the empty
    array of its declared shape and dtype, as the framework ports return it,
    except a decode step's ``present_*`` cache, which is its ``past_*`` input
    when no token is appended (B >= 1, N = 0).

    Raises:
        DamchaValueError: an output whose size the feeds do not fix, naming
            the input that is empty.
    """
    declared = {i.name: _dims(i) for i in model.graph.input}
    sizes: dict[str, int] = {}
    for name, dims in declared.items():
        for dim, size in zip(dims, feeds[name].shape):
            if isinstance(dim, str):
                sizes.setdefault(dim, int(size))
    empty = [dim for dim in ("batch", "query_len") if sizes.get(dim) == 0]
    if not empty:
        return None
    if "past_len" in sizes and "query_len" in sizes:
        sizes["total_len"] = sizes["past_len"] + sizes["query_len"]
    owner = next(n for n, dims in declared.items() if empty[0] in dims)
    outputs = []
    for out in model.graph.output:
        dims = _dims(out)
        past = out.name.replace("present_", "past_", 1)
        if out.name.startswith("present_") and past in feeds and sizes.get("query_len") == 0:
            outputs.append(np.array(feeds[past]))  # nothing appended: the cache as it was
            continue
        if not all(isinstance(d, int) and d > 0 or d in sizes for d in dims):
            raise DamchaValueError(
                invalid_argument(
                    owner,
                    f"a non-empty {' and '.join(empty)}: onnxruntime cannot run an empty one, and the size of "
                    f"output `{out.name}` {tuple(dims)} is not fixed by the inputs",
                    f"{owner}.shape={feeds[owner].shape}",
                )
            )
        shape = tuple(d if isinstance(d, int) else sizes[d] for d in dims)
        outputs.append(np.zeros(shape, onnx.helper.tensor_dtype_to_np_dtype(out.type.tensor_type.elem_type)))
    return outputs


def _first_or_all(model: onnx.ModelProto, outputs: list, all_outputs: bool) -> np.ndarray | dict[str, np.ndarray]:
    if not all_outputs:
        return outputs[0]
    return {o.name: value for o, value in zip(model.graph.output, outputs)}


@overload
def run_ort(
    model: onnx.ModelProto | str | os.PathLike[str],
    inputs: Mapping[str, Any],
    *,
    session: Any = None,
    all_outputs: Literal[False] = False,
) -> np.ndarray: ...
@overload
def run_ort(
    model: onnx.ModelProto | str | os.PathLike[str],
    inputs: Mapping[str, Any],
    *,
    session: Any = None,
    all_outputs: bool,
) -> np.ndarray | dict[str, np.ndarray]: ...
def run_ort(
    model: onnx.ModelProto | str | os.PathLike[str],
    inputs: Mapping[str, Any],
    *,
    session: Any = None,
    all_outputs: bool = False,
) -> np.ndarray | dict[str, np.ndarray]:
    """First output of ``model`` (a ModelProto or an ``.onnx`` path) in onnxruntime's CPU provider.

    ``all_outputs=True`` returns every output by name instead (a decode step's
    ``present_key``/``present_value`` next to ``output``). An empty batch or no
    query gives the empty outputs without running onnxruntime, which refuses
    them (``empty_outputs``).
    """
    all_outputs = check_bool("all_outputs", all_outputs)
    # A path is run from the file (external data stays on disk); its graph is read for the feed checks.
    proto = as_model(model, load_weights=False)
    feeds = feeds_for(proto, inputs)
    empty = empty_outputs(proto, feeds)
    if empty is not None:
        return _first_or_all(proto, empty, all_outputs)
    if session is None:
        session = ort_session(model if not isinstance(model, onnx.ModelProto) else proto)
    else:
        _check_session(session, proto)
    return _first_or_all(proto, session.run(None, feeds), all_outputs)


def _check_session(session: Any, proto: onnx.ModelProto) -> None:
    """``session`` must be an onnxruntime session of ``proto``: the same inputs
    and outputs (names, element types, dims) and, where ``proto`` records its
    identity (``damcha_model_digest``), the same one in the session's metadata.
    A session made for another model (an .ort file of another export, with the
    same names) would run that model on these feeds and return its outputs as
    this model's."""
    # Duck-typed: a wrapper around a session (profiling, a test's fault injector) is one too.
    if not all(callable(getattr(session, m, None)) for m in ("run", "get_inputs", "get_outputs")):
        raise DamchaTypeError(
            invalid_argument(
                "session",
                "an onnxruntime.InferenceSession (from ort_session) or None",
                f"session={describe_value(session)}",
            )
        )
    ours = [_signature(v) for v in proto.graph.input], [_signature(v) for v in proto.graph.output]
    theirs = (
        [(a.name, a.type, list(a.shape)) for a in session.get_inputs()],
        [(a.name, a.type, list(a.shape)) for a in session.get_outputs()],
    )
    if not (_same_values(ours[0], theirs[0]) and _same_values(ours[1], theirs[1])):
        raise DamchaValueError(
            invalid_argument(
                "session",
                f"a session of this model ({_signature_text(ours)})",
                f"a session with {_signature_text(theirs)}",
            )
        )
    digest = next((p.value for p in proto.metadata_props if p.key == DIGEST_KEY), None)
    meta = getattr(session, "get_modelmeta", None)
    if digest is None or not callable(meta):
        return  # a model without a recorded identity (or a wrapper without metadata): its signature was checked
    other = dict(getattr(meta(), "custom_metadata_map", {}) or {}).get(DIGEST_KEY)
    if other != digest:
        raise DamchaValueError(
            invalid_argument(
                "session",
                f"a session of this model ({DIGEST_KEY} {digest[:16]}..., the digest of its graph and weights)",
                "a session of another model with the same inputs and outputs ("
                + (f"{DIGEST_KEY} {other[:16]}...)" if other else f"no {DIGEST_KEY} in its metadata)"),
            )
        )


def _signature(value: onnx.ValueInfoProto) -> tuple[str, str, list[str | int | None] | None]:
    """A graph input's or output's (name, type, dims) as onnxruntime's ``NodeArg`` reports them
    (dims None: the graph declares no shape)."""
    t = value.type.tensor_type
    dims = (
        [d.dim_param if d.dim_param else d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if t.HasField("shape")
        else None
    )
    return value.name, f"tensor({onnx.TensorProto.DataType.Name(t.elem_type).lower()})", dims


def _same_values(ours: list, theirs: list) -> bool:
    """The same names and types in order, and no dim fixed to different sizes on the
    two sides. A symbolic dim may be fixed in a session (onnxruntime's free-dimension
    overrides) and a session reports the inferred shape of an output the graph
    declares without one: neither makes it another model's session."""
    if len(ours) != len(theirs):
        return False
    for (name, kind, dims), (other_name, other_kind, other_dims) in zip(ours, theirs):
        if name != other_name or kind != other_kind:
            return False
        if dims is None or other_dims is None:
            continue
        if len(dims) != len(other_dims) or any(
            isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(dims, other_dims)
        ):
            return False
    return True


def _signature_text(signature: tuple[list, list]) -> str:
    """inputs [names], outputs [names]: each as name type (dims)."""
    inputs, outputs = signature

    def shape(dims: list | None) -> str:
        return "shape not declared" if dims is None else ", ".join(str(d) for d in dims)

    detail = "; ".join(f"{n} {t} ({shape(dims)})" for n, t, dims in inputs + outputs)
    return f"inputs {[v[0] for v in inputs]}, outputs {[v[0] for v in outputs]}: {detail}"


@overload
def run_reference(
    model: onnx.ModelProto | str | os.PathLike[str],
    inputs: Mapping[str, Any],
    *,
    evaluator: Any = None,
    all_outputs: Literal[False] = False,
) -> np.ndarray: ...
@overload
def run_reference(
    model: onnx.ModelProto | str | os.PathLike[str],
    inputs: Mapping[str, Any],
    *,
    evaluator: Any = None,
    all_outputs: bool,
) -> np.ndarray | dict[str, np.ndarray]: ...
def run_reference(
    model: onnx.ModelProto | str | os.PathLike[str],
    inputs: Mapping[str, Any],
    *,
    evaluator: Any = None,
    all_outputs: bool = False,
) -> np.ndarray | dict[str, np.ndarray]:
    """First output of ``model`` in ``onnx.reference.ReferenceEvaluator`` (pure Python).

    ``evaluator`` reuses a ``ReferenceEvaluator(model)`` across calls;
    ``all_outputs`` as for ``run_ort``.
    """
    all_outputs = check_bool("all_outputs", all_outputs)
    model = as_model(model)
    feeds = feeds_for(model, inputs)
    empty = empty_outputs(model, feeds)  # as run_ort, so the two agree on empty inputs
    if empty is not None:
        return _first_or_all(model, empty, all_outputs)
    check_weights_inline(model)  # as run_ort's session: the evaluator would fail on the missing weights
    if evaluator is None:
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
    return _first_or_all(model, evaluator.run(None, feeds), all_outputs)


def empty_kv_cache(model: onnx.ModelProto | str | os.PathLike, batch_size: int) -> dict[str, np.ndarray]:
    """Zero-length ``past_*`` inputs (P = 0) of a ``kv_cache=True`` export: the first decode step's cache.

    Args:
        model: a layer, encoder or token model exported with ``kv_cache=True`` (or its ``.onnx`` path).
        batch_size: B; 0 is an empty batch, which ``run_ort``/``run_reference`` decode without running
            the graph (``empty_outputs``: each step's outputs are empty, the cache (0, G, P, d)).

    Returns:
        ``{"past_key[.i]": (B, G, 0, d), "past_value[.i]": (B, G, 0, d_v)}`` in the model's dtype.
    """
    batch_size = check_int("batch_size", batch_size, minimum=0)
    model = as_model(model, load_weights=False)
    cache = {}
    for value in model.graph.input:
        if value.name.startswith(("past_key", "past_value")):
            t = value.type.tensor_type
            dims = [d.dim_value for d in t.shape.dim]
            if dims[0] > 0 and batch_size != dims[0]:  # a dynamic=False export fixes B
                raise DamchaValueError(
                    invalid_argument(
                        "batch_size",
                        f"the model's fixed batch size {dims[0]} (it was exported with dynamic=False; "
                        f"{value.name} is declared ({', '.join(str(d or '?') for d in _dims(value))}))",
                        f"batch_size={batch_size}",
                    )
                )
            cache[value.name] = np.zeros(
                (int(batch_size), dims[1], 0, dims[3]), onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
            )
    if not cache:
        raise DamchaValueError(
            invalid_argument(
                "model",
                "a model with past_key/past_value inputs (export it with kv_cache=True)",
                f"model with inputs {[v.name for v in model.graph.input]}",
            )
        )
    return cache
