"""A port imported without its framework fails with one line naming the extra
(DECISIONS 7). The framework is hidden in a subprocess by a meta-path finder, as
if it were not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from damcha_core._imports import require

_HIDE = textwrap.dedent(
    """
    import sys

    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == {hidden!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    try:
        import {package}
    except ImportError as exc:
        print(type(exc).__name__)
        print(exc)
    else:
        print("imported")
    """
)


@pytest.mark.parametrize(
    "package, hidden, line",
    [
        ("damcha_torch", "torch", 'damcha_torch needs PyTorch: pip install "damcha[torch]"'),
        ("damcha_jax", "jax", 'damcha_jax needs JAX: pip install "damcha[jax]"'),
        ("damcha_jax", "flax", 'damcha_jax needs Flax: pip install "damcha[jax]"'),
        ("damcha_keras", "keras", 'damcha_keras needs Keras: pip install "damcha[keras]"'),
        ("damcha_onnx", "onnx", 'damcha_onnx needs ONNX: pip install "damcha[onnx]"'),
    ],
    ids=["torch", "jax", "flax", "keras", "onnx"],
)
def test_port_without_its_framework_names_the_extra(package, hidden, line):
    code = _HIDE.format(hidden=hidden, package=package)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ModuleNotFoundError", line], proc.stdout + proc.stderr


def test_uncaught_error_ends_with_the_one_line():
    code = _HIDE.format(hidden="torch", package="damcha_torch").replace("try:\n    import", "if True:\n    import")
    code = code.split("except ImportError")[0]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip().splitlines()[-1]
        == 'ModuleNotFoundError: damcha_torch needs PyTorch: pip install "damcha[torch]"'
    )
    assert "During handling" not in proc.stderr  # no chained traceback of the original error


def test_require_returns_the_module_and_names_missing_dependencies(tmp_path, monkeypatch):
    import json

    assert require("json", "", "damcha_x") is json
    with pytest.raises(ModuleNotFoundError) as info:
        require("damcha_no_such_framework", "torch", "damcha_x")
    assert str(info.value) == 'damcha_x needs damcha_no_such_framework: pip install "damcha[torch]"'
    # installed, but one of its own dependencies is missing
    (tmp_path / "fake_framework_a.py").write_text("import fake_dependency_missing_b\n")
    # installed, but broken for another reason
    (tmp_path / "fake_framework_c.py").write_text("raise ImportError('libfoo.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("fake_framework_a", "keras", "damcha_x")
    assert str(info.value) == (
        'damcha_x needs fake_framework_a (which could not import fake_dependency_missing_b): pip install "damcha[keras]"'
    )
    with pytest.raises(
        ImportError,
        match=r"^damcha_x needs fake_framework_c, which is installed but failed to import "
        r"\(libfoo\.so: cannot open shared object file\); reinstalling may help",
    ):
        require("fake_framework_c", "keras", "damcha_x")


def test_model_layouts_import_no_framework():
    # The converters' ProjectionSite/AttentionLayout/ModelAdapter live in the core
    # for both ports: importing them must not pull a framework in.
    code = (
        "import sys; import damcha_core._layout;"
        "bad = [m for m in ('torch', 'jax', 'flax', 'keras', 'tensorflow') if m in sys.modules]; assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
