"""What every ``damcha`` subcommand shares: check every argument first, then work.

The rules (docs/cli.md): a bad argument, an unusable output path or a missing
optional dependency ends the command *before any work* with exit status 2
and one line on stderr naming the flag; outputs are written atomically, so a
failed run never leaves a partial file and never loses an earlier good one.
Exit statuses: 0 ok, 1 a check failed (a mismatch), 2 bad arguments.

- ``ArgumentParser``: ``argparse`` with one-line errors (exit 2).
- ``usage_error(flag, message, prog=...)``: print one line, exit 2.
- ``run_main(main, argv)``: a subcommand's ``main`` returning its status.
- ``int_arg(minimum)``: an argparse ``type=`` for bounded integers.
- ``check_output_file``/``check_output_dir``/``check_input_file``: path checks;
  ``writable_dir``: whether a file can be created in a folder (probed with one).
- ``require(module, extra, flag, prog=...)``: an optional import, with the
  smallest extra that installs it.
- ``atomic_write``/``atomic_file``/``atomic_dir``: write a file (an open file, or a temporary
  path for writers that take a name), or a folder of files, so
  that the target changes only once everything was written (synced to disk
  before the renames, their folders after: ``fsync_file``/``fsync_dir``).
  ``replace_synced``: those renames with their syncs, for writers that stage
  their files themselves (the ONNX exporter's model and data file).
- ``Progress``: a progress bar on a terminal (tqdm, from the ``reports``
  extra), plain lines otherwise.

This module imports the standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

#: The smallest ``damcha[...]`` extra that installs a module (top-level name).
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "jax": "jax",
    "jaxlib": "jax",
    "flax": "jax",
    "keras": "keras",
    "tensorflow": "keras",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "onnxscript": "onnx",
    "matplotlib": "reports",
    "rich": "reports",
    "tqdm": "reports",
    "sklearn": "experiments",  # scikit-learn: the bundled 8x8 digits of `damcha experiment digits`
    "safetensors": "",  # a core dependency: a broken install, not an extra
}

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def usage_error(flag: str, message: str, *, prog: str = "damcha") -> NoReturn:
    """Print ``"<prog>: error: <flag>: <message>"`` as one line on stderr and
    exit with status 2 (``SystemExit(2)``).

    Args:
        flag: the argument at fault as the user typed it (``--out``, ``TASK``).
        message: what is wrong and what was received.
        prog: the command, e.g. ``"damcha export"``.
    """
    head = f"{prog}: error: {flag}: " if flag else f"{prog}: error: "
    print(head + _one_line(message), file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def run_main(main: Callable[[Any], int], argv: Any = None) -> int:
    """``main(argv)``, with the ``SystemExit`` of a usage error (or of
    ``--help``) turned into the returned exit status, so that callers of a
    subcommand's ``main`` always get an int."""
    try:
        return int(main(argv) or 0)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (plus a pointer
    to ``--help``) and exit 2, like ``usage_error``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse reads "-1e-3" as an unknown option (its rule knows "-1" and "-0.5", not exponents), so
        # `--lrs -1e-3` said "expected at least one argument" instead of the value's own error.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str) -> NoReturn:
        # argparse words it "argument --seed: invalid int value: 'x'": the flag comes first.
        message = message.removeprefix("argument ")
        print(f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE)

    _relaxed: list[Any] = []  # the required arguments, while the first pass of parse_args relaxes them

    def format_usage(self) -> str:
        with self._as_declared():
            return super().format_usage()

    def format_help(self) -> str:
        # --help is acted on in parse_args's first pass: without this the
        # required flags were shown as optional ([--out OUT]).
        with self._as_declared():
            return super().format_help()

    @contextlib.contextmanager
    def _as_declared(self) -> Iterator[None]:
        relaxed = list(self._relaxed)
        for item in relaxed:
            item.required = True
        try:
            yield
        finally:
            for item in relaxed:
                item.required = False

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, but an unknown argument is reported before a missing one:
        argparse checks the required arguments first, so ``--bogus`` alone was
        reported as "the following arguments are required: task"."""
        args = list(sys.argv[1:] if args is None else args)
        # A first pass with nothing required finds the unknown ones.
        required: list[Any] = [action for action in self._actions if action.required]
        required += [group for group in self._mutually_exclusive_groups if group.required]
        for item in required:
            item.required = False
        self._relaxed = required
        try:
            _, unknown = self.parse_known_args(args, argparse.Namespace())
        finally:
            self._relaxed = []
            for item in required:
                item.required = True
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_args(args, namespace)


def int_arg(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=`` that reads an integer within ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer. Received: {text!r}") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            bounds = " and ".join(
                b
                for b in (None if minimum is None else f">= {minimum}", None if maximum is None else f"<= {maximum}")
                if b
            )
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}. Received: {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def writable_dir(path: str | os.PathLike[str]) -> bool:
    """Whether a file can be created in the folder ``path``, found by creating one.

    Permission bits do not tell: os.access says yes to root everywhere, also
    where no file can be created (/proc, a cgroup folder, some FUSE and
    network mounts). The probe is a temporary file of its own (O_TMPFILE,
    which has no name, or else a fresh name opened with O_EXCL, never an
    existing file) that is removed at once: it leaves nothing behind and
    touches no file of the user's. Shared by the CLIs' path checks and the
    ONNX API's ``check_path``."""
    path = Path(path)
    if not (path.is_dir() and os.access(path, os.W_OK | os.X_OK)):
        return False
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def read_only(path: str | os.PathLike[str]) -> bool:
    """Whether an existing file is read-only: not writable by this user, or
    without any write permission bit (refused even for root, who could
    write it: the owner marked it as not to be replaced)."""
    p = Path(path)
    return not os.access(p, os.W_OK) or p.stat().st_mode & 0o222 == 0


def _unusable_path(path: Any, flag: str, prog: str, exc: OSError | ValueError) -> NoReturn:
    """A path the operating system refuses to look at (a name too long, a NUL character, a
    loop of links) ends the command like any other bad path: exit 2, one line naming ``flag``."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    usage_error(flag, f"is not a usable path ({reason}). Received: {str(path)!r}", prog=prog)


def _checked_path(path: Any, flag: str, prog: str, what: str, check: Callable[[Path], Path]) -> Path:
    """``check(Path(path))``, with an empty path and a path the OS refuses to look at ending
    the command as every other bad path does (exit 2, one line naming ``flag``)."""
    if path is None or str(path).strip() == "":
        usage_error(flag, f"needs a {what}. Received: {path!r}", prog=prog)
    try:
        return check(Path(path))
    except (OSError, ValueError) as exc:
        _unusable_path(path, flag, prog, exc)


def check_output_file(
    path: str | os.PathLike[str] | None, flag: str, *, prog: str = "damcha", overwrite: bool = True
) -> Path:
    """Check that a file can be written at ``path`` before any work is done.

    The folder must exist and be writable; ``path`` must not be a folder, nor
    an existing read-only file (it would be silently replaced), nor any
    existing file when ``overwrite`` is False.

    Returns:
        ``path`` as a ``Path``. Exits 2 (``usage_error``) otherwise.
    """
    if isinstance(path, str) and path.endswith(("/", os.sep)) and path.strip("/" + os.sep):
        # pathlib drops the slash: `--json out.json/` wrote the file out.json.
        usage_error(flag, f"ends with a path separator (a folder), expected a file path. Received: {path!r}", prog=prog)
    return _checked_path(path, flag, prog, "file path", lambda p: _check_output_file(p, flag, prog, overwrite))


def _no_nul(p: Path, flag: str, prog: str) -> None:
    # pathlib reads a name with a NUL byte as "does not exist"; open() then raises a bare ValueError.
    if "\0" in str(p):
        usage_error(flag, f"is not a usable path (it contains a NUL character). Received: {str(p)!r}", prog=prog)


def _check_output_file(p: Path, flag: str, prog: str, overwrite: bool) -> Path:
    _no_nul(p, flag, prog)
    if p.is_dir():
        usage_error(flag, f"is a directory, expected a file path. Received: {str(p)!r}", prog=prog)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        usage_error(flag, f"folder {str(parent)!r} does not exist. Received: {str(p)!r}", prog=prog)
    if not writable_dir(parent):
        usage_error(flag, f"folder {str(parent)!r} is not writable. Received: {str(p)!r}", prog=prog)
    if p.exists():
        if not overwrite:
            usage_error(flag, f"file exists (choose another path or remove it). Received: {str(p)!r}", prog=prog)
        if read_only(p):
            usage_error(flag, f"file exists and is read-only; it is not replaced. Received: {str(p)!r}", prog=prog)
    problem = link_target_problem(p)  # before the work: the writer would fail (or replace a device) after it
    if problem is not None:
        usage_error(flag, f"expected {problem[0]}; {problem[1]}. Received: {str(p)!r}", prog=prog)
    return p


def check_output_dir(path: str | os.PathLike[str] | None, flag: str, *, prog: str = "damcha") -> Path:
    """Check that files can be written into the folder ``path`` (created when
    missing, with its parents) before any work is done.

    Returns:
        ``path`` as a ``Path``. Exits 2 (``usage_error``) otherwise.
    """
    return _checked_path(path, flag, prog, "folder path", lambda p: _check_output_dir(p, flag, prog))


def _check_output_dir(p: Path, flag: str, prog: str) -> Path:
    _no_nul(p, flag, prog)
    if p.exists() and not p.is_dir():
        usage_error(flag, f"exists and is not a folder. Received: {str(p)!r}", prog=prog)
    if p.is_symlink() and not p.exists():  # a dangling link or a loop: no folder can be made at its name
        usage_error(flag, f"is a symbolic link to no folder ({os.readlink(p)!r}). Received: {str(p)!r}", prog=prog)
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        usage_error(flag, f"{str(existing)!r} is not a folder. Received: {str(p)!r}", prog=prog)
    if not writable_dir(existing):
        usage_error(flag, f"folder {str(existing)!r} is not writable. Received: {str(p)!r}", prog=prog)
    return p


def check_input_file(path: str | os.PathLike[str] | None, flag: str, *, prog: str = "damcha") -> Path:
    """Check that ``path`` is an existing, readable file.

    Returns:
        ``path`` as a ``Path``. Exits 2 (``usage_error``) otherwise.
    """
    return _checked_path(path, flag, prog, "file path", lambda p: _check_input_file(p, flag, prog))


def _check_input_file(p: Path, flag: str, prog: str) -> Path:
    _no_nul(p, flag, prog)
    if not p.exists() and p.is_symlink():
        usage_error(flag, f"is a symbolic link to no file (dangling, or a loop). Received: {str(p)!r}", prog=prog)
    if not p.exists():
        usage_error(flag, f"file does not exist. Received: {str(p)!r}", prog=prog)
    if not p.is_file():
        usage_error(flag, f"is not a file. Received: {str(p)!r}", prog=prog)
    if not os.access(p, os.R_OK):
        usage_error(flag, f"file is not readable. Received: {str(p)!r}", prog=prog)
    return p


def install_hint(module: str, extra: str | None = None) -> str:
    """``pip install "damcha[<extra>]"`` for ``module`` (``extra`` defaults to
    the smallest one in ``EXTRAS``; never ``[all]``)."""
    extra = EXTRAS.get(module.split(".")[0], "") if extra is None else extra
    return f'pip install "damcha[{extra}]"' if extra else "pip install --force-reinstall damcha"


def available(module: str) -> bool:
    """Whether ``module`` is installed, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
        return False


def require(module: str, extra: str | None = None, flag: str = "", *, prog: str = "damcha", why: str = "") -> None:
    """Exit 2 with an install hint unless ``module`` is installed (checked
    without importing it, so the check costs nothing before the work).

    Args:
        module: the import name, e.g. ``"matplotlib"``.
        extra: the ``damcha[...]`` extra to name; default from ``EXTRAS``.
        flag: the flag that asked for it (empty: the command itself).
        prog: the command.
        why: what needs it, e.g. ``"the plots"``.
    """
    if not available(module):
        what = f" ({why})" if why else ""
        usage_error(flag, f"needs {module}{what}, which is not installed: {install_hint(module, extra)}", prog=prog)


def file_mode(target: str | os.PathLike[str]) -> int:
    """Mode for an output file: the existing file's (a replaced file keeps its permissions), else what the umask gives."""
    try:
        return os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush the folder ``path`` to disk, so that the names just created or renamed in it survive
    a power loss (a file's own fsync does not cover its name). Skipped silently where a folder
    cannot be opened (Windows) or the file system does not sync folders (EINVAL, ENOTSUP)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush the data of the file ``path`` to disk (before it is renamed into place)."""
    try:
        fd = os.open(path, os.O_RDWR)  # Windows flushes only a handle open for writing
    except PermissionError:  # a file its writer made read-only: POSIX syncs it read-only too
        fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_synced(moves: Sequence[tuple[str | os.PathLike[str], str | os.PathLike[str]]]) -> None:
    """``os.replace(src, dest)`` for each pair, in the order given, durably: every ``src`` is
    synced to disk before the first rename and each destination folder after the last, so a
    power loss leaves under each name the old file or the whole new one (a rename alone can
    leave an empty file there, or lose the name). Each ``src`` first takes the mode ``dest``
    has (a replaced file keeps its permissions), or the umask's for a new name."""
    _prepare_moves(moves)
    _replace_synced_files(moves)


def _prepare_moves(moves: Sequence[tuple[str | os.PathLike[str], str | os.PathLike[str]]]) -> None:
    """Give each source its destination's mode (``file_mode``) and sync it to disk."""
    for src, dest in moves:
        os.chmod(src, file_mode(dest))
        fsync_file(src)


def _replace_synced_files(moves: Sequence[tuple[str | os.PathLike[str], str | os.PathLike[str]]]) -> None:
    """``replace_synced`` for sources already synced: the renames, then each destination folder's sync."""
    for src, dest in moves:
        os.replace(src, dest)
    for folder in dict.fromkeys(os.path.dirname(os.path.abspath(dest)) for _, dest in moves):
        fsync_dir(folder)


def _temp_prefix(target: Path) -> str:
    """The prefix of the temporary name beside ``target``: its name, cut so that the temporary
    name (prefix, 8 random characters, ``.tmp``) stays within the usual 255-byte limit on a
    name whenever ``target``'s own name does (a 250-byte name was accepted by the checks and
    its write failed only after the work)."""
    return f".{target.name.encode('utf-8')[:_TEMP_NAME_BYTES].decode('utf-8', 'ignore')}."


_TEMP_NAME_BYTES = 200


def special_file(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is (after following links) when it exists and is neither a
    regular file nor a folder: ``"a named pipe"``, ``"a device"``, ``"a socket"``;
    else ``None``. The atomic writers replace their target by a rename, which would
    turn ``/dev/null`` or a pipe into a regular file, so they refuse these."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


_STREAMS = ((1, "standard output"), (2, "standard error"), (0, "standard input"))


def standard_stream(path: str | os.PathLike[str]) -> str | None:
    """Which of this process's standard streams ``path`` is the file of (after following links),
    e.g. ``"standard output (fd 1)"``, else ``None``: ``/dev/stdout``, ``/proc/self/fd/1`` or
    ``/dev/fd/2``, and ``log.txt`` itself while ``> log.txt`` sends standard output there. The
    atomic writers replace a file by a rename; renaming over the stream's file takes that name from
    the stream, and what the command prints there (``damcha conform``'s table) is lost with the
    old file. Compared by device and inode, so every spelling of the path is found."""
    try:
        target = os.stat(path)
    except (OSError, ValueError):
        return None
    for fd, name in _STREAMS:
        try:
            stream = os.fstat(fd)
        except OSError:  # closed
            continue
        if (stream.st_dev, stream.st_ino) == (target.st_dev, target.st_ino):
            return f"{name} (fd {fd})"
    return None


def link_target_problem(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """For a ``path`` the atomic writers would replace: ``(what was expected,
    what is wrong)`` when it is (or links to) a device, pipe or socket, which a
    rename would replace by a regular file, or the file of one of this process's
    standard streams (``standard_stream``: ``--json /dev/stdout > log.txt``), or a
    symbolic link, which they write through, whose file cannot be written (a loop
    of links; a target folder that is missing or takes no file), so that callers
    refuse it by name before any work. ``None`` when it can be written (a dangling
    link is fine: its file is created)."""
    kind = special_file(path)
    if kind is not None:
        return "a regular file (it is replaced by a rename)", f"it is {kind}"
    stream = standard_stream(path)
    if stream is not None:
        # Refused, not written in place: the command's own output goes to that file too, so in
        # place the two would be interleaved, and a rename loses what the stream writes.
        return (
            "a file of its own, not the file of one of this process's standard streams (it is replaced by a rename)",
            f"it is the file of {stream}, whose output would be lost; write to another path",
        )
    if not os.path.islink(path):
        return None
    try:
        os.path.realpath(path, strict=True)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a loop of links
        return "a path that resolves to a file", str(exc.strerror or exc)
    real = os.path.dirname(os.path.realpath(path))
    if not (os.path.isdir(real) and writable_dir(real)):
        return (
            "a symbolic link into an existing, writable folder (the file is written through it)",
            f"it points into {real!r}, where no file can be created",
        )
    return None


@contextlib.contextmanager
def _replacing(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """(descriptor, name) of a new temporary file beside ``path`` (created
    exclusively by ``mkstemp``); on a clean exit it is synced and renamed over
    ``path``, on an exception removed. The rules of ``atomic_write``."""
    target = Path(path)
    if target.is_symlink():  # replacing the link itself would silently cut it from its file
        target = Path(os.path.realpath(target))
    if target.exists() and read_only(target):
        raise PermissionError(f"{str(target)!r} is read-only; not replacing it")
    kind = special_file(target)
    if kind is not None:  # the rename would leave a regular file where the device or pipe was
        raise PermissionError(f"{str(target)!r} is {kind}, not a regular file; not replacing it")
    stream = standard_stream(target)
    if stream is not None:  # the rename would lose what the process writes to that stream
        raise PermissionError(f"{str(path)!r} is the file of this process's {stream}; not replacing it")
    folder = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(target), suffix=".tmp", dir=folder)
    try:
        yield fd, tmp
        fsync_file(tmp)
        os.chmod(tmp, file_mode(target))
        os.replace(tmp, target)
        fsync_dir(folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield the path of a new, empty temporary file next to ``path``, for a
    writer that takes a file name (``safetensors``' ``save_file`` streams the
    tensors to it, where its in-memory ``save`` builds the whole file as one
    bytes object first). On a clean exit that file replaces ``path`` as in
    ``atomic_write``, with the same rules (read-only refused, permissions,
    syncing, symbolic links written through); on an exception it is removed.
    """
    with _replacing(path) as (fd, tmp):
        os.close(fd)
        yield tmp


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path`` for writing; on a clean exit it
    replaces ``path`` in one rename (with the old file's permissions, or the
    umask's for a new file). On an exception the temporary file is removed
    and ``path`` is untouched. A read-only ``path`` is refused
    (``PermissionError``), never silently replaced. The file is synced to disk
    before the rename and its folder after it (``fsync_dir``), so a power loss
    leaves the old file or the whole new one under ``path``. A ``path`` that
    is a symbolic link is written through, as ``open(path, "w")`` would: the
    file it points to is replaced and the link stays.
    """
    # Written through the descriptor mkstemp created exclusively, never reopened by name.
    with _replacing(path) as (fd, _), os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
        yield f


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically (see ``atomic_write``)."""
    with atomic_write(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``path``; write the outputs
    there. On a clean exit each file is moved into ``path`` (created if
    missing) with one rename per file, so files of ``path`` that were not
    rewritten stay, and none is ever half-written. On an exception the
    temporary folder is removed and ``path`` is untouched.

    Everything that would stop the moves midway (a read-only folder or file,
    a file where the outputs have a folder) is checked before the first
    rename and raised as an ``OSError`` naming that path, so a refused write
    leaves the old outputs whole rather than half old, half new. (Only an
    I/O error during the renames themselves could still stop them midway.)

    Durability (a power loss): every file is synced to disk before the first
    rename, and after the last one every folder that received a name (``path``,
    its subfolders, and ``path``'s parent when ``path`` was created), so no name
    survives pointing at data that did not. The temporary folder itself needs no
    sync: it is removed, and nothing is read from it after a crash.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not writable_dir(target.parent):  # else mkdtemp's error names a temporary folder, not this one
        raise PermissionError(f"{str(target.parent)!r} is not writable; {str(target)!r} was not written")
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        entries = sorted(tmp.rglob("*"))
        folders = [target] + [target / src.relative_to(tmp) for src in entries if src.is_dir()]
        moves = [(src, target / src.relative_to(tmp)) for src in entries if not src.is_dir()]
        _check_moves(target, folders, [dest for _, dest in moves])
        created = not target.exists()
        _prepare_moves(moves)  # the slow part, before any folder is made: an interrupt here leaves no trace
        made = [folder for folder in folders if not folder.exists()]
        try:
            for folder in folders:
                folder.mkdir(exist_ok=True)
            _replace_synced_files(moves)  # synced above
        except BaseException:
            # Interrupted (Ctrl-C) or failed before a file arrived: no empty new folder is left behind.
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only an empty one
            raise
        receivers = {dest.parent for _, dest in moves}  # _replace_synced_files synced these
        for folder in folders:
            if folder not in receivers:  # a new folder may hold only (empty) folders
                fsync_dir(folder)
        if created:
            fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_moves(target: Path, folders: list[Path], files: list[Path]) -> None:
    """Raise, naming the path, for anything that would stop ``atomic_dir``'s moves midway."""
    untouched = f"nothing in {str(target)!r} was replaced"
    for folder in folders:
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                raise NotADirectoryError(f"{str(folder)!r} exists and is not a folder; {untouched}")
            if not writable_dir(folder):  # a new folder is made in one checked here or in target's parent
                raise PermissionError(f"{str(folder)!r} is not writable; {untouched}")
    for dest in files:
        if dest.is_dir():
            raise IsADirectoryError(f"{str(dest)!r} is a folder, not replaced by a file; {untouched}")
        if dest.exists() and read_only(dest):
            raise PermissionError(f"{str(dest)!r} is read-only; not replacing it; {untouched}")
        stream = standard_stream(dest)
        if stream is not None:
            raise PermissionError(f"{str(dest)!r} is the file of this process's {stream}; {untouched}")


class Progress:
    """Progress of ``total`` steps on stderr: a tqdm bar on a terminal when
    tqdm (``damcha[reports]``) is installed, otherwise one plain line per step
    (logs and CI stay readable).

    Args:
        total: the number of steps.
        label: what is counted, shown before the bar or on each line.
        enabled: False prints nothing.
        stream: default ``sys.stderr``.
    """

    def __init__(
        self, total: int, label: str, *, enabled: bool = True, stream: IO[str] | None = None, every: float = 0.0
    ) -> None:
        self.total, self.label, self.enabled, self.every = total, label, enabled, every
        self.stream = sys.stderr if stream is None else stream
        self.done, self.start = 0, time.perf_counter()
        self._last = -float("inf")
        self._bar: Any = None
        if enabled and total and self.stream.isatty() and available("tqdm"):
            from tqdm import tqdm

            try:
                sized = os.get_terminal_size(self.stream.fileno()).columns > 0
            except (OSError, ValueError, AttributeError):
                sized = False
            # A terminal that reports no size (a bare pseudo-terminal) gets 80 x 24, not a hidden bar
            # (tqdm draws nothing on a screen of 0 rows).
            self._bar = tqdm(
                total=total,
                desc=label,
                file=self.stream,
                leave=False,
                dynamic_ncols=sized,
                ncols=None if sized else 80,
                nrows=None if sized else 24,
            )

    def step(self, what: str, *, force: bool = False) -> None:
        """One step done; ``what`` names it. Plain lines are printed at most
        every ``every`` seconds, and always for the last step or with ``force``."""
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(1)
            return
        now = time.perf_counter()
        if force or self.done >= self.total or now - self._last >= self.every:
            self._last = now
            print(
                f"{self.label} [{self.done}/{self.total}] {what} ({now - self.start:.0f} s)",
                file=self.stream,
                flush=True,
            )

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
