"""The ``damcha`` command: subcommands live in the packages that implement them
and are imported only when called, so ``damcha conform`` needs no ONNX and
``damcha export`` no PyTorch.

Exit statuses, for every subcommand: 0 ok, 1 a check failed (a mismatch),
2 bad arguments (one line on stderr naming the flag; see ``_cliutil``),
130 interrupted (Ctrl-C: one line, no traceback; outputs are written atomically,
so none is left partial).
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

from ._cliutil import EXIT_USAGE, install_hint

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "conform": ("damcha_conformance._cli", "run the conformance catalogue on every installed backend"),
    "export": ("damcha_onnx._cli", "export canonical params to ONNX and validate in onnxruntime"),
    "experiment": ("damcha_experiments._cli", "run a DAMCHA vs baselines learning experiment"),
}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("damcha")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        from . import __version__

        return __version__


def _help() -> str:
    lines = ["usage: damcha {" + ",".join(SUBCOMMANDS) + "} [options]", "       damcha --version", ""]
    lines += [f"  {name:<11} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += [
        "",
        "'damcha COMMAND --help' describes a command's options.",
        "Exit status: 0 ok, 1 a check failed (mismatch), 2 bad arguments, 130 interrupted, 143 terminated.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    if argv and argv[0] == "--version":
        if len(argv) > 1:  # `damcha --version conform`: not silently ignored
            print(
                f"damcha: error: --version takes no arguments. Received: {' '.join(argv[1:])!r} (see damcha --help)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        print(f"damcha {_version()}")
        return 0
    if not argv:
        print(_help(), file=sys.stderr)
        return EXIT_USAGE
    if argv[0] not in SUBCOMMANDS:
        print(
            f"damcha: error: unknown command {argv[0]!r}; expected one of {', '.join(SUBCOMMANDS)} (see damcha --help)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    # Ctrl-C while the subcommand's module imports (torch, onnx: seconds) is as
    # much an interrupt as one while it runs: one line and 130 for both. SIGTERM
    # (a job scheduler, `timeout`, `kill`) unwinds the same way, so that every
    # command's cleanup runs (damcha export's staging folder, temporary files):
    # one line and 143. Subcommands with their own handlers (conform's worker
    # processes, experiment's checkpoints) install them over this one.
    previous = _catch_sigterm()
    try:
        return _dispatch(argv[0], argv[1:])
    except KeyboardInterrupt:
        print(f"damcha {argv[0]}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        print(f"damcha {argv[0]}: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM, raised where the program is (a BaseException: ``except Exception`` lets it through)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _catch_sigterm() -> Any:
    """Install the SIGTERM handler; returns the previous one (``None`` outside the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread (main() called from a thread): leave signals alone
        return None


def _dispatch(command: str, args: list[str]) -> int:
    """Import ``command``'s module and run its ``main(args)``."""
    try:
        module = importlib.import_module(SUBCOMMANDS[command][0])
    except ImportError as exc:
        # A port's own ImportError already names its extra; a bare
        # ModuleNotFoundError gets the smallest extra that installs the module.
        if isinstance(exc, ModuleNotFoundError) and exc.name and "pip install" not in str(exc):
            message = f"needs {exc.name}, which is not installed: {install_hint(exc.name)}"
        else:
            message = " ".join(str(exc).split())
        print(f"damcha {command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
