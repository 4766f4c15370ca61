"""``damcha experiment`` through the real entry point (a subprocess of the console script):
every bad flag exits 2 with one line naming it, before any work, leaving no partial
output and never touching an earlier good file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DAMCHA = str(Path(sys.executable).with_name("damcha"))


def _run(args: list[str], cwd: Path, *, python_prelude: str | None = None) -> subprocess.CompletedProcess:
    if python_prelude is None:
        cmd = [DAMCHA, "experiment", *args]
    else:
        # The same entry function, with an optional package hidden first (as if its extra were not installed).
        code = f"{python_prelude}\nimport sys\nfrom damcha_core._cli import main\nsys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, "experiment", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def workdir(tmp_path):
    (tmp_path / "file.txt").write_text("not a folder\n")
    (tmp_path / "bad.json").write_text("{ not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "dir.json").mkdir()
    good = tmp_path / "good"
    good.mkdir()
    (good / "crosshead.json").write_text('{"earlier": "good"}\n')
    from damcha_experiments._tasks import RESULTS_FORMAT

    (tmp_path / "noresults").mkdir()
    empty = {"format": RESULTS_FORMAT, "task": "crosshead", "suite": "headline", "variants": {}}
    (tmp_path / "noresults" / "crosshead.json").write_text(json.dumps(empty))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "garbage.json").write_text("garbage")
    # Outputs a command would replace after its work: read-only ones are refused before it.
    for folder, name in (
        ("ro_results", "crosshead.json"),
        ("ro_plot", "crosshead_curves.png"),
        ("ro_report", "report.json"),
    ):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("{}" if name.endswith(".json") else "png")
        (tmp_path / folder / name).chmod(0o444)
    (tmp_path / "runs_is_a_file").mkdir()
    (tmp_path / "runs_is_a_file" / "runs").write_text("not the runs folder")
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


BAD = [
    (["crosshead", "--seeds", "0"], "--seeds"),
    (["crosshead", "--seeds", "two"], "--seeds"),
    (["crosshead", "--seeds", "2", "--sweep-seeds", "3"], "--sweep-seeds"),
    (["crosshead", "--lrs", "0"], "--lrs"),
    (["crosshead", "--lrs", "nan"], "--lrs"),
    (["crosshead", "--lrs", "1e-3", "1e-3"], "--lrs"),
    (["crosshead", "--lrs", "1e300"], "--lrs"),  # Adam overflowed at the first update
    (["crosshead", "--lrs", "10.5"], "--lrs"),
    (["crosshead", "--max-steps", "0"], "--max-steps"),
    (["crosshead", "--eval-size", "0"], "--eval-size"),
    (["digits", "--eval-size", "400"], "--eval-size"),
    # 365 GiB of windows were allocated before the first step; the generated tasks looped for hours.
    (["charlm", "--eval-size", "1000000000"], "--eval-size"),
    (["crosshead", "--eval-size", "100001"], "--eval-size"),
    (["listops", "--eval-size", "100001"], "--eval-size"),
    (["crosshead", "--threads", "0"], "--threads"),
    (["crosshead", "--threads", "100000"], "--threads"),  # torch.set_num_threads crashed (segfault)
    (["crosshead", "--device", "gpu"], "--device"),
    (["crosshead", "--device", "meta"], "--device"),
    (["crosshead", "--variants", "mha,nope"], "--variants"),
    (["crosshead", "--variants", "mha", "mha"], "--variants"),
    (["crosshead", "--variants", ""], "--variants"),  # no variant: a results JSON with zero variants
    (["crosshead", "--variants", ","], "--variants"),
    (["crosshead", "--preset", "huge"], "--preset"),
    (["crosshead", "--suite", "all"], "--suite"),
    (["nosuchtask"], "task"),
    (["crosshead", "--out", "file.txt"], "--out"),
    (["crosshead", "--out", "file.txt/sub"], "--out"),
    (["crosshead", "--from-json", "missing.json", "--out", "new"], "--from-json"),
    (["crosshead", "--from-json", "bad.json", "--out", "new"], "--from-json"),
    (["crosshead", "--from-json", "list.json", "--out", "new"], "--from-json"),
    (["crosshead", "--from-json", "other.json", "--out", "new"], "--from-json"),
    (["crosshead", "--from-json", "dir.json", "--out", "new"], "--from-json"),
    (["crosshead", "--from-json", "bad.json", "--out", "good"], "--from-json"),
    (["crosshead", "--cost-only", "--from-json", "bad.json"], "--from-json"),
    (["report", "missing"], "FOLDER"),
    (["report", "good"], "FOLDER"),  # holds no results file of this format
    (["report", "good", "--out", "good"], "--out"),
    (["report", "noresults"], "noresults/crosshead.json"),  # the results format, but no variant in it
    (["report", "garbage"], "garbage.json is not valid JSON"),  # the only file is named, not just "no results"
    (["report", "good", "--tolerance", "-1"], "--tolerance"),
    # Outputs checked before any work (they failed after it, with a traceback and exit 1):
    (["crosshead", "--preset", "smoke", "--no-plots", "--out", "ro_results"], "--out"),
    (["crosshead", "--preset", "smoke", "--out", "ro_plot"], "--out"),
    (["report", "ro_report"], "--out"),  # report.md would be written, then report.json refused
    (["report", "good", "--out", "good/summary.json"], "--out"),  # the JSON summary would replace the report
    # Options --from-json does not read were silently ignored (--from-json --device cuda exited 0
    # on a machine without CUDA):
    (["crosshead", "--from-json", "r.json", "--seeds", "7"], "--seeds: does not apply with --from-json"),
    (["crosshead", "--from-json", "r.json", "--dev", "cuda"], "--device: does not apply with --from-json"),
    (["crosshead", "--from-json", "r.json", "--preset=full"], "--preset: does not apply with --from-json"),
    (
        ["crosshead", "--preset", "smoke", "--no-plots", "--out", "runs_is_a_file"],
        "--out: 'runs_is_a_file/runs' is not a folder",
    ),
    # An unknown option is named even with the task (or folder) missing: argparse checked
    # the required arguments first and said only "required: task".
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--preset", "smoke", "--bogus=1"], "unrecognized arguments: --bogus=1"),
    (["report", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("args, flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_exits_2_with_one_line_and_writes_nothing(args, flag, workdir):
    before = _snapshot(workdir)
    proc = _run(args, workdir)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    # Every line of a subcommand names it: `damcha experiment report: error: ...` (its own checks
    # said `damcha experiment:` while its argument parser said `damcha experiment report:`).
    prog = "damcha experiment report" if args[0] == "report" else "damcha experiment"
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and flag in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert _snapshot(workdir) == before  # no partial folder; the earlier good file untouched


def test_cuda_when_absent_is_a_usage_error(workdir):
    import torch

    if torch.cuda.is_available():  # pragma: no cover - this project's CI has no GPU
        pytest.skip("a GPU is present: nothing to refuse")
    proc = _run(["crosshead", "--device", "cuda"], workdir)
    assert proc.returncode == 2 and "--device: 'cuda' is not available" in proc.stderr


@pytest.mark.parametrize(
    "module, args, extra",
    [
        ("matplotlib", ["crosshead", "--preset", "smoke"], "damcha[reports]"),
        ("sklearn", ["digits", "--preset", "smoke", "--no-plots"], "damcha[experiments]"),
        ("torch", ["crosshead", "--preset", "smoke", "--no-plots"], "damcha[torch]"),
        ("matplotlib", ["report", "."], "damcha[reports]"),
    ],
    ids=["matplotlib", "sklearn", "torch", "report-matplotlib"],
)
def test_missing_extra_is_named_before_any_work(module, args, extra, workdir):
    before = _snapshot(workdir)
    proc = _run(
        [*args, "--out", "new"] if args[0] != "report" else args,
        workdir,
        python_prelude=f"import sys; sys.modules[{module!r}] = None",
    )
    assert proc.returncode == 2, proc.stderr
    assert extra in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert _snapshot(workdir) == before


def test_no_arguments_print_help_and_exit_2(workdir):
    proc = _run([], workdir)
    assert proc.returncode == 2 and "usage: damcha experiment" in proc.stderr


def test_help_exits_0(workdir):
    for args in (["--help"], ["report", "--help"]):
        proc = _run(args, workdir)
        assert proc.returncode == 0 and "usage:" in proc.stdout


def test_good_from_json_replaces_an_earlier_file_atomically(workdir):
    """A valid --from-json into a folder with an older result replaces it; nothing else is left behind."""
    from damcha_experiments._suite import run_suite
    from damcha_experiments._tasks import task_config

    cfg = task_config("crosshead", "smoke", seeds=1, lrs=(1e-3,), max_steps=2)
    path = workdir / "results.json"
    path.write_text(json.dumps(run_suite(cfg, ["mha"], "headline", out=None)))
    proc = _run(["crosshead", "--from-json", str(path), "--out", "good", "--no-plots"], workdir)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((workdir / "good" / "crosshead.json").read_text()) == json.loads(path.read_text())
    assert sorted(p.name for p in (workdir / "good").iterdir()) == ["crosshead.json"]  # no staging leftovers
    # A results file missing a field the table needs: exit 2, the good file stays.
    broken = json.loads(path.read_text())
    del broken["variants"]["mha"]["steps"]
    (workdir / "broken.json").write_text(json.dumps(broken))
    before = _snapshot(workdir)
    proc = _run(["crosshead", "--from-json", "broken.json", "--out", "good", "--no-plots"], workdir)
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.endswith("--from-json: broken.json lacks steps at variants['mha']"), line
    assert _snapshot(workdir) == before


def test_interrupt_then_rerun_gives_the_uninterrupted_numbers(tmp_path):
    """Ctrl-C through the real command: checkpoint, exit 130, and the same command finishes the run exactly."""
    import signal
    import time

    from damcha_experiments._suite import run_suite
    from damcha_experiments._tasks import task_config

    args = [
        "charlm",
        "--preset",
        "default",
        "--variants",
        "mha",
        "--lrs",
        "1e-3",
        "--seeds",
        "1",
        "--max-steps",
        "40",
        "--eval-size",
        "4",
        "--no-cost",
        "--no-plots",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        [DAMCHA, "experiment", *args, "--out", "cut"],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "cut" / "runs" / "charlm-default-cpu" / "mha" / "lr0.001" / "seed0"
    deadline = time.monotonic() + 120
    while not run_dir.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "run the same command to resume" in err and "Traceback" not in err
    assert (run_dir / "checkpoint.pt").exists() and not (run_dir / "result.json").exists()
    assert not (tmp_path / "cut" / "charlm.json").exists()  # no results file from an unfinished suite
    import torch

    # As a checkpoint of an earlier version (no environments recorded): it resumes "elsewhere", which the
    # command says in one note line, not in Python's two-line warning with a file name and source line.
    payload = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    del payload["environments"]
    torch.save(payload, run_dir / "checkpoint.pt")
    done = _run([*args, "--out", "cut"], tmp_path)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "records no environment" in line]
    assert len(notes) == 1 and notes[0].startswith("damcha experiment: note: "), done.stderr
    assert "Warning" not in done.stderr, done.stderr
    resumed = json.loads((tmp_path / "cut" / "charlm.json").read_text())["variants"]["mha"]["runs"][0]
    assert resumed["resumed_at_step"] is not None and resumed["steps"] == 40
    cfg = task_config("charlm", "default", seeds=1, lrs=(1e-3,), max_steps=40, val_size=4, test_size=4)
    whole = run_suite(cfg, ["mha"], "headline", out=None)["variants"]["mha"]["runs"][0]
    for key in ("curve", "test_metric", "best_step", "final_params_sha256", "loss_spikes"):
        a, b = resumed[key], whole[key]
        if key == "curve":
            a, b = ({k: v for k, v in c.items() if k != "train_time_s"} for c in (a, b))
        assert a == b, key


@pytest.mark.parametrize("stored", ["result.json", "checkpoint.pt", "damaged"])
def test_out_with_runs_of_other_settings_fails_before_any_training(stored, tmp_path):
    """Every run folder the suite could resume is checked first: the stale one is named, nothing trains."""
    import torch

    folder = tmp_path / "out" / "runs" / "crosshead-smoke-cpu" / "mha" / "lr0.001" / "seed0"
    folder.mkdir(parents=True)
    other = {"lr": 0.001, "seed": 0, "torch_threads": 7}
    if stored == "result.json":
        (folder / stored).write_text(json.dumps({"identity": other}))
    elif stored == "damaged":
        stored = "checkpoint.pt"
        (folder / stored).write_bytes(b"not a checkpoint")
    else:
        torch.save({"format": 1, "identity": json.dumps(other)}, folder / stored)
    before = _snapshot(tmp_path)
    # talking-heads comes first and has no folder: before this check it trained, then mha failed.
    args = ["crosshead", "--preset", "smoke", "--variants", "talking-heads,mha", "--no-cost", "--no-plots"]
    proc = _run([*args, "--out", "out"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("damcha experiment: error: --out: "), proc.stderr
    assert str(Path("mha", "lr0.001", "seed0", stored)) in lines[0]
    assert ("torch_threads" if b"identity" in (folder / stored).read_bytes() else "cannot read") in lines[0]
    assert _snapshot(tmp_path) == before  # no talking-heads run folder


def test_charlm_eval_size_limit_is_the_number_of_distinct_windows():
    """At the bound every evaluation window starts at its own byte; one more would repeat a window."""
    import numpy as np

    from damcha_experiments import _data
    from damcha_experiments._tasks import eval_size_limit, task_config

    cfg = task_config("charlm", "smoke")
    limit = eval_size_limit("charlm", cfg.train_size, cfg.seq_len)
    corpus = _data.stdlib_corpus(max_bytes=cfg.train_size, val_fraction=0.1, test_fraction=0.1)
    assert limit == min(len(corpus.val), len(corpus.test)) - cfg.seq_len - 1
    last_start = min(len(corpus.val), len(corpus.test)) - cfg.seq_len - 2  # lm_eval_windows' spacing
    for count, distinct in ((limit, limit), (limit + 1, limit)):  # one more window repeats a start
        assert len(np.unique(np.linspace(0, last_start, count).astype(np.int64))) == distinct
    wins, targets = _data.lm_eval_windows(corpus.val, cfg.seq_len, limit)
    assert wins.shape == (limit, cfg.seq_len, 1) and targets.shape == (limit, cfg.seq_len)


# In-process (the CLI's main), small: smoke preset, one variant, one rate and seed, 2 steps, JSON only.
SMOKE = ["--preset", "smoke", "--seeds", "1", "--lrs", "1e-3", "--max-steps", "2", "--no-plots", "--no-progress"]


def _main(args: list[str], capsys) -> tuple[int, str]:
    from damcha_experiments._cli import main

    code = main(args)
    return code, capsys.readouterr().err


def _results_file(task: str, suite: str, preset: str, device: str, *, cost: bool = False) -> str:
    from damcha_experiments._tasks import RESULTS_FORMAT

    obj = {"format": RESULTS_FORMAT, "task": task, "suite": suite, "preset": preset, "device": device}
    return json.dumps(obj | ({"kind": "cost", "variants": {"mha": {}}} if cost else {"variants": {"mha": {}}}))


@pytest.mark.parametrize(
    "file, args, recorded, differing",
    [
        ("digits.json", [], {"preset": "large"}, "preset 'large' there, 'smoke' here"),
        ("digits.json", [], {"device": "cuda"}, "device type 'cuda' there, 'cpu' here"),
        (
            "digits.json",
            [],
            {"preset": "large", "device": "cuda"},
            "preset 'large' there, 'smoke' here; device type 'cuda' there, 'cpu' here",
        ),
        ("digits_cost.json", [], {"device": "cuda"}, "device type 'cuda' there, 'cpu' here"),
        ("digits_cost.json", ["--no-cost"], {"preset": "full"}, "preset 'full' there, 'smoke' here"),
        ("digits.json", ["--cost-only"], {"preset": "large"}, "preset 'large' there, 'smoke' here"),
        ("digits_ablation.json", ["--suite", "ablation"], {"device": "cuda"}, "device type 'cuda' there, 'cpu' here"),
        ("digits_ablation_cost.json", ["--suite", "ablation"], {"preset": "default"}, "preset 'default' there"),
    ],
    ids=["preset", "device", "both", "cost-file", "cost-file-no-cost", "cost-only", "ablation", "ablation-cost"],
)
def test_results_of_another_preset_or_device_are_refused_before_any_work(
    file, args, recorded, differing, tmp_path, capsys
):
    """The results files are named by task (and suite), not by preset or device as the run folders
    are: a CPU smoke run into a folder holding a CUDA `large` run's digits.json (or its cost file, or
    the ablation's) silently replaced them. Now it exits 2 before any work, naming the file and the
    differing fields; nothing in the folder changes."""
    out = tmp_path / "out"
    out.mkdir()
    suite = "ablation" if "ablation" in file else "headline"
    mine = {"preset": "smoke", "device": "cpu"} | recorded
    (out / file).write_text(_results_file("digits", suite, mine["preset"], mine["device"], cost="cost" in file))
    before = _snapshot(tmp_path)
    code, err = _main(["digits", *SMOKE, "--variants", "mha", *args, "--out", str(out)], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment: error: --out: {out / file} holds the results of another run ("), line
    assert differing in line and "give it another --out" in line
    assert _snapshot(tmp_path) == before  # no run folder, no results file


def test_same_preset_and_device_reruns_and_subsets_still_write_and_from_json_is_checked(tmp_path, capsys):
    """A rerun on the same preset and device type, or another --variants subset (the project splits
    its runs over processes so), replaces the results files as before; relabelled as a CUDA `large`
    run's, the same files are refused, for training and for --from-json alike."""
    out = tmp_path / "out"
    code, err = _main(["digits", *SMOKE, "--variants", "mha", "--out", str(out)], capsys)
    assert code == 0, err
    first = json.loads((out / "digits.json").read_text())
    assert (first["preset"], first["device"], list(first["variants"])) == ("smoke", "cpu", ["mha"])
    assert json.loads((out / "digits_cost.json").read_text())["preset"] == "smoke"
    code, err = _main(["digits", *SMOKE, "--variants", "talking-heads", "--no-cost", "--out", str(out)], capsys)
    assert code == 0, err
    assert list(json.loads((out / "digits.json").read_text())["variants"]) == ["mha", "talking-heads"]
    saved = tmp_path / "smoke-digits.json"
    saved.write_text(json.dumps(first))
    (out / "digits.json").write_text(json.dumps(first | {"preset": "large", "device": "cuda"}))
    before = _snapshot(tmp_path)
    for args in (["digits", *SMOKE, "--variants", "mha"], ["digits", "--from-json", str(saved), "--no-plots"]):
        code, err = _main([*args, "--out", str(out)], capsys)
        assert code == 2 and "preset 'large' there, 'smoke' here; device type 'cuda' there, 'cpu' here" in err, err
        assert _snapshot(tmp_path) == before


def test_subsets_in_sequence_merge_into_the_all_variant_results(tmp_path, capsys):
    """Two --variants subsets trained one after the other into one --out (the project splits a
    task's variants over processes so) left digits.json with the last subset only, and the report
    dropped the other. Now the second keeps the first's variants: the file equals, variant by
    variant, that of one command training both; a file of another config is replaced as before."""
    split, whole = tmp_path / "split", tmp_path / "whole"
    code, err = _main(["digits", *SMOKE, "--variants", "talking-heads", "--no-cost", "--out", str(split)], capsys)
    assert code == 0, err
    code, err = _main(["digits", *SMOKE, "--variants", "mha", "--no-cost", "--out", str(split)], capsys)
    assert code == 0, err
    (note,) = [line for line in err.splitlines() if "already holds" in line]
    assert f"{split / 'digits.json'} already holds talking-heads of this task" in note, note
    code, err = _main(["digits", *SMOKE, "--variants", "mha,talking-heads", "--no-cost", "--out", str(whole)], capsys)
    assert code == 0, err
    merged, one = (json.loads((d / "digits.json").read_text()) for d in (split, whole))
    assert list(merged["variants"]) == list(one["variants"]) == ["mha", "talking-heads"]
    for name in one["variants"]:
        for key in ("test", "val", "chosen_lr", "params", "steps"):
            assert merged["variants"][name][key] == one["variants"][name][key], (name, key)
    assert merged["config"] == one["config"]
    from damcha_experiments._report import markdown_table

    assert markdown_table(merged) == markdown_table(one)  # comparisons recomputed over the merged set
    # A file of another config (here its step limit relabelled): not merged, replaced by this
    # command's variants alone, as before.
    (split / "digits.json").write_text(json.dumps(merged | {"config": merged["config"] | {"max_steps": 3}}))
    code, err = _main(["digits", *SMOKE, "--variants", "mha", "--no-cost", "--out", str(split)], capsys)
    assert code == 0, err
    assert "already holds" not in err
    assert list(json.loads((split / "digits.json").read_text())["variants"]) == ["mha"]
    # ... and says so (talking-heads went without a word).
    (note,) = [line for line in err.splitlines() if "of another run" in line]
    assert f"{split / 'digits.json'} held talking-heads of another run (differing: config.max_steps)" in note, note


def test_a_merged_results_file_times_every_command_it_holds(tmp_path, monkeypatch, capsys):
    """A TASK.json merged from --variants subsets gave as its wall_s/cpu_s the last command's time
    alone, though they read as the file's. Now the file lists each command whose variants it holds
    (``commands``: its variants, wall_s, cpu_s) and wall_s/cpu_s are their sums; a command that
    retrains a subset replaces that subset's entry (no double count). The times are compared with
    run_suite's own, recorded around the real function."""
    from damcha_experiments import _suite

    real, timed = _suite.run_suite, []

    def recorded(*args, **kw):
        res = real(*args, **kw)
        timed.append(
            {"variants": list(res["variants"])}
            | {k: res[k] for k in ("wall_s", "cpu_s", "code_version", "started_utc", "finished_utc")}
        )
        return res

    monkeypatch.setattr(_suite, "run_suite", recorded)
    out = tmp_path / "out"

    def command(variants: str) -> dict:
        code, err = _main(["digits", *SMOKE, "--variants", variants, "--no-cost", "--out", str(out)], capsys)
        assert code == 0, err
        return json.loads((out / "digits.json").read_text())

    first = command("talking-heads")
    assert "commands" not in first and (first["wall_s"], first["cpu_s"]) == (timed[0]["wall_s"], timed[0]["cpu_s"])
    merged = command("mha")
    assert merged["commands"] == timed[:2]  # each command's provenance too: which code ran it, when
    for key in ("wall_s", "cpu_s"):
        assert merged[key] == pytest.approx(timed[0][key] + timed[1][key], rel=1e-12), key
    for key in ("code_version", "started_utc", "finished_utc"):  # the file's own: the last command's
        assert merged[key] == timed[1][key], key
    assert timed[0]["started_utc"] is not None and timed[1]["finished_utc"] is not None
    again = command("mha")  # mha's runs read back: its entry is replaced, not added
    assert again["commands"] == [timed[0], timed[2]]
    assert again["wall_s"] == pytest.approx(timed[0]["wall_s"] + timed[2]["wall_s"], rel=1e-12)
    whole = command("mha,talking-heads")  # one command holds every variant: its own time, as before
    assert "commands" not in whole and whole["wall_s"] == timed[3]["wall_s"]
    # A file without a time (hand-edited): its sum is null, not a partial sum read as the whole.
    (out / "digits.json").write_text(json.dumps({k: v for k, v in first.items() if k != "cpu_s"}))
    edited = command("mha")
    assert edited["cpu_s"] is None and edited["commands"][0]["cpu_s"] is None
    assert edited["commands"][0]["started_utc"] == first["started_utc"]
    assert edited["wall_s"] == pytest.approx(timed[0]["wall_s"] + timed[4]["wall_s"], rel=1e-12)


def test_a_rerun_on_another_device_type_says_it_starts_over(tmp_path, capsys):
    """Runs of another device type are never resumed (other numbers): a CPU rerun of a command whose
    runs are all in runs/digits-smoke-cuda trains afresh, as before, but now says so in one line."""
    out = tmp_path / "out"
    cuda = out / "runs" / "digits-smoke-cuda" / "mha" / "lr0.001" / "seed0"
    cuda.mkdir(parents=True)
    (cuda / "checkpoint.pt").write_bytes(b"a CUDA run's checkpoint (never read on the CPU)")
    args = ["digits", *SMOKE, "--variants", "mha", "--no-cost", "--out", str(out)]
    code, err = _main(args, capsys)
    assert code == 0, err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line.startswith(f"damcha experiment: note: no run of digits (smoke) on cpu to resume in {out / 'runs'}")
    assert "1 on cuda (digits-smoke-cuda)" in line and "starts over on cpu" in line, line
    assert (out / "runs" / "digits-smoke-cpu" / "mha" / "lr0.001" / "seed0" / "result.json").exists()
    code, err = _main(args, capsys)  # its own runs now: resumed, no note
    assert code == 0 and "note" not in err, err


@pytest.fixture(scope="module")
def digits_results(tmp_path_factory) -> Path:
    """A real digits results file (one variant, one run of 2 steps), for --from-json."""
    from damcha_experiments._suite import run_suite
    from damcha_experiments._tasks import task_config

    cfg = task_config("digits", "smoke", seeds=1, lrs=(1e-3,), max_steps=2)
    path = tmp_path_factory.mktemp("results") / "digits.json"
    path.write_text(json.dumps(run_suite(cfg, ["mha"], "headline", out=None)))
    return path


CUT = _results_file("digits", "headline", "smoke", "cpu")[:40]  # a file cut off mid-write


@pytest.mark.parametrize(
    "file, content, args, what",
    [
        ("digits.json", CUT, ["--variants", "mha"], "is not valid JSON"),
        ("digits.json", "", ["--variants", "mha"], "is empty"),
        ("digits.json", "[1, 2]", ["--variants", "mha"], "holds a JSON list, expected a JSON object"),
        ("digits_cost.json", CUT, ["--variants", "mha"], "is not valid JSON"),
        ("digits_cost.json", CUT, ["--variants", "mha", "--no-cost"], "is not valid JSON"),
        ("digits.json", CUT, ["--variants", "mha", "--cost-only"], "is not valid JSON"),
        ("digits_cost.json", CUT, ["--variants", "mha", "--cost-only"], "is not valid JSON"),
        ("digits_ablation.json", CUT, ["--suite", "ablation", "--variants", "mha"], "is not valid JSON"),
    ],
    ids=["train-cut", "train-empty", "train-list", "train-cost", "no-cost", "cost-only", "cost-only-cost", "ablation"],
)
def test_a_damaged_results_or_cost_file_is_named_before_any_work(file, content, args, what, tmp_path, capsys):
    """A TASK.json or TASK_cost.json cut off mid-write (or holding no object) was taken for an absent
    file: training replaced it with its subset alone (dropping the other variants' entries), and
    --cost-only drew no time plot, all silently. Now: exit 2 before any work, one line naming the
    file, what is wrong and what to do; nothing in the folder changes."""
    out = tmp_path / "out"
    out.mkdir()
    (out / file).write_text(content)
    before = _snapshot(tmp_path)
    code, err = _main(["digits", *SMOKE, *args, "--out", str(out)], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment: error: --out: {out / file} {what}"), line
    assert "move it away" in line, line
    assert _snapshot(tmp_path) == before  # no run folder, nothing replaced


def test_from_json_names_a_damaged_cost_file_beside_it(digits_results, tmp_path, capsys):
    """--from-json reads STEM_cost.json beside its file for the equal-time plot; cut off, it was
    silently ignored (a time plot on each run's own clock). Now exit 2 naming it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "digits.json").write_text(digits_results.read_text())
    (src / "digits_cost.json").write_text(CUT)
    before = _snapshot(tmp_path)
    code, err = _main(["digits", "--from-json", str(src / "digits.json"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment: error: --from-json: {src / 'digits_cost.json'} is not valid JSON")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("file", ["digits.json", "digits_cost.json", "digits_ablation.json"])
def test_report_refuses_a_damaged_results_file(file, digits_results, tmp_path, capsys):
    """A results or cost file cut off mid-write was skipped with a warning and the report written
    without it (claim 2 needs every task, claim 3 the cost files): now exit 2 naming it, no report."""
    (tmp_path / "digits.json").write_text(digits_results.read_text())
    (tmp_path / file).write_text(CUT)
    before = _snapshot(tmp_path)
    code, err = _main(["report", str(tmp_path), "--no-plots"], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment report: error: FOLDER: {tmp_path / file} is not valid JSON"), line
    assert "the report would lack it" in line
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("content", [{"hello": 1}, {"format": "damcha-experiment/1", "task": "digits"}])
@pytest.mark.parametrize("file", ["digits.json", "digits_cost.json"])
def test_report_refuses_a_results_named_file_of_another_kind(file, content, digits_results, tmp_path, capsys):
    """Valid JSON under a results or cost file's name that is not of the results format (a hand
    edit, an older format) was skipped without a word: the verdicts were drawn without it."""
    (tmp_path / "digits.json").write_text(digits_results.read_text())
    (tmp_path / file).write_text(json.dumps(content))
    before = _snapshot(tmp_path)
    code, err = _main(["report", str(tmp_path), "--no-plots"], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment report: error: FOLDER: {tmp_path / file} is named as a results file"), (
        line
    )
    assert repr(content.get("format")) in line and "the report would lack it" in line
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "out, says",
    [
        ("digits.md", "would replace"),  # its summary went to digits.json: the results themselves
        ("digits", "would replace"),
        ("digits_curves.png", "names the report's markdown file, not an image"),
    ],
    ids=["md-beside-results", "no-suffix", "plot"],
)
def test_report_out_never_replaces_the_experiments_files(out, says, digits_results, tmp_path, capsys):
    """`--out exp/digits.md` wrote the report's JSON summary over exp/digits.json, exit 0, and the
    next report refused the folder; `--out exp/digits_curves.png` wrote markdown over a plot."""
    (tmp_path / "digits.json").write_text(digits_results.read_text())
    (tmp_path / "digits_curves.png").write_bytes(b"\x89PNG")
    before = _snapshot(tmp_path)
    code, err = _main(["report", str(tmp_path), "--out", str(tmp_path / out), "--no-plots"], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("damcha experiment report: error: --out: ") and says in line, line
    assert _snapshot(tmp_path) == before
    code, err = _main(["report", str(tmp_path), "--out", str(tmp_path / "summary.md"), "--no-plots"], capsys)
    assert code == 0, err  # another name in the folder is fine
    assert json.loads((tmp_path / "digits.json").read_text()) == json.loads(digits_results.read_text())


def test_report_checks_its_time_plot_before_writing_anything(digits_results, tmp_path, capsys):
    """A read-only time plot ended the report with a PermissionError traceback after report.md and
    report.json were written."""
    import matplotlib  # noqa: F401 - the plots need it; a missing reports extra must fail here, not skip

    (tmp_path / "digits.json").write_text(digits_results.read_text())
    plot = tmp_path / "digits_time.png"
    plot.write_bytes(b"\x89PNG")
    plot.chmod(0o444)
    before = _snapshot(tmp_path)
    code, err = _main(["report", str(tmp_path)], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert (
        line
        == f"damcha experiment report: error: FOLDER: file exists and is read-only; it is not replaced. Received: {str(plot)!r}"
    )
    assert _snapshot(tmp_path) == before


def test_a_damaged_run_result_is_rerun_with_a_note_and_the_report_says_so(tmp_path, capsys):
    """A run's result.json cut off mid-write made the rerun exit 2 ("delete that folder") and the
    report silently leave the run out. The run can be recreated: the rerun now says so in one line,
    trains it again and writes the numbers of the first run; the report notes the file it skipped."""
    out = tmp_path / "out"
    args = ["digits", *SMOKE, "--variants", "mha", "--no-cost", "--out", str(out)]
    code, err = _main(args, capsys)
    assert code == 0, err
    first = json.loads((out / "digits.json").read_text())
    result = out / "runs" / "digits-smoke-cpu" / "mha" / "lr0.001" / "seed0" / "result.json"
    text = result.read_text()
    result.write_text(text[: len(text) // 2])
    code, err = _main(["report", str(out), "--no-plots"], capsys)
    assert code == 0, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment report: note: skipped {result}: it is not valid JSON"), line
    assert "counts as unfinished" in line
    assert str(result.relative_to(out)) in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["damaged_run_results"][0][0] == str(result)
    code, err = _main(args, capsys)
    assert code == 0, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment: note: {result} is not valid JSON"), line
    assert line.endswith(
        "the run counts as unfinished and trains again from step 0; the file is rewritten when it finishes"
    )
    again = json.loads((out / "digits.json").read_text())
    for key in ("test", "val", "steps", "chosen_lr"):
        assert again["variants"]["mha"][key] == first["variants"]["mha"][key], key
    assert json.loads(result.read_text())["test_metric"] == first["variants"]["mha"]["runs"][0]["test_metric"]


def test_results_files_are_renamed_into_place(digits_results, tmp_path, monkeypatch, capsys):
    """TASK.json is written into a staging folder beside --out (same file system) and renamed over the
    old file: a command that dies before the rename leaves the earlier file whole and no staging folder."""
    import os

    out = tmp_path / "out"
    out.mkdir()
    (out / "digits.json").write_text('{"earlier": "good"}\n')
    real, renames = os.replace, []

    def dies(src, dst):
        renames.append((Path(src), Path(dst)))
        if Path(dst) == out / "digits.json":
            raise OSError("the machine died")
        real(src, dst)

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(OSError, match="died"):
        _main(["digits", "--from-json", str(digits_results), "--no-plots", "--out", str(out)], capsys)
    monkeypatch.setattr(os, "replace", real)
    src, dst = renames[-1]
    assert dst == out / "digits.json" and src.parent.parent == out.parent  # a staging folder beside --out
    assert (out / "digits.json").read_text() == '{"earlier": "good"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_cost_subsets_merge_into_the_all_variant_cost_file(tmp_path, monkeypatch, capsys):
    """Each cost command wrote digits_cost.json with its own variants only, so `--cost-only
    --variants mha damcha-heads-tied` after a measurement of talking-heads dropped it (and the
    report's claim 3 with it). Now a measurement of the same settings merges: the file holds the
    variants one all-variant command writes, each ratio still taken against the MHA rounds of its
    own measurement (equal to that measurement's ratio) and recording its own environment; the
    report reads it. A file measured otherwise (here: another thread count) is replaced as before."""
    from damcha_experiments import _analysis as an
    from damcha_experiments import _cost

    # Commands a second apart can record equal environments (date to the second, load average): number them.
    calls, environment = [], _cost.environment
    monkeypatch.setattr(
        _cost, "environment", lambda d: environment(d) | {"date": f"call {len(calls.append(0) or calls)}"}
    )
    split, whole = tmp_path / "split", tmp_path / "whole"
    three = ["mha", "talking-heads", "damcha-heads-tied"]
    code, err = _main(["digits", *SMOKE, "--variants", *three, "--no-cost", "--out", str(split)], capsys)
    assert code == 0, err
    cost = ["digits", *SMOKE, "--cost-only", "--variants"]
    code, err = _main([*cost, "mha", "talking-heads", "--out", str(split)], capsys)
    assert code == 0 and "already holds" not in err, err
    first = json.loads((split / "digits_cost.json").read_text())
    code, err = _main([*cost, "mha", "damcha-heads-tied", "--out", str(split)], capsys)
    assert code == 0, err
    (note,) = [line for line in err.splitlines() if "already holds" in line]
    assert f"{split / 'digits_cost.json'} already holds the cost of talking-heads, measured alike" in note, note
    code, err = _main([*cost, *three, "--out", str(whole)], capsys)
    assert code == 0, err
    merged, one = (json.loads((d / "digits_cost.json").read_text()) for d in (split, whole))
    assert list(merged["variants"]) == list(one["variants"]) == three
    assert list(merged["params_check"]) == list(one["params_check"]) == three
    untimed = ("params", "mlp_hidden", "activation_bytes", "param_bytes", "optimizer_bytes", "train_bytes")
    for name in three:
        for key in (*untimed, "activation_ratio_vs_mha", "train_bytes_ratio_vs_mha"):
            assert merged["variants"][name][key] == one["variants"][name][key], (name, key)
    kept = merged["variants"]["talking-heads"]
    assert kept["environment"] == first["environment"] != merged["environment"]
    # Which code measured each entry, and when: its own measurement's (the file's: the last one's).
    for key in ("code_version", "started_utc", "finished_utc"):
        assert kept[key] == first[key] and merged["variants"]["damcha-heads-tied"][key] == merged[key], key
    assert first["started_utc"] <= first["finished_utc"] <= merged["started_utc"]
    assert kept["mha_round_s_per_step"] == first["variants"]["mha"]["round_s_per_step"]
    assert an.time_ratio(merged, "talking-heads") == an.time_ratio(first, "talking-heads")
    # The report reads the merged file: claim 3 rates the DAMCHA variant, the cost table lists all three.
    code, err = _main(["report", str(split), "--no-plots"], capsys)
    assert code == 0, err
    report = (split / "report.md").read_text()
    assert "measured in separate commands: mha, damcha-heads-tied on call 3, load average " in report
    assert "; talking-heads on call 1, load average " in report
    for name in three:
        assert sum(line.startswith(f"| {name} | ") for line in report.splitlines()) >= 2, name  # results + cost
    (claim3,) = [v for v in json.loads((split / "report.json").read_text())["verdicts"] if v["claim"] == 3]
    assert [r["variant"] for r in claim3["rows"]] == ["damcha-heads-tied"]
    assert claim3["rows"][0]["time_ratio"] == an.time_ratio(merged, "damcha-heads-tied")["median"]
    # Measured otherwise: replaced by this command's variants alone.
    (split / "digits_cost.json").write_text(json.dumps(merged | {"torch_threads": 7}))
    code, err = _main([*cost, "mha", "--out", str(split)], capsys)
    assert code == 0 and "already holds" not in err, err
    assert list(json.loads((split / "digits_cost.json").read_text())["variants"]) == ["mha"]


@pytest.mark.parametrize(
    "file, damage, message",
    [
        (
            "digits_cost.json",
            lambda o: o["variants"]["mha"]["round_s_per_step"].__setitem__(0, 0.0),
            "holds variants['mha']['round_s_per_step'][0]=0.0, expected a time > 0 in seconds",
        ),
        ("digits_cost.json", lambda o: o.pop("batch"), "lacks batch"),
        ("digits.json", lambda o: o.pop("config"), "lacks config"),
        (
            "digits.json",
            lambda o: o["variants"]["mha"]["runs"][0]["curve"].pop("val_metric"),
            "lacks val_metric at variants['mha']['runs'][0]['curve']",
        ),
    ],
    ids=["zero-round-time", "cost-field", "results-field", "curve-field"],
)
def test_a_results_or_cost_file_without_a_field_is_named_in_report_and_training(
    file, damage, message, tmp_path, capsys
):
    """A file of the results format lacking a field the commands read ended the report with a
    KeyError traceback (exit 1), and training into its folder with one after the training; a cost
    file's zero round time with a traceback not naming the file. Now exit 2 before any work, naming
    the file and where the field is missing."""
    out = tmp_path / "out"
    code, err = _main(["digits", *SMOKE, "--variants", "mha", "--out", str(out)], capsys)
    assert code == 0, err
    obj = json.loads((out / file).read_text())
    damage(obj)
    (out / file).write_text(json.dumps(obj))
    before = _snapshot(tmp_path)
    for args, prog in (
        (["report", str(out), "--no-plots"], "damcha experiment report"),
        (["digits", *SMOKE, "--variants", "mha", "--lrs", "3e-3", "--out", str(out)], "damcha experiment"),
    ):
        code, err = _main(args, capsys)
        assert code == 2, err
        (line,) = err.strip().splitlines()
        assert line.startswith(f"{prog}: error: ") and f"{out / file} {message}" in line, line
        assert _snapshot(tmp_path) == before  # nothing trained, nothing written


def test_from_json_of_a_cost_file_says_so(digits_results, tmp_path, capsys):
    """It said "(format 'damcha-experiment/2', expected 'damcha-experiment/2')"."""
    out = tmp_path / "out"
    code, err = _main(["digits", *SMOKE, "--variants", "mha", "--out", str(out)], capsys)
    assert code == 0, err
    code, err = _main(["digits", "--from-json", str(out / "digits_cost.json"), "--no-plots"], capsys)
    assert code == 2 and "is a cost file (TASK_cost.json), not a results file (TASK.json)" in err, err


def _damaged_copy(src: Path, folder: Path, damage) -> Path:
    obj = json.loads(src.read_text())
    damage(obj)
    folder.mkdir(exist_ok=True)
    path = folder / "digits.json"
    path.write_text(json.dumps(obj, allow_nan=True))
    return path


def _set(*keys_and_value):
    *keys, last, value = keys_and_value

    def damage(obj):
        for k in keys:
            obj = obj[k]
        obj[last] = value

    return damage


MHA_RUN = ("variants", "mha", "runs", 0)


@pytest.mark.parametrize(
    "damage, where, says",
    [
        (_set(*MHA_RUN, "test_metric", "0.5"), "variants['mha']['runs'][0]['test_metric']='0.5'", "expected a number"),
        (_set("variants", "mha", "runs", {"0": {}}), "variants['mha']['runs']={'0': {}}", "expected a list"),
        (_set("seeds", "3"), "seeds='3'", "expected an int"),
        (_set("variants", "mha", "test", "mean", None), "variants['mha']['test']['mean']=None", "expected a number"),
        (_set(*MHA_RUN, "curve", "step", [1.5]), "variants['mha']['runs'][0]['curve']['step']=[1.5]", "list of ints"),
        (_set(*MHA_RUN, "diverged", 0), "variants['mha']['runs'][0]['diverged']=0", "expected true or false"),
    ],
    ids=["test-metric-string", "runs-object", "seeds-string", "mean-null", "curve-step-float", "diverged-int"],
)
def test_from_json_names_a_field_of_the_wrong_type(damage, where, says, digits_results, tmp_path, capsys):
    """A field of another JSON type failed with "incomplete (TypeError: must be real number, not str)",
    naming no field, or passed unnoticed with --no-plots (exit 0). Now: exit 2 naming the field's
    path in the file, its value and JSON type, and what was expected."""
    path = _damaged_copy(digits_results, tmp_path / "in", damage)
    code, err = _main(["digits", "--from-json", str(path), "--no-plots", "--out", str(tmp_path / "o")], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment: error: --from-json: {path} holds {where} (a JSON "), line
    assert says in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "damage, says",
    [
        (
            _set("variants", "mha", "test", "mean", float("nan")),
            "variants['mha']['test']['mean']=nan (a JSON float), expected a finite number: every run's test_metric",
        ),
        (
            _set("variants", "mha", "steps", "mean", float("inf")),
            "variants['mha']['steps']['mean']=inf (a JSON float), expected a finite number: every run's steps",
        ),
        (
            _set(*MHA_RUN, "test_metric", float("nan")),
            "variants['mha']['runs'][0]['test_metric']=nan (a JSON float), expected an accuracy in [0, 1] (NaN only "
            "in a diverged run)",
        ),
        (_set(*MHA_RUN, "test_metric", 1.5), "['test_metric']=1.5 (a JSON float), expected an accuracy in [0, 1]"),
    ],
    ids=["test-mean-nan", "steps-mean-inf", "run-nan-not-diverged", "accuracy-above-1"],
)
def test_from_json_refuses_metrics_no_run_could_have_written(damage, says, digits_results, tmp_path, capsys):
    """A hand-edited NaN in a finished run's metrics printed "nan +- nan" and exited 0."""
    path = _damaged_copy(digits_results, tmp_path / "in", damage)
    code, err = _main(["digits", "--from-json", str(path), "--no-plots", "--out", str(tmp_path / "o")], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"damcha experiment: error: --from-json: {path} holds ") and says in line, line


def test_from_json_keeps_the_nan_of_a_diverged_run_as_the_trainer_writes_it(tmp_path, monkeypatch, capsys):
    """The refusals above must not catch what training writes: a run whose first loss is NaN stops as
    diverged with test_metric NaN, and its summary is NaN; that file redraws, exit 0."""
    import torch.nn.functional as F

    from damcha_experiments._report import write_json
    from damcha_experiments._suite import run_suite
    from damcha_experiments._tasks import task_config

    cross_entropy = F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda *a, **k: cross_entropy(*a, **k) * float("nan"))
    cfg = task_config("digits", "smoke", seeds=1, lrs=(1e-3,), max_steps=2)
    results = run_suite(cfg, ["mha"], "headline", out=None)
    monkeypatch.undo()
    (run,) = results["variants"]["mha"]["runs"]
    assert run["diverged"] and run["test_metric"] != run["test_metric"]  # NaN, as the trainer writes it
    path = write_json(results, tmp_path / "digits.json")
    code, err = _main(["digits", "--from-json", str(path), "--no-plots", "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
