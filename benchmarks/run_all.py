"""Run every benchmark script in turn (`make bench`), each in its own process.

Each script prints a markdown table of ratios against its framework's MHA,
measured in the same run; copy the tables into docs/benchmarks.md together
with the command, the date and the machine load. Run on an otherwise idle
machine: the ratios are robust to a steady load, not to a fluctuating one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = ["bench_torch.py", "bench_decode.py", "bench_jax.py", "bench_keras.py", "bench_onnx.py", "bench_headmix.py"]


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for script in SCRIPTS:
        print(f"\n## {script}\n", flush=True)
        if subprocess.run([sys.executable, str(here / script)]).returncode:
            failed.append(script)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
