"""The ``damcha`` dispatcher and the helpers every subcommand shares
(damcha_core._cliutil): one-line usage errors with exit 2, path checks before
any work, install hints naming the smallest extra, atomic outputs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from damcha_core import _cliutil as cu


def damcha(*args: str, **kw) -> subprocess.CompletedProcess:
    """The real entry point, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "damcha_core._cli", *args], capture_output=True, text=True, **kw)


def test_no_arguments_prints_help_and_exits_2():
    proc = damcha()
    assert proc.returncode == 2
    assert "usage: damcha" in proc.stderr and "conform" in proc.stderr and proc.stdout == ""


def test_help_and_version_exit_0():
    import damcha_core

    proc = damcha("--help")
    assert proc.returncode == 0 and "usage: damcha" in proc.stdout and "Exit status" in proc.stdout
    proc = damcha("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"damcha {damcha_core.__version__}"


def test_unknown_command_is_one_line_exit_2():
    proc = damcha("frobnicate")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "damcha: error: unknown command 'frobnicate'; expected one of conform, export, experiment (see damcha --help)"
    ]


_BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from damcha_core._cli import main
sys.exit(main({argv!r}))
"""


def test_a_missing_framework_names_the_smallest_extra():
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED.format(blocked="onnx", argv=["export", "--help"])],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("damcha export: error:") and 'pip install "damcha[onnx]"' in line and "[all]" not in line


@pytest.mark.parametrize(
    "module, extra",
    [
        ("torch", "torch"),
        ("flax", "jax"),
        ("tensorflow", "keras"),
        ("onnxruntime", "onnx"),
        ("matplotlib", "reports"),
        ("sklearn", "experiments"),
    ],
)
def test_install_hints_name_the_smallest_extra(module, extra):
    assert cu.install_hint(module) == f'pip install "damcha[{extra}]"'
    assert cu.install_hint(f"{module}.sub") == f'pip install "damcha[{extra}]"'


def test_every_extra_named_in_extras_is_declared_and_lists_its_module():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["optional-dependencies"]
    # Import name -> distribution name where they differ.
    dists = {"sklearn": "scikit-learn", "jaxlib": "jax"}
    for module, extra in cu.EXTRAS.items():
        if not extra:
            continue
        assert extra in declared, (module, extra)
        requirements = " ".join(declared[extra])
        assert dists.get(module, module) in requirements, (module, extra, requirements)


def test_experiment_digits_without_scikit_learn_names_the_experiments_extra(tmp_path):
    argv = ["experiment", "digits", "--preset", "smoke", "--no-plots", "--out", str(tmp_path / "runs")]
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED.format(blocked="sklearn", argv=argv)], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("damcha experiment: error: TASK: needs sklearn") and "scikit-learn" in line, line
    assert line.endswith('pip install "damcha[experiments]"') and "[all]" not in line, line
    assert list(tmp_path.iterdir()) == []  # stopped before any work


def test_require_checks_without_importing(capsys):
    cu.require("json", "", "--x")  # installed: nothing happens
    with pytest.raises(SystemExit) as exc:
        cu.require("no_such_module_xyz", "reports", "--plots", prog="damcha experiment", why="the plots")
    assert exc.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "damcha experiment: error: --plots: needs no_such_module_xyz (the plots), which is not installed: "
        'pip install "damcha[reports]"'
    )


def test_argument_parser_errors_are_one_line_naming_the_flag(capsys):
    p = cu.ArgumentParser(prog="damcha test")
    p.add_argument("--seed", type=cu.int_arg(minimum=0))
    assert p.parse_args(["--seed", "3"]).seed == 3
    for bad, says in (("-1", "must be an integer >= 0. Received: -1"), ("x", "must be an integer. Received: 'x'")):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(["--seed", bad])
        assert exc.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("damcha test: error: --seed: ") and says in line


def test_negative_numbers_in_exponent_notation_are_values_not_options(capsys):
    # argparse's own rule knows "-1" and "-0.5": "--lrs -1e-3" said "expected at least one argument".
    p = cu.ArgumentParser(prog="damcha test")
    p.add_argument("--lrs", type=float, nargs="+")
    p.add_argument("--seed", type=int)
    assert p.parse_args(["--lrs", "-1e-3", "2E+2", "-.5", "-3.", "--seed", "-2"]).lrs == [-1e-3, 200.0, -0.5, -3.0]
    with pytest.raises(SystemExit):
        p.parse_args(["--lrs", "1", "-e3"])  # not a number: still an (unknown) option
    assert "unrecognized arguments: -e3" in capsys.readouterr().err


def test_argument_parser_names_an_unknown_option_before_a_missing_argument(capsys):
    """argparse checks the required arguments first: ``--bogus`` alone was reported as
    "the following arguments are required: task, --out"."""
    p = cu.ArgumentParser(prog="damcha test")
    p.add_argument("task", choices=["a", "b"])
    p.add_argument("--out", required=True)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--x", action="store_true")
    group.add_argument("--y", action="store_true")
    for argv, says in (
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["a", "--out", "o", "--x", "extra"], "unrecognized arguments: extra"),
        (["--out", "o"], "the following arguments are required: task"),  # nothing unknown: as argparse says
        (["a", "--out", "o"], "one of the arguments --x --y is required"),
    ):
        assert _usage(capsys, p.parse_args, argv) == f"damcha test: error: {says} (see damcha test --help)"
    # The first pass leaves every requirement as it was, and a good command line parses.
    assert [a.required for a in p._actions if a.dest in ("task", "out")] == [True, True]
    assert vars(p.parse_args(["b", "--out", "o", "--y"])) == {"task": "b", "out": "o", "x": False, "y": True}


def _usage(capsys, fn, *args, **kw) -> str:
    with pytest.raises(SystemExit) as exc:
        fn(*args, **kw)
    assert exc.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    return line


def unwritable_dir(tmp_path) -> Path:
    """A folder this process cannot create files in: a mode-555 folder, or for
    root (who ignores permission bits) /proc, which refuses new files."""
    if os.geteuid() == 0:
        return Path("/proc")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked


def test_output_checks_name_the_flag_and_the_problem(tmp_path, capsys):
    assert cu.check_output_file(tmp_path / "r.json", "--json") == tmp_path / "r.json"
    assert "--json: folder" in _usage(capsys, cu.check_output_file, tmp_path / "no" / "r.json", "--json")
    assert "is a directory" in _usage(capsys, cu.check_output_file, tmp_path, "--json")
    assert "--out: needs a file path. Received: ''" in _usage(capsys, cu.check_output_file, "", "--out")
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    assert "file exists" in _usage(capsys, cu.check_output_file, existing, "--out", overwrite=False)
    existing.chmod(0o444)
    assert "read-only" in _usage(capsys, cu.check_output_file, existing, "--out")
    locked = unwritable_dir(tmp_path)
    assert "not writable" in _usage(capsys, cu.check_output_file, locked / "r.json", "--json")
    assert "not writable" in _usage(capsys, cu.check_output_dir, locked / "sub" / "deeper", "--export-vectors")
    assert cu.check_output_dir(tmp_path / "new" / "dir", "--export-vectors") == tmp_path / "new" / "dir"
    assert "not a folder" in _usage(capsys, cu.check_output_dir, existing, "--export-vectors")
    assert "does not exist" in _usage(capsys, cu.check_input_file, tmp_path / "nope", "--params")
    assert "is not a file" in _usage(capsys, cu.check_input_file, tmp_path, "--params")


def test_atomic_write_keeps_the_old_file_on_failure_and_takes_the_umask(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("good")
    with pytest.raises(RuntimeError), cu.atomic_write(target) as f:
        f.write("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "good"
    assert os.listdir(tmp_path) == ["report.json"]  # no temporary file left behind
    cu.atomic_write_text(target, "new")
    assert target.read_text() == "new"
    fresh = tmp_path / "fresh.bin"
    old = os.umask(0o022)
    try:
        with cu.atomic_write(fresh, "wb") as f:
            f.write(b"\x00")
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644  # not mkstemp's 0600
    target.chmod(0o444)
    with pytest.raises(PermissionError, match="read-only"):
        cu.atomic_write_text(target, "replaced")
    assert target.read_text() == "new"


def test_atomic_dir_moves_files_in_only_when_everything_was_written(tmp_path):
    out = tmp_path / "vectors"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / "a.json").write_text("old a")
    with pytest.raises(RuntimeError), cu.atomic_dir(out) as tmp:
        (tmp / "a.json").write_text("new a")
        raise RuntimeError("crash after one file")
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "keep.txt"] and (out / "a.json").read_text() == "old a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vectors"]  # no temporary folder left
    with cu.atomic_dir(out) as tmp:
        (tmp / "a.json").write_text("new a")
        (tmp / "b.json").write_text("new b")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a.json": "new a", "b.json": "new b", "keep.txt": "mine"}
    fresh = tmp_path / "made" / "here"
    with cu.atomic_dir(fresh) as tmp:
        (tmp / "x").write_text("x")
    assert (fresh / "x").read_text() == "x"


def _old_outputs(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("obstacle", ["read-only file", "file for a folder"])
def test_atomic_dir_refuses_before_any_rename_or_completes(tmp_path, obstacle):
    """atomic_dir renamed file by file and met an obstacle only on reaching it: a read-only file
    (refused even for root), or a file where the new outputs have a folder, stopped it after
    the earlier files were replaced, leaving old and new outputs mixed. Every obstacle is now
    found before the first rename; the error names the path and the old outputs stay whole."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.json").write_text("old a")
    if obstacle == "read-only file":
        (out / "z.json").write_text("old z")
        (out / "z.json").chmod(0o444)
        blocked, new = out / "z.json", "z.json"
    else:
        (out / "sub").write_text("a file, not a folder")
        blocked, new = out / "sub", "sub/b.json"
    before = _old_outputs(out)
    with pytest.raises(OSError, match=f"{blocked}.*nothing in .*out.* was replaced"), cu.atomic_dir(out) as tmp:
        (tmp / "a.json").write_text("new a")
        (tmp / new).parent.mkdir(exist_ok=True)
        (tmp / new).write_text("new")
    assert _old_outputs(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


@pytest.mark.parametrize("read_only_folder", ["sub", "out", "parent"])
def test_atomic_dir_into_a_read_only_folder_leaves_the_old_outputs(tmp_path, monkeypatch, read_only_folder):
    """A read-only folder in the way (a subfolder of the target, the target, or the folder that
    holds it) ended atomic_dir midway (the files before it replaced, the rest not) or with an
    error about a temporary name. It is now refused before any rename, naming the folder."""
    parent = tmp_path / "parent"
    out = parent / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.json").write_text("old a")
    (out / "sub" / "b.json").write_text("old b")
    before = _old_outputs(out)
    blocked = {"sub": out / "sub", "out": out, "parent": parent}[read_only_folder]
    blocked.chmod(0o555)
    try:
        if cu.writable_dir(blocked):
            # Root (with its capabilities, as on the CI machine) writes there anyway: then the file
            # system's refusal is simulated at the one probe atomic_dir asks, so the refusal path
            # still runs here (a normal user gets the real chmod'ed folder).
            probe = cu.writable_dir
            monkeypatch.setattr(cu, "writable_dir", lambda p: Path(p) != blocked and probe(p))
        with pytest.raises(PermissionError, match=f"{blocked}'? is not writable"), cu.atomic_dir(out) as tmp:
            (tmp / "a.json").write_text("new a")
            (tmp / "sub").mkdir()
            (tmp / "sub" / "b.json").write_text("new b")
        assert _old_outputs(out) == before
        assert sorted(p.name for p in parent.iterdir()) == ["out"]
    finally:
        blocked.chmod(0o755)


def test_atomic_outputs_are_fsynced_before_and_after_their_renames(tmp_path, monkeypatch, sync_events):
    """A rename is durable only when the renamed file's data is on disk first and the folder that
    holds the new name is synced after it: otherwise a power loss after the rename can leave an
    empty or partial file under the final name, or lose the name. atomic_dir synced nothing and
    atomic_write not its folder. Recorded through os.fsync/os.replace, keyed by inode (a file
    keeps it through the rename)."""
    events = sync_events

    def log(names: dict[Path, str]) -> list[tuple[str, object]]:
        keys = {(p.stat().st_dev, p.stat().st_ino): name for p, name in names.items()}
        return [(what, keys.get(k, "other") if what == "fsync" else Path(k).name) for what, k in events]

    out = tmp_path / "out"  # a new folder: its name in tmp_path must be synced too
    with cu.atomic_dir(out) as tmp:
        (tmp / "a.json").write_text("a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.json").write_text("b")
    names = {out / "a.json": "a.json", out / "sub" / "b.json": "b.json", out: "out", out / "sub": "sub"}
    got = log({**names, tmp_path: "parent"})
    renames = [i for i, (what, _) in enumerate(got) if what == "replace"]
    assert sorted(name for what, name in got if what == "replace") == ["a.json", "b.json"], got
    for name in ("a.json", "b.json"):  # each file's data is on disk before any rename
        assert got.index(("fsync", name)) < min(renames), got
    for name in ("out", "sub", "parent"):  # each folder that got new names (parent: out's), after the renames
        assert ("fsync", name) in got[max(renames) :], got

    events.clear()  # a single file: its data, the rename, then its folder
    cu.atomic_write_text(out / "c.json", "c")
    got = log({out / "c.json": "c.json", out: "out"})
    assert [e for e in got if e != ("fsync", "other")] == [("fsync", "c.json"), ("replace", "c.json"), ("fsync", "out")]

    # Where a folder cannot be opened (Windows), its fsync is skipped silently.
    real_open = os.open

    def no_folders(path, flags, *args, **kw):
        if os.path.isdir(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", no_folders)
    with cu.atomic_dir(tmp_path / "win") as tmp:
        (tmp / "d.json").write_text("d")
    cu.atomic_write_text(tmp_path / "win" / "e.json", "e")
    assert sorted(p.name for p in (tmp_path / "win").iterdir()) == ["d.json", "e.json"]


def test_progress_prints_plain_lines_when_not_a_terminal(capsys):
    with cu.Progress(2, "torch") as bar:
        bar.step("case-a")
        bar.step("case-b")
    assert capsys.readouterr().err.splitlines() == ["torch [1/2] case-a (0 s)", "torch [2/2] case-b (0 s)"]
    with cu.Progress(3, "jax", every=3600) as bar:  # throttled: the first, forced and last steps only
        for what in ("a", "b", "c"):
            bar.step(what)
    assert [line.split(" (")[0] for line in capsys.readouterr().err.splitlines()] == ["jax [1/3] a", "jax [3/3] c"]
    with cu.Progress(1, "quiet", enabled=False) as bar:
        bar.step("x")
    assert capsys.readouterr().err == ""


def test_cliutil_imports_only_the_standard_library():
    code = (
        "import sys; import damcha_core._cliutil;"
        "bad = [m for m in ('numpy', 'torch', 'jax', 'tqdm', 'rich') if m in sys.modules]; assert not bad, bad"
    )
    # damcha_core itself imports numpy; the helper module must add nothing on top of that.
    code = code.replace("'numpy', ", "")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_usage_error_is_one_line(capsys):
    line = _usage(
        capsys, cu.usage_error, "--case", "unknown case 'nosuch'.\nExpected one of [...]", prog="damcha conform"
    )
    assert line == "damcha conform: error: --case: unknown case 'nosuch'. Expected one of [...]"


@pytest.mark.parametrize("command, module", [("export", "damcha_onnx._cli"), ("conform", "damcha_conformance._cli")])
def test_ctrl_c_is_one_line_and_exit_130(command, module, monkeypatch, capsys):
    """A KeyboardInterrupt printed a full traceback (experiment alone printed one line)."""
    import importlib

    from damcha_core._cli import main

    target = importlib.import_module(module)

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, "main", interrupted)
    assert main([command, "--anything"]) == 130
    captured = capsys.readouterr()
    assert captured.err == f"damcha {command}: interrupted\n" and captured.out == ""


@pytest.mark.parametrize(
    "command, module",
    [("export", "damcha_onnx._cli"), ("conform", "damcha_conformance._cli"), ("experiment", "damcha_experiments._cli")],
)
def test_ctrl_c_while_the_subcommand_imports_is_one_line_and_exit_130(command, module, monkeypatch, capsys):
    """Importing a subcommand (torch, onnx) takes seconds, and Ctrl-C then printed a traceback:
    only the subcommand's main was covered. A finder that raises KeyboardInterrupt stands for it."""
    from damcha_core._cli import main

    class Interrupting:
        def find_spec(self, name, path=None, target=None):
            if name in (module, module.rsplit(".", 1)[0]):
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    try:
        status = main([command, "--anything"])
    except KeyboardInterrupt:  # caught here, or it would stop the whole pytest session
        pytest.fail("the KeyboardInterrupt escaped damcha's main (a traceback for the user)")
    assert status == 130
    captured = capsys.readouterr()
    assert captured.err == f"damcha {command}: interrupted\n" and captured.out == ""


def test_version_takes_no_arguments():
    """`damcha --version conform` printed the version and ignored the rest, exit 0."""
    proc = damcha("--version", "conform")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "damcha: error: --version takes no arguments. Received: 'conform' (see damcha --help)"
    ]


_TOO_LONG = "n" * 300  # over the 255-byte limit on one name


@pytest.mark.parametrize(
    "check, name, flag, says",
    [
        (cu.check_output_file, _TOO_LONG + ".json", "--json", "File name too long"),
        (cu.check_output_dir, _TOO_LONG, "--export-vectors", "File name too long"),
        (cu.check_input_file, _TOO_LONG + ".safetensors", "--params", "File name too long"),
        (cu.check_output_file, "a\0b.json", "--json", "it contains a NUL character"),
        (cu.check_output_dir, "a\0b", "--export-vectors", "it contains a NUL character"),
        (cu.check_input_file, "a\0b.json", "--params", "it contains a NUL character"),
    ],
    ids=[
        "output-file-too-long",
        "output-dir-too-long",
        "input-file-too-long",
        "output-file-nul",
        "output-dir-nul",
        "input-file-nul",
    ],
)
def test_path_checks_refuse_names_the_os_refuses(tmp_path, capsys, check, name, flag, says):
    """Path.is_dir()/exists() raise OSError for a name too long (ENAMETOOLONG): the check ended
    the command with a traceback. A NUL byte passed the output checks (pathlib reads it as "does
    not exist") and open() raised a bare ValueError after the work."""
    line = _usage(capsys, check, tmp_path / name, flag)
    assert line.startswith(f"damcha: error: {flag}: is not a usable path ({says}). Received: ")


def test_atomic_outputs_take_a_long_valid_name(tmp_path):
    """A name of 250 bytes is valid, but the temporary one beside it (".<name>.XXXXXXXX.tmp")
    was not: the checks passed, the work ran, and only the write failed (ENAMETOOLONG)."""
    name = "n" * 250
    cu.check_output_file(tmp_path / name, "--json")
    cu.atomic_write_text(tmp_path / name, "report")
    assert (tmp_path / name).read_text() == "report"
    folder = tmp_path / ("d" * 250)
    cu.check_output_dir(folder, "--export-vectors")
    with cu.atomic_dir(folder) as tmp:
        (tmp / "index.json").write_text("{}")
    assert (folder / "index.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, folder.name])


def test_atomic_dir_interrupted_while_syncing_leaves_no_new_folder(tmp_path, monkeypatch):
    """Ctrl-C while atomic_dir synced its files (the slow part, 77 files for the test vectors)
    left the new, empty output folder behind: it was made before the syncs."""
    calls = []

    def interrupted(path):
        calls.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(cu, "fsync_file", interrupted)
    out = tmp_path / "vectors"
    with pytest.raises(KeyboardInterrupt), cu.atomic_dir(out) as tmp:
        (tmp / "a.json").write_text("a")
    assert calls and list(tmp_path.iterdir()) == []  # neither the folder nor a temporary one


def test_writers_refuse_a_named_pipe_instead_of_replacing_it(tmp_path, capsys):
    """The atomic writers replace their target by a rename: a pipe (or, as root, /dev/null)
    became a regular file without a word. The checks refuse it up front, the writers (and so
    every save) refuse it as a last line, and the pipe stays a pipe."""
    import damcha_core as dc

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    for target in (fifo, link):
        line = _usage(capsys, cu.check_output_file, target, "--json")
        assert (
            line
            == f"damcha: error: --json: expected a regular file (it is replaced by a rename); it is a named pipe. Received: {str(target)!r}"
        )
        with pytest.raises(PermissionError, match="is a named pipe, not a regular file; not replacing it"):
            cu.atomic_write_text(target, "x")
    cfg = dc.DamchaConfig(8, 2, 4)
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `path`: expected a regular file .*it is a named pipe"
    ):
        dc.save_params(fifo, dc.init_params(cfg), cfg)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json"]  # no temporary file left


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_output_checks_refuse_links_that_lead_nowhere(tmp_path, capsys, kind):
    """A link to a missing folder or a loop of links passed both checks: the command did its work
    and then failed with a traceback (FileExistsError, 'Symlink loop') or a late 'could not write'."""
    link = tmp_path / "out"
    if kind == "dangling":
        link.symlink_to(tmp_path / "missing" / "dir")
    else:
        other = tmp_path / "other"
        link.symlink_to(other)
        other.symlink_to(link)
    line = _usage(capsys, cu.check_output_dir, link, "--out")
    assert line.startswith("damcha: error: --out: is a symbolic link to no folder (")
    file_link = tmp_path / "r.json"
    if kind == "dangling":
        file_link.symlink_to(tmp_path / "missing" / "r.json")
        says = "expected a symbolic link into an existing, writable folder"
    else:
        file_link.symlink_to(link)
        says = "expected a path that resolves to a file"
    assert says in _usage(capsys, cu.check_output_file, file_link, "--json")


def test_path_checks_name_a_trailing_slash_and_a_link_to_nothing(tmp_path, capsys):
    """`--json out.json/` wrote the file out.json (pathlib drops the slash); an input that is a
    loop of links read "file does not exist"."""
    line = _usage(capsys, cu.check_output_file, f"{tmp_path}/out.json/", "--json")
    assert "ends with a path separator (a folder), expected a file path" in line
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "is a symbolic link to no file (dangling, or a loop)" in _usage(
        capsys, cu.check_input_file, loop, "--params"
    )
