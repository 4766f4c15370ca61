"""Checking, validating and writing ONNX files: output paths checked before any
work, large models with external data, every file replaced atomically."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.external_data_helper

from damcha_core import DamchaTypeError, DamchaValueError, check_bool, describe, invalid_argument
from damcha_core._cliutil import atomic_write, link_target_problem, read_only, replace_synced, writable_dir

#: protobuf refuses to serialise (or even size) one message of 2 GiB or more:
#: ``onnx.save_model`` raises a raw EncodeError there.
PROTOBUF_LIMIT = 2**31 - 1
#: Exports whose weights pass this many bytes are saved with their weights in
#: an external data file, automatically; the margin leaves room for the graph,
#: names and metadata. Tests lower it.
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT - (64 << 20)
#: Tensors below this many bytes stay inside the ``.onnx`` file.
EXTERNAL_DATA_MIN_BYTES = 1024


#: What a model file's path must look like, for the Python API and ``damcha export --out`` alike.
ONNX_PATH_RULE = (
    "a .onnx file path with a name before the suffix (any case: .ONNX too; onnx.save_model writes "
    "text for .json/.textproto/.onnxtxt, which onnxruntime cannot load, and the .int8.onnx/.ort "
    "names derive from the .onnx stem)"
)


def is_onnx_path(path: str) -> bool:
    """Whether ``path`` ends in ``.onnx`` (any case) after a non-empty file name."""
    base = os.path.basename(path)
    return base.lower().endswith(".onnx") and len(base) > len(".onnx")


def check_path(path: Any, name: str = "path") -> str | None:
    """``path`` as a ``str`` (or ``None``): a ``.onnx`` file path whose directory
    exists and takes a new file (probed: one is created and removed), not a
    directory, not a read-only file. Called before any work is done."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise DamchaTypeError(invalid_argument(name, "a file path or None", f"{name}={describe(path)}"))
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise DamchaValueError(invalid_argument(name, "a non-empty file path", f"{name}={path!r}"))
    if os.path.isdir(path):
        raise DamchaValueError(invalid_argument(name, "a file path, not a directory", f"{name}={path!r}"))
    if not is_onnx_path(path):
        raise DamchaValueError(invalid_argument(name, ONNX_PATH_RULE, f"{name}={path!r}"))
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DamchaValueError(
            invalid_argument(name, "a path in an existing directory", f"{name}={path!r} ({parent!r} does not exist)")
        )
    # read_only, not os.access alone: root may write anything, yet a file
    # without write bits was marked by its owner as not to be replaced.
    if os.path.isfile(path) and read_only(path):
        raise DamchaValueError(
            invalid_argument(name, "a path that is not a read-only file (it is not replaced)", f"{name}={path!r}")
        )
    # A file created and removed there, not os.access (yes for root, also where no
    # file can be created): else the export fails after its work, with a raw OSError.
    if not writable_dir(parent):
        raise DamchaValueError(
            invalid_argument(
                name, "a path in a writable directory", f"{name}={path!r} (no file can be created in {parent!r})"
            )
        )
    data = read_only_data_file(path)
    if data is not None:
        raise DamchaValueError(
            invalid_argument(
                name,
                "a path whose data file is not read-only (an export replaces or removes <path>.data)",
                f"{name}={path!r} ({data!r} is read-only)",
            )
        )
    problem = link_target_problem(path)  # a one-file model is written through a link
    if problem is not None:
        raise DamchaValueError(invalid_argument(name, problem[0], f"{name}={path!r} ({problem[1]})"))
    return path


#: Metadata key of a model's identity: a SHA-256 digest of its graph, metadata
#: and weights, which ``run_ort(..., session=)`` compares with the session's
#: (onnxruntime keeps ``metadata_props``, also in ``.ort`` files).
DIGEST_KEY = "damcha_model_digest"


def content_digest(head: bytes, arrays: Iterable[tuple[str, np.ndarray]]) -> str:
    """SHA-256 of ``head`` (a graph without its weights, serialised) and of each
    weight's name, dtype, shape and bytes, read in place (no copy of a large model)."""
    digest = hashlib.sha256(head)
    for name, array in arrays:
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(np.ascontiguousarray(array))  # type: ignore[arg-type]
    return digest.hexdigest()


def derived_digest(model: onnx.ModelProto, how: str) -> str | None:
    """The identity of a model made from ``model`` by a deterministic step
    ``how`` (a quantiser and its settings), or None when ``model`` has none."""
    source = next((p.value for p in model.metadata_props if p.key == DIGEST_KEY), None)
    return None if source is None else hashlib.sha256(f"{source}\0{how}".encode()).hexdigest()


def set_metadata(model: onnx.ModelProto, key: str, value: str | None) -> None:
    """Set ``key`` in ``model.metadata_props`` (``None``: remove it), keeping the other entries."""
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    for k, v in kept + ([] if value is None else [(key, value)]):
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v


def model_size(model: onnx.ModelProto) -> int:
    """Serialised size in bytes; protobuf's limit + 1 for a message too large to size."""
    try:
        return model.ByteSize()
    except Exception:  # noqa: BLE001 - google.protobuf EncodeError: over 2 GiB
        return PROTOBUF_LIMIT + 1


def is_large(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is too large to serialise safely as one protobuf message."""
    return model_size(model) > EXTERNAL_DATA_THRESHOLD


def needs_external_data(nbytes: int, external_data: bool | None) -> bool:
    """``external_data`` itself, or (``None``) whether weights of ``nbytes`` are too large for one protobuf file.

    Raises:
        DamchaValueError: ``external_data=False`` for weights over protobuf's 2 GiB limit.
    """
    if external_data is None:
        return nbytes > EXTERNAL_DATA_THRESHOLD
    if not external_data and nbytes > PROTOBUF_LIMIT:
        raise DamchaValueError(
            invalid_argument(
                "external_data",
                "True or None (automatic) for a model over protobuf's 2 GiB limit (it cannot be saved in one file)",
                f"external_data=False, a model with {nbytes} bytes of weights",
            )
        )
    return bool(external_data)


def data_file_name(path: str) -> str:
    """The external data file of ``path``: ``<file name>.data`` beside it."""
    return os.path.basename(path) + ".data"


def read_only_data_file(path: str) -> str | None:
    """``<path>.data`` when it exists and is read-only, else ``None``: an external-data
    export would replace it and a one-file export removes it, and a read-only file is
    never replaced or removed. (A data file name the OS refuses exists nowhere: None.)"""
    data = os.path.join(os.path.dirname(os.path.abspath(path)), data_file_name(path))
    return data if os.path.isfile(data) and read_only(data) else None


def check_data_file(path: str, name: str = "path") -> None:
    """Refuse a ``path`` whose external data file ``<path>.data`` cannot be
    written because a folder sits there: called before any work when the
    weights will go there, since the rename that puts the data file in place
    would fail after the export's whole work.

    Raises:
        DamchaValueError: naming ``name``, the path and the data file.
    """
    data = os.path.join(os.path.dirname(os.path.abspath(path)), data_file_name(path))
    # A rename replaces a file, a link (even to a folder) or a special file, never a folder.
    if os.path.isdir(data) and not os.path.islink(data):
        raise DamchaValueError(
            invalid_argument(
                name,
                "a path whose external data file <path>.data can be written (with external data the weights go "
                "there): move or rename what is there, choose another path, or pass external_data=False "
                "(weights in the .onnx file, up to protobuf's 2 GiB)",
                f"{name}={path!r} ({data!r} is a folder)",
            )
        )


@contextlib.contextmanager
def _staging(path: str) -> Iterator[str]:
    """A private directory beside ``path`` (same file system, so os.replace is atomic); removed afterwards."""
    tmp = tempfile.mkdtemp(prefix=".damcha-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        yield tmp
    finally:
        for entry in os.listdir(tmp):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(tmp, entry))
        with contextlib.suppress(OSError):
            os.rmdir(tmp)


def _write_arrays(path: str, arrays: Sequence[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for array in arrays:
            # No copy of a (possibly multi-GiB) array. ndarray has the buffer protocol; NumPy's stubs
            # declare it (__buffer__) only for Python >= 3.12.
            f.write(memoryview(np.ascontiguousarray(array)).cast("B"))  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())


def _validate_file(path: str) -> None:
    """The checks of ``validate_model``, read from disk (external data beside ``path``)."""
    onnx.checker.check_model(path, full_check=True)
    # The inferred copy gets a short name of its own beside ``path`` (``path + ".inferred"``
    # passed the OS's 255-byte name limit for a valid --out of 247 bytes or more).
    fd, inferred = tempfile.mkstemp(suffix=".inferred.onnx", dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        onnx.shape_inference.infer_shapes_path(path, inferred, check_type=True, strict_mode=True, data_prop=True)
    finally:
        os.remove(inferred)


def save_validated(model: onnx.ModelProto, path: str, arrays: Sequence[np.ndarray] | None = None) -> list[str]:
    """Write ``model`` beside ``path``, validate it from disk (``onnx.checker``
    full check, strict shape inference), then move it into place; returns the
    files written. Nothing reaches ``path`` unless the checks pass.

    With ``arrays`` the model's large initialisers refer to ``<path>.data``,
    written here from ``arrays`` end to end, and moved into place before the
    ``.onnx`` file (which must never point at an old data file); without,
    the weights are inline and a stale ``<path>.data`` of an earlier export
    is removed. Checking the written file, not the ModelProto, keeps the
    peak memory of a large export near one copy of the weights: the checker
    and shape inference each serialise a ModelProto they are given.
    """
    path = check_path(path)  # type: ignore[assignment]
    if arrays is not None:
        check_data_file(path)
    if arrays is None and os.path.islink(path):  # written through, as atomic_write does
        path = os.path.realpath(path)
    directory = os.path.dirname(os.path.abspath(path))
    names = [os.path.basename(path)] + ([] if arrays is None else [data_file_name(path)])
    with _staging(path) as tmp:
        staged = [os.path.join(tmp, n) for n in names]
        onnx.save_model(model, staged[0])
        if arrays is not None:
            _write_arrays(staged[1], arrays)
        _validate_file(staged[0])
        # The data file first: the new .onnx must never point at an old data file.
        replace_synced([(file, os.path.join(directory, name)) for file, name in zip(reversed(staged), reversed(names))])
    if arrays is None:
        remove_stale_data(path)
    return [os.path.join(directory, n) for n in names]


def save_model(model: onnx.ModelProto, path: str | os.PathLike[str], *, external_data: bool | None = None) -> list[str]:
    """Write an in-memory ``model`` to ``path`` atomically; returns the files written.

    With external data (``external_data=True``, or ``None`` and a model too
    large for one protobuf), the weights go to ``<path>.data`` beside the
    ``.onnx`` file, which refers to it by that relative name. Either way a
    failure leaves any earlier file at ``path`` untouched and no partial file.
    """
    target = check_path(path)
    assert target is not None  # None only for path=None, which the annotation excludes
    if external_data is not None:
        external_data = check_bool("external_data", external_data)
    if not needs_external_data(model_size(model), external_data):
        # One file: the core's atomic writer (a temporary file beside it, then one rename).
        if os.path.islink(target):  # written through, as atomic_write does: the stale data file is the file's
            target = os.path.realpath(target)
        with atomic_write(target, "wb") as f:
            f.write(model.SerializeToString())
        remove_stale_data(target)
        return [target]
    check_data_file(target)
    directory = os.path.dirname(os.path.abspath(target))
    names = [os.path.basename(target), data_file_name(target)]
    with _staging(target) as tmp:
        # save_as_external_data rewrites the tensors of the proto it is given:
        # save a copy, so the caller's model keeps its weights in memory.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save_model(
            copy,
            os.path.join(tmp, names[0]),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=names[1],
            size_threshold=EXTERNAL_DATA_MIN_BYTES,
            convert_attribute=False,
        )
        staged = [n for n in names if os.path.exists(os.path.join(tmp, n))]
        replace_synced([(os.path.join(tmp, name), os.path.join(directory, name)) for name in reversed(staged)])
    return [os.path.join(directory, n) for n in staged]


def remove_stale_data(path: str) -> None:
    """Remove the data file an earlier external-data export left at ``path``: it would mislead readers."""
    stale = os.path.join(os.path.dirname(os.path.abspath(path)), data_file_name(path))
    if os.path.exists(stale):
        with contextlib.suppress(OSError):
            os.remove(stale)


def validate_model(model: onnx.ModelProto | str | os.PathLike[str]) -> onnx.ModelProto:
    """``onnx.checker`` (full check) and strict shape inference; returns the inferred model.

    ``model`` is a ModelProto or, as for the other helpers, the path of an
    ``.onnx`` file, checked from the file (an external data file beside it is
    read there; the returned model holds its weights in memory).

    Raises:
        DamchaTypeError: ``model`` is neither a ModelProto nor a path.
        DamchaValueError: a path that is missing, a directory, or not an ONNX
            model protobuf can parse, naming the path.
        onnx.checker.ValidationError / onnx.shape_inference.InferenceError:
            a model that breaks the ONNX rules.
    """
    if isinstance(model, onnx.ModelProto):
        onnx.checker.check_model(model, full_check=True)
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    path = _model_file(model)
    onnx.checker.check_model(path, full_check=True)
    with tempfile.TemporaryDirectory(prefix="damcha-validate-") as tmp:
        # From the file: the checker and shape inference then read external data
        # beside it, and a model over 2 GiB is never one protobuf in memory here.
        inferred = os.path.join(tmp, "inferred.onnx")
        onnx.shape_inference.infer_shapes_path(path, inferred, check_type=True, strict_mode=True, data_prop=True)
        proto = onnx.load(inferred, load_external_data=False)
    onnx.external_data_helper.load_external_data_for_model(proto, os.path.dirname(os.path.abspath(path)))
    return proto


def _model_file(model: Any, name: str = "model") -> str:
    """``model`` as the path of a file protobuf parses as a ModelProto."""
    expected = "an onnx.ModelProto or the path of a readable .onnx file"
    if not isinstance(model, (str, os.PathLike)):
        raise DamchaTypeError(invalid_argument(name, expected, f"{name}={describe(model)}"))
    path = os.fspath(model)
    if not isinstance(path, str):
        raise DamchaTypeError(invalid_argument(name, expected, f"{name}={describe(path)}"))
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "no such file"
        raise DamchaValueError(invalid_argument(name, expected, f"{name}={path!r} ({what})"))
    try:
        onnx.load(path, load_external_data=False)
    except Exception as exc:  # DecodeError, OSError: the file is not a model
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        raise DamchaValueError(
            invalid_argument(name, expected, f"{name}={path!r} ({type(exc).__name__}: {reason})")
        ) from exc
    return path


def write_staged(model: onnx.ModelProto, directory: str, file_name: str) -> str:
    """``model`` (in memory, possibly near the size limit) as ``directory/file_name``
    with external data beside it, for runtimes that read it from disk."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    target = os.path.join(directory, file_name)
    onnx.save_model(
        copy,
        target,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_file_name(file_name),
        size_threshold=EXTERNAL_DATA_MIN_BYTES,
    )
    return target
