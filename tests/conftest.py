"""Shared test configuration.

Backends are imported directly by their test modules: a missing framework is a
collection error, never a skip, because CI installs every backend and a
skipped backend test would hide a gap.
"""

from __future__ import annotations

import os
import random
import sys
import zlib

import pytest

# Two xdist workers share two cores: one intra-op thread each avoids
# oversubscription (set before any framework is imported).
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _cheap_xla_flags() -> str:
    """XLA's cheaper CPU code generation (LLVM without its expensive passes; XLA's own
    graph passes, which decide fusions and what cost_analysis reports, are unchanged):
    JAX tests compile hundreds of tiny programs, and compile time dominates them
    (tests/test_jax_*.py on two workers: 231 -> 201 s wall with the first two flags,
    208 -> 157 s on a later machine when the third joined them; every test passes
    each way). The third emits XLA's fusions through its older LLVM emitters,
    without the MLIR ones (a jnp.sin compile 30 -> 18 ms, most of it MLIR context
    and pattern set-up); it is a flag that a later jaxlib may drop, and XLA aborts
    on a flag it does not know, so it is given only to the jaxlib that
    constraints.txt pins (where it was measured)."""
    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    from importlib import metadata
    from pathlib import Path

    try:
        installed = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return flags
    constraints = Path(__file__).resolve().parents[1] / "constraints.txt"
    pins = constraints.read_text().split() if constraints.exists() else []
    if f"jaxlib=={installed}" in pins:
        flags += " --xla_cpu_use_fusion_emitters=false"
    return flags


# Every subprocess the tests start inherits these (Keras's JAX process, the benchmark
# scripts' tiny runs, the docs' examples), but for one: the float64 conformance catalogue's
# process (tests/test_jax_conformance.py) compiles with XLA's defaults, so the JAX port is
# also checked, at float64's tolerances, as a user's program is compiled (+3 s).
# `damcha conform` run by hand and the benchmarks keep XLA's defaults. Set XLA_FLAGS to override.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = os.environ["DAMCHA_TESTS_XLA_FLAGS"] = _cheap_xla_flags()

from _keras_processes import freeze_long_lived, reads_a_process, shared_dir, start_in_background  # noqa: E402 - after the environment above
from hypothesis import HealthCheck, settings  # noqa: E402 - after the thread settings above

# Hypothesis draws a fresh set of examples on every run unless derandomized, so the same
# code could pass one CI run and fail the next. The suite runs Hypothesis' "ci" profile:
# each test's examples come from a seed fixed by the test itself (derandomize), no
# wall-clock deadline (a loaded machine is not a failure), no example database. To look
# for new failing examples locally: `pytest --hypothesis-profile explore tests/...`
# (fresh examples each run, failures saved in .hypothesis/ and replayed first).
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

# Modules holding the suite's longest single tests (the upstream Keras suite and the Keras
# layer checks on this process's backend, the benchmark scripts, Node.js, the experiments'
# end-to-end smoke run, torch.compile/Inductor, multi-process torch/JAX, the docs' examples),
# longest first.
# They run first: `make test` uses xdist's worksteal scheduler, where each worker starts on
# half of the collection and an idle worker takes the tail half of the other's queue, so a
# long test is absorbed when it runs early and adds its whole length to the wall time
# when it lands on one worker at the end. Whole modules move, in their own order, so
# module-scoped fixtures are still set up once per worker (but for the items that read a
# Keras process, which go last; their modules have no module-scoped fixtures); xdist
# already runs the tests in varying order across workers, so no test may depend on which
# module ran before it.
RUN_FIRST = (
    "test_keras_upstream.py",
    "test_keras_backends.py",
    "test_docs_examples.py",
    "test_benchmarks_quick.py",
    "test_experiments_run.py",
    "test_onnx_js.py",
    "test_torch_kv_cache.py",
    "test_torch_layers.py",
    "test_models_torch.py",
    "test_models_keras.py",
    "test_torch_mha_suite.py",
    "test_torch_nan.py",
    "test_jax_compiled_cost.py",
    "test_jax_sharding.py",
    "test_torch_ddp.py",
    "test_torch_fsdp.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    """RUN_FIRST's modules first; the items that read a Keras process's results
    (tests/_keras_processes.py, started in the background by the fixture below)
    last, where the process has long finished and no worker waits on it."""
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    # stable: the rest keep their order
    items.sort(key=lambda item: (reads_a_process(item), rank.get(item.path.name, len(rank))))


@pytest.fixture(scope="session", autouse=True)
def _keras_processes_in_background(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The Keras processes of the other backends start with the session, beside
    the workers (the first worker to claim each starts it)."""
    start_in_background(request.session, shared_dir(tmp_path_factory))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the test modules imported (torch, TensorFlow, JAX, Keras) lives for
    the whole run: out of the garbage collector's sight from here
    (``_keras_processes.freeze_long_lived``; 7.6 of a Keras quantize test's 9 s
    were ``gc.collect`` walking it). Objects the tests make are collected as
    before."""
    freeze_long_lived()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Seed every global random generator from the test's id before its fixtures run.

    Without this, a test that draws from a global generator got data that changed between
    runs of the same code: Keras's default initialisers (and keras.random without a seed)
    draw seeds from Python's ``random``, seeded from the OS in each process (a 4-sigma
    check failed CI that way once), and torch's and NumPy's global generators are in
    whatever state the tests before left them, which xdist's scheduling and -k change.
    Now each test sees the same draws in every run, in any order, alone or not."""
    seed = zlib.crc32(item.nodeid.encode())
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    if "keras" in sys.modules:  # Python's and NumPy's again, TensorFlow's, and Keras's global SeedGenerator
        sys.modules["keras"].utils.set_random_seed(seed)


@pytest.fixture(params=["c-kernel", "torch-ops"])
def decode_kernel(request, monkeypatch):
    """A torch decoding step's map by the C kernel (damcha_torch._headmix, the
    default on CPU where it was built) or by torch ops (CUDA, a build without
    a C compiler): tests of the flat decoding step hold for both."""
    from damcha_torch import _functional as fn

    if request.param == "torch-ops":
        monkeypatch.setattr(fn, "_HEADMIX", None)
    elif fn._HEADMIX is None:
        pytest.skip("damcha_torch._headmix not installed (built without a C compiler)")
    return request.param


@pytest.fixture
def sync_events(monkeypatch):
    """os.fsync and os.replace recorded, in order, as ("fsync", (dev, inode)) and ("replace", absolute
    destination): a file keeps its inode through a rename, so a test finds its sync before the rename
    and its folder's after. Shared by the crash-safe-write tests (CLI, ONNX files, benchmark results)."""
    events: list[tuple[str, object]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", os.path.abspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


# Skips for a missing dependency fail under DAMCHA_REQUIRE_ALL_BACKENDS=1 (see the module).
from _require_all import pytest_runtest_makereport  # noqa: E402,F401
