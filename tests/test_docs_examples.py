"""Every ```python example of README.md and docs/*.md runs, as a user copies it.

One test per block, named after its file and the line of its opening fence
(``torch.md:L16``). The blocks of one file run in order in one namespace, in a
fresh working folder of that file's own, as a reader goes through the page: a
later block may use what an earlier one defined (``attn``, ``config``, a file
written). Names the prose leaves to the reader (``model`` = your model,
``task_loss``, ``trained_mha``) are defined by ``GIVEN``, small, just before the
block that first reads them; everything else comes from the page.

Keras reads ``KERAS_BACKEND`` once, at import, so the blocks run in subprocesses
(``python tests/test_docs_examples.py OUT WORKDIR DOC...``) with
``KERAS_BACKEND=tensorflow``, Keras's default, which is what a reader who sets
nothing gets. Pages are grouped into a few processes (``PROCESSES``) so each
framework is imported once per process, not once per page; the processes run at
the same time, once per test session (shared by xdist workers), and each block's
test asserts on its block's outcome.

Output and pseudo-code are fenced ```text/```console, not ```python. A block that
cannot run here is in ``NOT_RUNNABLE`` with the reason; a block run by another
test (``<!-- tested: tests/FILE.py -->`` just above its fence) is left to that test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from _keras_processes import run_once_locked, shared_dir

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (page, text in the block) -> why it is not run here. Keep this short:
# an example that needs the reader's data is better given that data in GIVEN.
NOT_RUNNABLE: dict[tuple[str, str], str] = {
    ("conformance.md", "class MyAdapter:"): "the skeleton of the reader's port (build_my_layer, gradients)",
}

# (page, text in the block) -> code run just before that block, in
# the page's namespace: the names its prose leaves to the reader, small.
GIVEN: dict[tuple[str, str], str] = {
    # README's port blocks are at-a-glance fragments: the reader's inputs and trained layers.
    ("README.md", "model = replace_mha(model)"): """
import torch
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(512, 8, batch_first=True), 2)
task_loss = torch.tensor(0.0)
""",
    ("README.md", "import damcha_jax as dj"): """
from flax import nnx
trained_mha = nnx.MultiHeadAttention(8, 512, decode=False, rngs=nnx.Rngs(2))
class _Model(nnx.Module):
    def __init__(self, rngs):
        self.attention = nnx.MultiHeadAttention(8, 512, decode=False, rngs=rngs)
flax_model = _Model(nnx.Rngs(4))
""",
    ("README.md", "from damcha_keras import"): """
import keras
trained_mha = keras.layers.MultiHeadAttention(num_heads=8, key_dim=64)
trained_mha(keras.random.normal((2, 10, 512)), keras.random.normal((2, 10, 512)))
""",
    ("torch.md", "layer = DamchaAttention.from_mha(mha)"): """
mha = torch.nn.MultiheadAttention(512, 8, batch_first=True)
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(512, 8, batch_first=True), 2)
""",
    ("torch.md", "out = enc(src, mask=causal_mask, is_causal=True)"): """
src = torch.randn(2, 10, 256)
causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(10)
""",
    ("torch.md", "lam * metric_penalty(model)"): """
task_loss, lam = torch.tensor(0.0), 1e-3
""",
    ("torch.md", "for chunk in chunks:"): """
chunks = torch.randn(4, 7, 512).split([4, 1, 2], dim=1)
""",
    ("jax.md", "step = nnx.jit("): """
from flax import nnx
layer = dj.DamchaAttention(num_heads=8, in_features=512, rngs=nnx.Rngs(0))
""",
    ("keras.md", "h = embeddings"): """
embeddings = keras.random.normal((2, 8, 64))
""",
    ("keras.md", "for i in range(steps):"): """
token, steps = keras.random.normal((1, 1, 512)), 3
""",
    ("onnx.md", "do.export_torch(torch_model.eval()"): """
import torch
import damcha_torch as dt
torch_model = dt.build_encoder(16, 2, 1, dim_feedforward=32)
example_x = torch.randn(2, 5, 16)
""",
    ("onnx.md", "do.encoder_from_torch(torch_encoder.eval()"): """
import torch, keras
import damcha_torch as dt, damcha_jax as dj, damcha_keras as dk
from flax import nnx
torch_encoder = dt.build_encoder(16, 2, 2, dim_feedforward=32)
blocks = [dk.TransformerEncoder(32, 2) for _ in range(2)]
h = keras.random.normal((1, 4, 16))
for block in blocks:
    h = block(h)
jax_encoder = dj.DamchaEncoder(2, 16, 2, 32, rngs=nnx.Rngs(0))
""",
    ("models.md", "dt.register_adapter(dt.ModelAdapter("): """
class MyAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.wq, self.wk = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
""",
}

# The pages' processes, run at the same time; the pages of one process run in
# this order, each in its own namespace and folder, importing each framework once.
# jax.md alone: its NaN-debugging block turns on jax_debug_nans for the whole process.
PROCESSES: tuple[tuple[str, ...], ...] = (
    ("README.md", "keras.md", "onnx.md"),
    ("jax.md",),
    ("torch.md", "models.md", "experiments.md", "conformance.md", "cli.md"),
)
KERAS_BACKEND = "tensorflow"  # Keras's default: what a reader who sets nothing gets
TIMEOUT_S = 900  # a hung process, not a slow one


class Block(NamedTuple):
    id: str  # "torch.md:L16": the page and the line of the opening fence
    page: str  # "torch.md", "README.md"
    line: int
    code: str
    tested_by: str | None  # the test named by "<!-- tested: tests/FILE.py -->" above the fence


_FENCE = re.compile(r"^(\s*)```python\s*$")
_TESTED = re.compile(r"^\s*<!-- tested: (tests/\S+\.py) -->\s*$")


def find_blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path``, dedented by their fence's indentation
    (a block inside a list item)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, start = match.group(1), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        assert i < len(lines), f"{path.name}:L{start + 1}: a ```python fence that is never closed"
        tested = _TESTED.match(lines[start - 1]) if start else None
        blocks.append(
            Block(
                f"{path.name}:L{start + 1}",
                path.name,
                start + 1,
                "\n".join(body) + "\n",
                tested.group(1) if tested else None,
            )
        )
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in find_blocks(path)]


def keyed(table: dict[tuple[str, str], str], blocks: list[Block], *, check: bool = True) -> dict[str, str]:
    """``table`` by block id; each key's text must be in exactly one block of its page."""
    out = {}
    for (page, text), value in table.items():
        hits = [b for b in blocks if b.page == page and text in b.code]
        if not check and len(hits) != 1:
            continue
        assert len(hits) == 1, (
            f"({page!r}, {text!r}) matches {len(hits)} ```python blocks of {page}: "
            "the example changed: update this entry or remove it"
        )
        out[hits[0].id] = value
    return out


# ------------------------------------------------------------------ the tests

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if not b.tested_by and b.id not in keyed(NOT_RUNNABLE, BLOCKS, check=False)]


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Block id -> outcome of every process, run once per test session (the
    first xdist worker runs them under a lock in the workers' common folder;
    the others read its file)."""
    shared = shared_dir(tmp_path_factory)
    out = shared / "docs-examples.json"
    run_once_locked(out, shared / "docs-examples.lock", lambda: out.write_text(json.dumps(_run_all(shared))))
    return json.loads(out.read_text())


def _run_all(shared: Path) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": KERAS_BACKEND}
    # (XLA_FLAGS, conftest.py's cheaper codegen, is inherited: the examples are compile time.)
    running = []
    for i, pages in enumerate(PROCESSES):
        out, log = shared / f"docs-examples-{i}.json", shared / f"docs-examples-{i}.log"
        cmd = [sys.executable, __file__, str(out), str(shared / "docs-examples"), *pages]
        with open(log, "w") as handle:  # a file, not a pipe: a process is never blocked on its output
            proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
        running.append((pages, out, log, proc))
    outcomes: dict[str, Any] = {}
    for pages, out, log, proc in running:
        try:
            proc.wait(timeout=TIMEOUT_S)
            why = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            why = f"timed out after {TIMEOUT_S} s"
        if proc.returncode == 0 and out.exists():
            outcomes.update(json.loads(out.read_text()))
        else:  # every block of these pages fails with the process's own output
            output = log.read_text(errors="replace")[-6000:]
            crashed = {"ok": False, "error": f"the process of {', '.join(pages)} failed ({why}):\n{output}"}
            outcomes.update({b.id: crashed for b in RUN if b.page in pages})
    return outcomes


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_example_runs(block: Block, outcomes: dict[str, Any]) -> None:
    assert block.id in outcomes, f"{block.id} was not run (its page is in no process of PROCESSES?)"
    outcome = outcomes[block.id]
    assert outcome["ok"], f"{block.id} raised:\n{outcome['error']}"


def test_every_page_with_examples_runs_in_one_process() -> None:
    pages = [page for group in PROCESSES for page in group]
    assert len(pages) == len(set(pages)), PROCESSES
    assert {b.page for b in RUN} <= set(pages), "add the page to PROCESSES"


def test_the_tables_name_existing_blocks() -> None:
    """A stale entry (the example changed or moved away) fails here."""
    assert NOT_RUNNABLE.keys().isdisjoint(GIVEN), "a block is either run or not"
    keyed(NOT_RUNNABLE, BLOCKS)
    keyed(GIVEN, BLOCKS)


def test_blocks_run_elsewhere_are_run_there() -> None:
    for block in BLOCKS:
        if block.tested_by:
            test = (ROOT / block.tested_by).read_text(encoding="utf-8")
            assert f"tested: {block.tested_by}" in test and block.page in test, (block.id, block.tested_by)


def test_python_examples_are_fenced_as_python() -> None:
    """Blocks fenced ```py, ```python3 or ```pycon would not be run here."""
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not re.match(r"\s*```(py|python3|pycon|ipython)\s*$", line), f"{path.name}:L{number}: {line.strip()}"


# ----------------------------------------------------------------- the runner


def bound_names(code: str) -> set[str]:
    """The names ``code`` binds at its top level other than by an import (re-importing a module
    changes nothing): assignments, loop and ``with`` targets, functions, classes."""
    import ast

    names: set[str] = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.add(sub.id)
    return names


def run_pages(pages: list[str], workdir: Path) -> dict[str, Any]:
    """Run the blocks of ``pages`` (in this process): block id -> outcome."""
    blocks = all_blocks()
    # A stale entry fails test_the_tables_name_existing_blocks; the rest still runs.
    skipped = keyed(NOT_RUNNABLE, blocks, check=False)
    given = keyed(GIVEN, blocks, check=False)
    results: dict[str, Any] = {}
    for page in pages:
        folder = workdir / page.replace(".", "_")
        folder.mkdir(parents=True, exist_ok=True)
        os.chdir(folder)
        namespace: dict[str, Any] = {"__name__": "__main__"}
        page_bound: set[str] = set()  # names the page's own blocks bound (GIVEN's may be rebound by GIVEN)
        failed: list[str] = []
        for block in blocks:
            if block.page != page or block.id in skipped or block.tested_by:
                continue
            start, cpu = time.perf_counter(), time.process_time()
            try:
                if block.id in given:
                    # GIVEN stands in for what the prose leaves to the reader, never for what the page
                    # itself defined earlier: a reader copying the page has the page's values (stand-ins
                    # for `config` and `x` had hidden blocks that failed in page order).
                    shadowed = sorted(bound_names(given[block.id]) & page_bound)
                    if shadowed:
                        raise AssertionError(
                            f"GIVEN[{block.id}] rebinds {shadowed}, which earlier blocks of {page} bound: the "
                            "block must work with the page's values, or define its own inputs itself"
                        )
                    exec(compile(given[block.id], f"GIVEN[{block.id}]", "exec"), namespace)
                # Padded so a traceback names the page's own line numbers.
                source = "\n" * block.line + block.code
                page_bound |= bound_names(block.code)
                exec(compile(source, page if page == "README.md" else f"docs/{page}", "exec"), namespace)
                results[block.id] = {"ok": True}
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001  (recorded: this block's test fails with it, the page goes on)
                message = traceback.format_exc()[-6000:]
                if failed:
                    message += f"\n(earlier blocks of {page} failed too: {', '.join(failed)})"
                results[block.id] = {"ok": False, "error": message}
                failed.append(block.id)
            # For tuning: this machine is shared, so CPU time says more than wall time.
            results[block.id]["seconds"] = round(time.perf_counter() - start, 2)
            results[block.id]["cpu_s"] = round(time.process_time() - cpu, 2)
    return results


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("MPLBACKEND", "Agg")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    out, work, *names = sys.argv[1:]
    outcome = run_pages(names, Path(work))
    Path(out).write_text(json.dumps(outcome, indent=1))
