"""Canonical parameters in safetensors, with the config in the file's metadata.

A file holds the tensors under their canonical names and, in its metadata,
``format = "damcha-v1"``, the config as JSON under ``damcha_config`` and a
checksum of the tensors under ``damcha_checksum`` (``"sha256:<hex>"``, see
``tensor_checksum``). Files written before the checksum existed still load.

Writes are atomic (a temporary file in the same folder, fsync, one rename), so
a target is never half-written and a failed write leaves an earlier file
intact; new files get the permissions the user's umask gives, a replaced file
keeps its own, and a read-only target is refused. Every problem with the file
raises a ``DamchaError`` that names the path and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._cliutil import atomic_file, link_target_problem, read_only
from ._config import DamchaConfig
from ._errors import DamchaError, DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._params import as_numpy, check_params_finite, detached

FORMAT = "damcha-v1"
CHECKSUM_KEY = "damcha_checksum"
#: ``"sha256:<hex>"`` of the ``damcha_config`` string: the tensors' checksum does not cover it, and a
#: flipped bit there (dropout 0.0 -> 0.1, another scale) loaded as another layer. Older files lack it.
CONFIG_CHECKSUM_KEY = "damcha_config_checksum"


def _text_checksum(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


_HEADER_LIMIT = 100_000_000  # safetensors' own bound on the JSON header
#: The floating dtypes a file may hold (NumPy names); safetensors has no float128.
_STORABLE = ("float16", "bfloat16", "float32", "float64")
#: The safetensors dtypes NumPy reads (BF16 is read here, see _read_bf16). Any other (F8_*, F4, ...) is refused
#: by name before safetensors' NumPy reader fails on it with a bare AttributeError.
_READABLE = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32", "F64", "C64")


def tensor_checksum(tensors: Mapping[str, np.ndarray]) -> str:
    """``"sha256:<hex>"`` over the tensors in sorted name order: for each, its
    name, dtype name, shape and little-endian bytes, each length-prefixed so
    that no two different sets of tensors hash the same stream."""
    entries = {}
    for name, value in tensors.items():
        array = np.asarray(value)
        entries[name] = (array.dtype.name, array.shape, _little_endian_bytes(array))
    return _checksum(entries)


def _little_endian_bytes(array: np.ndarray) -> memoryview:
    """``array``'s little-endian bytes as a flat view: no copy for a contiguous
    little-endian array (a multi-GiB layer must not be held twice to be hashed)."""
    little = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False))
    # NumPy's stubs declare the buffer protocol (__buffer__) only for Python >= 3.12.
    return memoryview(little.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _checksum(entries: Mapping[str, tuple[str, tuple[int, ...], bytes | memoryview]]) -> str:
    """``tensor_checksum`` over (dtype name, shape, little-endian bytes) per name."""
    digest = hashlib.sha256()

    def field(data: bytes | memoryview) -> None:
        digest.update(struct.pack("<Q", memoryview(data).nbytes))
        digest.update(data)

    for name in sorted(entries):
        dtype, shape, data = entries[name]
        field(name.encode("utf-8"))
        field(dtype.encode("ascii"))
        field(json.dumps(list(shape)).encode("ascii"))
        field(data)
    return "sha256:" + digest.hexdigest()


def _read_bf16(path: Path, header: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """The BF16 tensors of ``path`` as (shape, raw little-endian bytes).

    NumPy has no bfloat16 (it comes from ml_dtypes, which damcha_core does not
    depend on), so safetensors' NumPy reader fails on them unless ml_dtypes
    happens to be imported. They are read here from the header's offsets.
    """
    entries = {
        name: entry
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") == "BF16"
    }
    if not entries:
        return {}
    out = {}
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        for name, entry in entries.items():
            # _read_header checked the entry's form (_entry_end); the size must match the shape.
            shape, offsets = entry["shape"], entry["data_offsets"]
            if offsets[1] - offsets[0] != 2 * math.prod(shape):
                raise _unreadable(
                    path,
                    f"the header entry of tensor {name!r} is malformed: shape {shape} needs "
                    f"{2 * math.prod(shape)} bytes of BF16, its data_offsets {offsets} hold {offsets[1] - offsets[0]}",
                )
            f.seek(8 + length + offsets[0])
            out[name] = (tuple(shape), f.read(offsets[1] - offsets[0]))
    return out


def _widen_bf16(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    # bfloat16 is the top half of a float32: shifting the bits up is exact.
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


def _check_path(path: Any, *, argument: str = "path") -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise DamchaTypeError(invalid_argument(argument, "a str or os.PathLike", f"{argument}={describe(path)}"))
    text = os.fspath(path)
    if isinstance(text, bytes) or not text.strip():
        raise DamchaValueError(invalid_argument(argument, "a non-empty file path", f"{argument}={describe(path)}"))
    if "\0" in text:  # the OS refuses it with a bare ValueError ("embedded null byte")
        raise DamchaValueError(
            invalid_argument(argument, "a file path without NUL characters", f"{argument}={describe(text)}")
        )
    return Path(text)


def _as_numpy(value: Any, name: str) -> Any:
    # torch bfloat16 (no NumPy dtype) is saved widened to float32: exact.
    return as_numpy(value, f"params[{name!r}]") if hasattr(value, "shape") else value


def save_params(path: str | os.PathLike[str], params: Mapping[str, Any], config: DamchaConfig) -> None:
    """Write ``params`` (validated against ``config``) and the config to ``path``.

    Tensors keep their floating dtype; the metadata holds
    ``format = "damcha-v1"``, the config as JSON under ``damcha_config`` and
    a checksum of the tensors under ``damcha_checksum``. The file is written
    atomically (see the module docstring).

    Raises:
        DamchaTypeError, DamchaValueError: ``params`` do not match ``config``;
            ``path`` is not a usable file path (a folder, in a missing folder,
            a read-only file) or cannot be written.
    """
    from safetensors import SafetensorError  # lazy: only I/O needs safetensors
    from safetensors.numpy import save_file

    target = _check_path(path)
    if not isinstance(config, DamchaConfig):  # an EncoderConfig passed the checks, then failed on to_dict
        raise DamchaTypeError(
            invalid_argument(
                "config",
                "a DamchaConfig (a file holds one layer; a stack's params have no file format: save each layer's)",
                f"config={describe(config)}",
            )
        )
    if not isinstance(params, Mapping):
        raise DamchaTypeError(invalid_argument("params", "a mapping of name -> array", f"params={describe(params)}"))
    # A framework tensor that tracks gradients refuses NumPy conversion; its values are what is saved.
    params = {name: _as_numpy(value, name) for name, value in detached(params).items()}
    check_params_finite(params, config)
    tensors = {name: np.ascontiguousarray(np.asarray(params[name])) for name in config.param_shapes()}
    for name, array in tensors.items():
        if array.dtype.name not in _STORABLE:  # e.g. float128: safetensors has no such dtype
            raise DamchaTypeError(
                invalid_argument(
                    f"params[{name!r}]",
                    f"an array of one of the floating dtypes a safetensors file stores, {list(_STORABLE)} "
                    "(cast it; nothing is narrowed silently)",
                    f"params[{name!r}]={describe(array)}",
                )
            )
    config_text = json.dumps(config.to_dict(), sort_keys=True)
    metadata = {
        "format": FORMAT,
        "damcha_config": config_text,
        CHECKSUM_KEY: tensor_checksum(tensors),
        CONFIG_CHECKSUM_KEY: _text_checksum(config_text),
    }
    try:
        _check_target(target)
    except OSError as exc:  # a name too long, a loop of links: Path's checks raise these
        raise DamchaValueError(
            invalid_argument(
                "path", f"a usable file path; it cannot be checked ({exc.strerror or exc})", f"path={str(target)!r}"
            )
        ) from exc
    try:
        with atomic_file(target) as tmp:
            # save_file streams the tensors to the file; save() would build it as one bytes object first
            save_file(tensors, tmp, metadata=metadata)
    except (OSError, SafetensorError) as exc:
        raise DamchaValueError(
            invalid_argument(
                "path",
                f"a writable file path; it could not be written ({getattr(exc, 'strerror', None) or exc}), an earlier file there is "
                "unchanged",
                f"path={str(target)!r}",
            )
        ) from exc


def _check_target(target: Path) -> None:
    """Refuse a folder, a path in a missing folder and a read-only file as the target of a save."""
    if target.is_dir():
        raise DamchaValueError(invalid_argument("path", "a file path, not a directory", f"path={str(target)!r}"))
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise DamchaValueError(
            invalid_argument(
                "path", "a path in an existing folder", f"path={str(target)!r} (folder {str(folder)!r} does not exist)"
            )
        )
    if target.exists() and read_only(target):
        raise DamchaValueError(
            invalid_argument(
                "path", "a path that is not a read-only file (it is not replaced)", f"path={str(target)!r}"
            )
        )
    problem = link_target_problem(target)
    if problem is not None:
        raise DamchaValueError(invalid_argument("path", problem[0], f"path={str(target)!r} ({problem[1]})"))


def _unreadable(path: Path, what: str) -> DamchaValueError:
    return DamchaValueError(
        invalid_argument("path", f"a DAMCHA parameter file; this is not one: {what}", f"path={str(path)!r}")
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_end(path: Path, name: str, entry: Any) -> int:
    """Where the data of tensor ``name`` ends, after checking that its header
    entry has safetensors' form: a dtype name, a shape of ints >= 0 and
    ``data_offsets`` [begin, end] with 0 <= begin <= end."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("dtype"), str)
        and isinstance(shape, list)
        and all(_is_count(n) for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise _unreadable(
            path,
            f"the header entry of tensor {name!r} is malformed (expected dtype, shape and data_offsets [begin, end]): "
            f"{describe(entry)}",
        )
    return int(offsets[1])


def _read_header(path: Path) -> dict[str, Any]:
    """The safetensors JSON header of ``path``, after checking that the file is
    one: long enough, a JSON header, and tensor data of the announced size."""
    try:
        if not path.exists():
            raise DamchaValueError(
                invalid_argument("path", "an existing file; it does not exist", f"path={str(path)!r}")
            )
        if path.is_dir():
            raise DamchaValueError(
                invalid_argument("path", "a safetensors file, not a directory", f"path={str(path)!r}")
            )
        if not path.is_file():
            # A FIFO (or a device) would block open() or read() forever.
            raise DamchaValueError(
                invalid_argument(
                    "path", "a regular file; this is a named pipe, device or socket", f"path={str(path)!r}"
                )
            )
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if size == 0:
                raise _unreadable(path, "the file is empty")
            if len(prefix) < 8:
                raise _unreadable(path, f"the file is {size} bytes long, too short for a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, _HEADER_LIMIT):
                raise _unreadable(
                    path,
                    f"its first 8 bytes announce a {length}-byte header but the file is {size} bytes long "
                    "(not a safetensors file, or truncated)",
                )
            raw = f.read(length)
    except OSError as exc:
        raise DamchaValueError(
            invalid_argument(
                "path", f"a readable file; it cannot be read ({exc.strerror or exc})", f"path={str(path)!r}"
            )
        ) from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: "[[[[...]]]]"
        raise _unreadable(path, "its header is not safetensors JSON (not a safetensors file, or corrupted)") from None
    if not isinstance(header, dict):
        raise _unreadable(path, "its header is not a JSON object")
    needed = 0
    for name, entry in header.items():
        if name != "__metadata__":
            needed = max(needed, _entry_end(path, name, entry))
    held = size - 8 - length
    if held < needed:
        raise _unreadable(
            path, f"the file is truncated: its header describes {needed} bytes of tensors, it holds {held}"
        )
    return header


def load_params(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], DamchaConfig]:
    """Read a file written by ``save_params``; returns ``(params, config)``.

    Tensors keep their dtype, except bfloat16 ones (e.g. from a Keras
    bfloat16 layer), which come back as float32 holding the same values
    exactly: NumPy itself has no bfloat16.

    Raises:
        DamchaValueError: ``path`` is missing, a folder, unreadable, not a
            safetensors file or truncated; the file has no DAMCHA metadata or
            an invalid config; its tensors fail their stored checksum
            ("corrupted"); or they are missing, extra, mis-shaped or not
            finite for the stored config. Every message names the path.
    """
    from safetensors import SafetensorError, safe_open

    path = _check_path(path)
    header = _read_header(path)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or "damcha_config" not in metadata:
        keys = sorted(metadata) if isinstance(metadata, dict) else describe(metadata)
        # The format it does hold says what the file is (transformers' "pt", another version's).
        given = f", format={metadata['format']!r}" if isinstance(metadata, dict) and "format" in metadata else ""
        raise DamchaValueError(
            invalid_argument(
                "path",
                f"a DAMCHA parameter file, whose metadata has format={FORMAT!r} and damcha_config",
                f"path={str(path)!r}, metadata keys={keys}{given}",
            )
        )
    if not isinstance(metadata["damcha_config"], str):  # safetensors metadata values are strings
        raise _unreadable(path, f"its damcha_config metadata is not a string: {describe(metadata['damcha_config'])}")
    stored_config = metadata.get(CONFIG_CHECKSUM_KEY)
    if stored_config is not None and stored_config != _text_checksum(metadata["damcha_config"]):
        raise DamchaValueError(
            invalid_argument(
                "path",
                f"an intact file; it is corrupted: its damcha_config does not match the checksum stored when it "
                f"was saved ({CONFIG_CHECKSUM_KEY})",
                f"path={str(path)!r}",
            )
        )
    try:
        config = DamchaConfig.from_dict(json.loads(metadata["damcha_config"]))
    except (json.JSONDecodeError, RecursionError):
        raise _unreadable(path, "its damcha_config metadata is not valid JSON") from None
    except DamchaError as exc:
        raise _unreadable(path, f"its damcha_config metadata is not a valid config ({exc})") from None
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] not in _READABLE:
            argument = f"tensors in {str(path)!r}[{name!r}]"
            raise DamchaTypeError(
                invalid_argument(
                    argument,
                    "a real floating array (F16, BF16, F32 or F64 in the file)",
                    f"{argument} of dtype {entry['dtype']!r}, shape={tuple(entry['shape'])}",
                )
            )
    try:
        bf16 = _read_bf16(path, header)  # its own DamchaErrors name the path: outside the wrapper below
    except OSError as exc:
        raise _unreadable(path, f"its tensors cannot be read ({exc.strerror or exc})") from None
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            # safe_open is not iterable
            params = {name: f.get_tensor(name) for name in f.keys() if name not in bf16}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise _unreadable(path, f"its tensors cannot be read ({' '.join(str(exc).split())})") from None
    entries: dict[str, tuple[str, tuple[int, ...], bytes | memoryview]] = {
        name: ("bfloat16", shape, data) for name, (shape, data) in bf16.items()
    }
    for name, array in params.items():
        entries[name] = (array.dtype.name, array.shape, _little_endian_bytes(array))
    params.update({name: _widen_bf16(data, shape) for name, (shape, data) in bf16.items()})
    stored = metadata.get(CHECKSUM_KEY)
    if stored is not None and stored != _checksum(entries):
        raise DamchaValueError(
            invalid_argument(
                "path",
                f"an intact file; it is corrupted: its tensors do not match the checksum stored when it was saved "
                f"({CHECKSUM_KEY})",
                f"path={str(path)!r}",
            )
        )
    check_params_finite(params, config, argument=f"tensors in {str(path)!r}")
    return params, config
