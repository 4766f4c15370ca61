"""The ``damcha`` command: subcommands live in the packages that implement them
and are imported only when called, so ``damcha conform`` needs no ONNX and
``damcha export`` no PyTorch."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "conform": ("damcha_conformance._cli", "run the conformance catalogue on every installed backend"),
    "export": ("damcha_onnx._cli", "export canonical params to ONNX and validate in onnxruntime"),
    "experiment": ("damcha_experiments._cli", "run a DAMCHA vs baselines learning experiment"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: damcha {" + ",".join(SUBCOMMANDS) + "} [options]\n")
        for name, (_, text) in SUBCOMMANDS.items():
            print(f"  {name:<11} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ndamcha: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module_name = SUBCOMMANDS[argv[0]][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"damcha {argv[0]}: not available ({exc}); install damcha[all]", file=sys.stderr)
        return 2
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
