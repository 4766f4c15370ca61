"""Checking, validating and writing ONNX files: output paths checked before any
work, large models with external data, every file replaced atomically."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator

import onnx

from damcha_core import DamchaTypeError, DamchaValueError, describe

#: protobuf refuses to serialise one message of 2 GiB or more (onnx.save_model
#: raises a raw EncodeError / ValueError there).
PROTOBUF_LIMIT = 2**31 - 1
#: Models whose in-memory size passes this are saved with their weights in an
#: external data file, automatically; the margin leaves room for the graph,
#: names and metadata that serialisation adds. Tests lower it.
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT - (64 << 20)
#: Tensors below this many bytes stay inside the ``.onnx`` file.
EXTERNAL_DATA_MIN_BYTES = 1024


def check_path(path: Any, name: str = "path") -> str | None:
    """``path`` as a ``str`` (or ``None``): a file path whose directory exists,
    not a directory, not a read-only file. Called before any work is done."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise DamchaTypeError(f"`{name}` must be a file path or None. Received: {name}={describe(path)}")
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise DamchaValueError(f"`{name}` must be a non-empty file path. Received: {name}={path!r}")
    if os.path.isdir(path):
        raise DamchaValueError(f"`{name}` must be a file path, not a directory. Received: {name}={path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DamchaValueError(f"`{name}` must be in an existing directory. Received: {name}={path!r} ({parent!r} does not exist)")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise DamchaValueError(f"`{name}` is a read-only file; it is not replaced. Received: {name}={path!r}")
    if not os.access(parent, os.W_OK):
        raise DamchaValueError(f"`{name}` must be in a writable directory. Received: {name}={path!r} ({parent!r} is read-only)")
    return path


def model_size(model: onnx.ModelProto) -> int:
    """Serialised size in bytes (protobuf computes it without serialising)."""
    return model.ByteSize()


def needs_external_data(model: onnx.ModelProto, external_data: bool | None) -> bool:
    """``external_data`` itself, or (``None``) whether the model is too large for one protobuf file."""
    if external_data is not None:
        return bool(external_data)
    return model_size(model) > EXTERNAL_DATA_THRESHOLD


def data_file_name(path: str) -> str:
    """The external data file of ``path``: ``<file name>.data`` beside it."""
    return os.path.basename(path) + ".data"


def _umask_mode() -> int:
    # Files get the user's umask, as open() would give them (tempfile uses 0600).
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


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


def write_staged(model: onnx.ModelProto, directory: str, file_name: str, *, external: bool) -> list[str]:
    """Write ``model`` as ``directory/file_name`` (+ ``file_name.data`` when
    ``external``) without touching ``model``; returns the files written."""
    target = os.path.join(directory, file_name)
    if not external:
        onnx.save_model(model, target)
        return [target]
    # save_as_external_data rewrites the tensors of the proto it is given, so
    # write a copy: the returned model keeps its weights in memory.
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(
        copy, target, save_as_external_data=True, all_tensors_to_one_file=True,
        location=data_file_name(file_name), size_threshold=EXTERNAL_DATA_MIN_BYTES, convert_attribute=False,
    )
    data = os.path.join(directory, data_file_name(file_name))
    return [target] + ([data] if os.path.exists(data) else [])


def save_model(model: onnx.ModelProto, path: str | os.PathLike, *, external_data: bool | None = None) -> list[str]:
    """Write ``model`` to ``path`` atomically; returns the files written.

    With external data (``external_data=True``, or ``None`` and a model too
    large for one protobuf), the weights go to ``<path>.data`` beside the
    ``.onnx`` file, which refers to it by that relative name. Both files are
    staged in a private directory beside ``path`` and moved into place with
    ``os.replace``: a failure leaves any earlier file at ``path`` untouched
    and no partial file behind.
    """
    path = check_path(path)
    assert path is not None
    external = needs_external_data(model, external_data)
    mode = _umask_mode()
    with _staging(path) as tmp:
        staged = write_staged(model, tmp, os.path.basename(path), external=external)
        for file in staged:
            os.chmod(file, mode)
        # The data file first: the new .onnx must never point at a missing or old data file.
        written = []
        for file in reversed(staged):
            final = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(file))
            os.replace(file, final)
            written.append(final)
    if not external:
        # A stale data file of an earlier external-data export would mislead readers.
        stale = os.path.join(os.path.dirname(os.path.abspath(path)), data_file_name(path))
        if os.path.exists(stale):
            with contextlib.suppress(OSError):
                os.remove(stale)
    return list(reversed(written))


def validate_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.checker`` (full check) and strict shape inference; returns the inferred model.

    A model too large for one protobuf message is checked from a temporary
    copy with external data (the checker and shape inference then read it
    from disk); the model itself is returned unchanged then.

    Raises ``onnx.checker.ValidationError`` or ``onnx.shape_inference.InferenceError``.
    """
    if model_size(model) <= EXTERNAL_DATA_THRESHOLD:
        onnx.checker.check_model(model, full_check=True)
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    with tempfile.TemporaryDirectory(prefix="damcha-validate-") as tmp:
        (target, *_) = write_staged(model, tmp, "model.onnx", external=True)
        onnx.checker.check_model(target, full_check=True)
        onnx.shape_inference.infer_shapes_path(
            target, os.path.join(tmp, "inferred.onnx"), check_type=True, strict_mode=True, data_prop=True
        )
    return model
