"""One training run: model, optimiser, plateau rule, stability counters and resumable checkpoints.

``train_run`` trains one (task config, variant, learning rate, seed) and
returns a plain-JSON result. With a ``run_dir`` it checkpoints at every
evaluation and resumes from the last checkpoint: model, optimiser, torch
RNG, the data order and every counter are restored, so a resumed run ends
with exactly (bitwise) the numbers of an uninterrupted one. Only the wall
and CPU time measurements differ. That guarantee is tested within one
environment (same versions, CPU, threads, device); a checkpoint carries the
environments it ran in, and the result lists each with the step it started at
(``environments``), warning when a run resumes in another one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from damcha_core import DamchaValueError
from damcha_core import _cliutil as cu

from ._analysis import environment_change
from ._jsonfile import (  # RESULT_FIELDS: also read here as _train.RESULT_FIELDS
    RESULT_FIELDS,
    IncompleteJsonObject,
    JsonFileError,
    UnreadableJsonFile,
    read_json_object,
    require_fields,
)
from ._models import (
    DigitsViT,
    TinyTransformer,
    Variant,
    as_variant,
    attention_factory,
    count_parameters,
    damcha_layers,
    match_width,
    metric_parameter_names,
    prepare_model,
)
from ._provenance import code_version, utc_now
from ._tasks import DATA_VERSIONS, TaskConfig, TaskData

CHECKPOINT_FORMAT = 1


class RunInterrupted(Exception):
    """Raised when ``should_stop`` asked a run to stop; its checkpoint is saved."""


class RunSettingsMismatch(DamchaValueError):
    """A run folder holds a checkpoint or result of other settings, or one that cannot be read.

    ``path`` is that file; ``differs`` names the identity fields that differ
    (``["config.max_steps", "torch_threads"]``), empty when the file could not be read.
    """

    def __init__(self, message: str, path: Path, differs: list[str]) -> None:
        super().__init__(message)
        self.path, self.differs = path, differs


def identity_differences(stored: Any, current: Any, prefix: str = "") -> list[str]:
    """The dotted names of the fields where two run identities differ (``config.max_steps``)."""
    if not (isinstance(stored, dict) and isinstance(current, dict)):
        return [prefix or "identity"] if stored != current else []
    names: list[str] = []
    for key in sorted(set(stored) | set(current), key=str):
        names += identity_differences(
            stored.get(key), current.get(key), f"{prefix}{key}" if not prefix else f"{prefix}.{key}"
        )
    return names


def _mismatch(path: Path, stored: Any, identity: dict[str, Any]) -> RunSettingsMismatch:
    differs = identity_differences(stored, _json_roundtrip(identity))
    return RunSettingsMismatch(
        f"{path} belongs to a run with other settings (differing: {', '.join(differs) or 'format'}; preset, "
        "overrides, threads or code changed); use another --out or delete that folder",
        path,
        differs,
    )


class UnreadableResultWarning(UserWarning):
    """A run's ``result.json`` is not valid JSON (cut off mid-write) or lacks a field: the run is
    treated as unfinished (resumed from its checkpoint, else trained again) and the file rewritten."""


def _read_result(path: Path, identity: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A finished run's result at ``path`` (which exists) and None, or None and why it is damaged.

    A file cut off mid-write (a machine that died, an interrupted copy), of bytes that are not
    UTF-8, holding another JSON value or lacking a field is damaged: it can be recreated, so the
    caller treats the run as unfinished rather than exit or read a result with missing fields. A
    readable result of another identity raises ``RunSettingsMismatch``, and so does a file the
    system cannot read (permissions, I/O error). The parsing is ``read_json_object``'s, the one of
    every results file; only this policy differs (a damaged results file ends the command).
    """
    try:
        done = read_json_object(path)
    except UnreadableJsonFile as exc:
        raise RunSettingsMismatch(f"{exc}; delete that folder to restart the run", path, []) from None
    except JsonFileError as exc:  # InvalidJsonFile, NotAJsonObject: damaged content
        return None, exc.reason
    if done is None:  # removed since the caller saw it
        return None, "was removed while it was read"
    current = _json_roundtrip(identity)
    try:
        require_fields(path, done, RESULT_FIELDS)
    except IncompleteJsonObject as exc:
        if done.get("identity") != current:
            raise _mismatch(path, done.get("identity"), identity) from None
        return None, exc.reason
    if done["identity"] != current:
        return _ended_before_the_cap(path, done, current), None
    return done, None


def _ended_before_the_cap(path: Path, done: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """``done``, a finished run of another step cap only, as a run of ``identity``'s cap; else refused.

    The cap enters training only as the stop condition (``train_run``): the schedule, the plateau
    rule, the data order and every draw are the same under any cap, so a run the plateau rule (or
    a divergence) stopped at step s is, bit for bit, the run of any cap >= s
    (``test_a_raised_step_cap_reuses_runs_the_plateau_rule_stopped``), unless s is the extra
    evaluation an off-grid cap adds (s = the old cap, not a multiple of ``eval_every``). Such a result is returned
    under the new identity, with ``reused_from_max_steps`` naming the cap it was trained under; the
    file is left as it is. A run that stopped at its cap has more to train: refused, saying so.
    """
    stored = done["identity"]
    if identity_differences(stored, identity) != ["config.max_steps"]:
        raise _mismatch(path, stored, identity)
    cap, old_cap = identity["config"]["max_steps"], stored["config"]["max_steps"]
    every = stored["config"]["eval_every"]
    # A cap off the evaluation grid adds one evaluation at the cap itself (train_run), and the plateau
    # rule reads it: a run it stopped there stopped only because of that cap. A divergence is caught
    # at the step it happens, before any evaluation of that step.
    on_grid = done["stop_reason"] == "diverged" or done["steps"] % every == 0
    if done["stop_reason"] in ("plateau", "diverged") and done["steps"] <= cap and on_grid:
        return dict(done, identity=identity, reused_from_max_steps=old_cap)
    if done["steps"] > cap:
        why = f"ran {done['steps']} steps, beyond the cap of {cap}"
    elif done["stop_reason"] == "max_steps":
        why = f"stopped at its step cap ({done['steps']} steps), so it would train on under the cap of {cap}"
    else:
        why = (
            f"the plateau rule stopped at the evaluation its cap of {old_cap} adds off the every-{every}-steps "
            f"grid (step {done['steps']}), so it would train on under the cap of {cap}"
        )
    raise RunSettingsMismatch(
        f"{path} belongs to a run with another step cap (differing: config.max_steps) that {why}; "
        "delete that folder to train it again, or use another --out",
        path,
        ["config.max_steps"],
    )


def check_run_dir(run_dir: str | Path, identity: dict[str, Any]) -> bool:
    """Whether ``run_dir`` holds a finished run of ``identity``; raises ``RunSettingsMismatch`` if it holds another.

    A ``result.json`` that is not valid JSON or lacks a field counts as no result (``_read_result``).
    Reads only the stored identities (``result.json``, then ``checkpoint.pt``), so a suite can check every
    folder it would resume before it trains anything. The device is no argument: ``identity`` carries the
    device type (``run_identity``), so a folder of a CUDA run checked for a CPU run is refused naming
    ``device``, and the checkpoint is read onto the CPU whatever device wrote it (only its identity is
    looked at), so this works on a machine without that device. ``train_run`` then loads the tensors onto
    the run's device.
    """
    run_dir = Path(run_dir)
    result, ckpt = run_dir / "result.json", run_dir / "checkpoint.pt"
    # A damaged result.json (``_read_result``) is an unfinished run: its checkpoint, if any, is checked.
    if result.exists() and _read_result(result, identity)[0] is not None:
        return True
    if ckpt.exists():
        try:
            payload = torch.load(ckpt, map_location="cpu", weights_only=True)
            fmt, stored = payload.get("format"), json.loads(payload["identity"])
        except Exception as exc:  # noqa: BLE001 - a damaged file is named, never half-used
            raise RunSettingsMismatch(
                f"cannot read the checkpoint {ckpt} ({type(exc).__name__}: {exc}); delete it to restart that run",
                ckpt,
                [],
            ) from None
        if fmt != CHECKPOINT_FORMAT or stored != _json_roundtrip(identity):
            raise _mismatch(ckpt, stored, identity)
    return False


class ResumedElsewhereWarning(UserWarning):
    """A run resumed from a checkpoint written in another environment (or one that records none)."""


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run_environment(device: torch.device) -> dict[str, Any]:
    """What a run's numbers may depend on beyond its identity: versions, CPU, threads, device.

    The resume guarantee (bitwise the numbers of an uninterrupted run) is tested
    within one environment only; another torch, NumPy, CPU kernel set
    (``cpu_capability``: torch picks its CPU kernels by it) or GPU can change
    the last bits. Nothing here varies between two processes on one machine
    (no date or load), so a change means another environment.
    """
    device = torch.device(device)
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env


# ------------------------------------------------------------------ models


def build_model(data: TaskData, variant: Variant, mlp_hidden: int) -> nn.Module:
    """The task's model with ``variant``'s attention, on the CPU, ablation options applied."""
    cfg = data.cfg
    model: nn.Module
    if data.images:
        model = DigitsViT(
            data.num_outputs,
            embed_dim=cfg.embed_dim,
            num_heads=cfg.num_heads,
            num_layers=cfg.num_layers,
            mlp_hidden=mlp_hidden,
        )
        model = as_variant(model, variant)
    else:
        factory = attention_factory(variant, cfg.embed_dim, cfg.num_heads, cfg.num_layers)
        model = TinyTransformer(
            data.vocab_sizes,
            data.num_outputs,
            factory,
            embed_dim=cfg.embed_dim,
            num_layers=cfg.num_layers,
            mlp_hidden=mlp_hidden,
            max_len=data.max_len,
            causal=data.causal,
            readout=data.readout,
            pad_id=data.pad_id,
        )
    return prepare_model(model, variant)


def model_width(data: TaskData, variant: Variant) -> tuple[int, int]:
    """(MLP width, parameters) of ``variant`` at the task's fixed parameter budget."""
    cfg = data.cfg
    return match_width(lambda h: build_model(data, variant, h), cfg.param_budget, cfg.mlp_hidden)


def param_groups(model: nn.Module, lr: float, variant: Variant, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on weight matrices only; gates and generators at lr x ``metric_lr_mult``.

    Each group remembers its ``base_lr``; the loop sets ``lr`` from it every step.
    """
    metric_names = metric_parameter_names(model)
    # No decay on embedding tables, norms, learned positions / CLS token, biases and gates.
    tables = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.LayerNorm)) for p in m.parameters()}
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            decay = p.dim() >= 2 and id(p) not in tables and name not in ("positions", "cls")
            groups.setdefault((name in metric_names, decay), []).append(p)
    out = []
    for (is_metric, decay), params in sorted(groups.items()):
        base = lr * (variant.metric_lr_mult if is_metric else 1.0)
        out.append({"params": params, "lr": base, "base_lr": base, "weight_decay": weight_decay if decay else 0.0})
    return out


# -------------------------------------------------------------- evaluation


def _to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


@torch.no_grad()
def evaluate(
    model: nn.Module, data: TaskData, split: tuple[np.ndarray, np.ndarray], device: torch.device, chunk: int = 256
) -> tuple[float, float]:
    """(mean loss in nats, metric) on ``split``: accuracy, or bits per char for the LM."""
    was_training = model.training
    model.eval()
    inputs, targets = split
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(targets), chunk):
        x, y = _to_device(inputs[start : start + chunk], device), _to_device(targets[start : start + chunk], device)
        logits = model(x)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        total_loss += float(F.cross_entropy(flat, y.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    model.train(was_training)
    loss = total_loss / count
    return loss, (loss / math.log(2) if data.corpus is not None else correct / count)


# ---------------------------------------------------------------- the loop


def is_spike(value: float, recent: list[float], cfg: TaskConfig) -> bool:
    """A training loss that jumps above ``spike_factor`` x the median of the
    ``recent`` losses *and* by at least ``spike_min_jump`` nats: near
    convergence an ordinary batch is often several times the tiny median."""
    median = float(np.median(recent))
    return value > cfg.spike_factor * median and value - median >= cfg.spike_min_jump


@dataclasses.dataclass
class RunState:
    """Everything of a run besides model, optimiser and RNGs that a checkpoint must restore."""

    step: int = 0
    lr_scale: float = 1.0
    decays: list[int] = dataclasses.field(default_factory=list)
    bad_evals: int = 0
    best_index: int | None = None
    stop_reason: str | None = None
    window: list[float] = dataclasses.field(default_factory=list)  # train losses since the last evaluation
    recent: list[float] = dataclasses.field(default_factory=list)  # the last spike_window losses
    spikes: list[int] = dataclasses.field(default_factory=list)
    train_time: float = 0.0
    cpu_time: float = 0.0
    curve: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {
            k: []
            for k in (
                "step",
                "train_loss",
                "val_loss",
                "val_metric",
                "test_loss",
                "test_metric",
                "lr_scale",
                "train_time_s",
            )
        }
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _score(cfg: TaskConfig, metric: float) -> float:
    """Larger is better, whatever the metric."""
    return metric if cfg.higher_is_better else -metric


def run_identity(
    cfg: TaskConfig, variant: Variant, lr: float, seed: int, mlp_hidden: int, device: torch.device
) -> dict[str, Any]:
    """What a run's numbers depend on; a checkpoint or result is reused only when this matches."""
    identity = {
        "config": cfg.run_fingerprint(),
        "variant": dataclasses.asdict(variant),
        "lr": float(lr),
        "seed": int(seed),
        "mlp_hidden": int(mlp_hidden),
        "device": device.type,
        "torch_threads": torch.get_num_threads() if device.type == "cpu" else None,
    }
    if cfg.task in DATA_VERSIONS:
        identity["data_version"] = DATA_VERSIONS[cfg.task]
    return identity


def _json_roundtrip(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _save_checkpoint(
    path: Path,
    identity: dict[str, Any],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    order: Any,
    state: RunState,
    device: torch.device,
    environments: list[dict[str, Any]],
    stretches: list[dict[str, Any]],
) -> None:
    payload = {
        "format": CHECKPOINT_FORMAT,
        "identity": json.dumps(identity, sort_keys=True),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "order": json.dumps(order.state_dict()),
        "state": json.dumps(dataclasses.asdict(state)),
        # Not part of the identity: a checkpoint resumes anywhere, the result says where each stretch ran.
        "environments": json.dumps(environments),
        # Each process's stretch of the run: its first step, start time and code version.
        "stretches": json.dumps(stretches),
    }
    with cu.atomic_write(path, "wb") as f:  # never a half-written checkpoint
        torch.save(payload, f)


def _load_checkpoint(
    path: Path, identity: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer, order: Any, device: torch.device
) -> tuple[RunState, list[dict[str, Any]], list[dict[str, Any]]]:
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
        stored = payload["identity"]
    except Exception as exc:  # noqa: BLE001 - a damaged file is named, never half-used
        raise RunSettingsMismatch(
            f"cannot read the checkpoint {path} ({type(exc).__name__}: {exc}); delete it to restart that run", path, []
        ) from None
    if payload.get("format") != CHECKPOINT_FORMAT or json.loads(stored) != _json_roundtrip(identity):
        raise _mismatch(path, json.loads(stored), identity)
    model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"].cpu())
    if payload["cuda_rng"] is not None:
        torch.cuda.set_rng_state(payload["cuda_rng"].cpu(), device)
    order.load_state_dict(json.loads(payload["order"]))
    # A checkpoint written before environments were recorded: its steps ran somewhere unknown.
    environments = json.loads(payload.get("environments", '[{"first_step": 1, "environment": null}]'))
    # One written before stretches were recorded: when its steps started and on which code is unknown.
    stretches = json.loads(payload.get("stretches", '[{"first_step": 1, "started_utc": null, "code_version": null}]'))
    return RunState(**json.loads(payload["state"])), environments, stretches


def train_run(
    data: TaskData,
    variant: Variant,
    lr: float,
    seed: int,
    mlp_hidden: int,
    *,
    device: torch.device | str = "cpu",
    run_dir: str | Path | None = None,
    should_stop: Callable[[int], bool] | None = None,
    on_eval: Callable[[int, float], None] | None = None,
    head_maps: bool = False,
) -> dict[str, Any]:
    """Train one model until the plateau rule stops it (or ``max_steps``); returns its plain-JSON result.

    Args:
        data: the task's data (its ``cfg`` holds the preset).
        variant, lr, seed, mlp_hidden: what to train. The seed fixes the
            initialisation and, alone, the data order (the paired design).
        device: where to train; the model is initialised on the CPU first,
            so every device starts from the same weights.
        run_dir: folder for ``checkpoint.pt`` and ``result.json``; a finished
            run there is returned as is, an unfinished one resumes. A
            ``result.json`` that is not valid JSON or lacks a field is an
            unfinished run (``UnreadableResultWarning``).
        should_stop: called with the step number after each step; ``True``
            saves a checkpoint and raises ``RunInterrupted``.
        on_eval: called with (step, validation metric) after each evaluation.
        head_maps: store the token-mean cross-head factor per DAMCHA layer.

    The result has the curve (every evaluation: train loss, validation and
    test loss and metric, learning-rate scale, cumulative training seconds),
    the best-validation point and the test metric *at* it (early stopping:
    the test set is never used for a decision), the stop reason ("plateau",
    "max_steps" or "diverged"), the steps at which each threshold of the
    validation metric was first reached, loss spikes, and time per step;
    ``environment`` (``run_environment``) is where it finished and
    ``environments`` every environment it ran in, ``{"first_step": s,
    "environment": {...}}`` in order (one entry unless it resumed from a
    checkpoint written elsewhere; ``null`` for steps of a checkpoint that
    recorded none). Provenance (``_provenance``): ``code_version``
    (``{"commit", "dirty"}`` of the git checkout this process runs, or
    ``null`` outside one), ``started_utc`` (when the run's first step
    started; ``null`` when it resumed from a checkpoint that predates the
    record), ``finished_utc``, and ``stretches``: one ``{"first_step",
    "started_utc", "code_version"}`` per process that trained part of it.
    Results written before these fields lack them.
    """
    cfg = data.cfg
    device = torch.device(device)
    identity = run_identity(cfg, variant, lr, seed, mlp_hidden, device)
    paths = None
    if run_dir is not None:
        run_dir = Path(run_dir)
        paths = {"ckpt": run_dir / "checkpoint.pt", "result": run_dir / "result.json"}
        if paths["result"].exists():
            done, damage = _read_result(paths["result"], identity)
            if done is not None:
                return done
            warnings.warn(
                f"{paths['result']} {damage}: the run counts as unfinished and "
                + ("resumes from its checkpoint" if paths["ckpt"].exists() else "trains again from step 0")
                + "; the file is rewritten when it finishes",
                UnreadableResultWarning,
                stacklevel=2,
            )
        run_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    model = build_model(data, variant, mlp_hidden).to(device)
    opt = torch.optim.AdamW(param_groups(model, lr, variant, cfg.weight_decay), lr=lr)
    order = data.order(seed)
    state = RunState()
    resumed_at = None
    environment = _json_roundtrip(run_environment(device))
    environments = [{"first_step": 1, "environment": environment}]
    stretch = {"first_step": 1, "started_utc": utc_now(), "code_version": code_version()}
    stretches = [stretch]
    if paths is not None and paths["ckpt"].exists():
        state, environments, stretches = _load_checkpoint(paths["ckpt"], identity, model, opt, order, device)
        resumed_at = state.step
        stretches.append(dict(stretch, first_step=resumed_at + 1))
        if environments[-1]["environment"] != environment:
            warnings.warn(
                f"{paths['ckpt']}: resuming at step {resumed_at} in another environment than the checkpoint's "
                f"({environment_change(environments[-1]['environment'], environment)}); a resumed run equals an "
                "uninterrupted one bit for bit only within one environment, so its result lists both "
                "(`environments`)",
                ResumedElsewhereWarning,
                stacklevel=2,
            )
            environments.append({"first_step": resumed_at + 1, "environment": environment})
    model.train()
    penalty_fn = None
    if variant.penalty:
        import damcha_torch

        penalty_fn = damcha_torch.metric_penalty

    while state.stop_reason is None:
        step = state.step + 1
        scale = min(1.0, step / max(1, cfg.warmup)) * state.lr_scale
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * scale
        x_np, y_np = data.batch(order)
        x, y = _to_device(x_np, device), _to_device(y_np, device)
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        total = loss + variant.penalty * penalty_fn(model) if penalty_fn is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        _sync(device)
        state.train_time += time.perf_counter() - t0
        # CPU time too: on a shared machine wall time mostly measures the neighbours.
        state.cpu_time += time.process_time() - c0
        value = float(loss.item())
        state.step = step
        if not math.isfinite(value):
            state.stop_reason = "diverged"
            break
        if step > cfg.warmup and len(state.recent) >= cfg.spike_window and is_spike(value, state.recent, cfg):
            state.spikes.append(step)
        state.recent = (state.recent + [value])[-cfg.spike_window :]
        state.window.append(value)
        if step % cfg.eval_every == 0 or step >= cfg.max_steps:
            _evaluate_into(model, data, state, device)
            if on_eval is not None:
                on_eval(step, state.curve["val_metric"][-1])
            if step >= cfg.max_steps and state.stop_reason is None:
                state.stop_reason = "max_steps"
            if paths is not None and state.stop_reason is None:
                _save_checkpoint(paths["ckpt"], identity, model, opt, order, state, device, environments, stretches)
        if state.stop_reason is None and should_stop is not None and should_stop(step):
            if paths is not None:
                _save_checkpoint(paths["ckpt"], identity, model, opt, order, state, device, environments, stretches)
            raise RunInterrupted(f"stopped at step {step}")

    result = _result(cfg, identity, state, model, resumed_at)
    result["environment"] = environment
    result["environments"] = environments
    # Provenance: the code that finished the run, when its first step started and when it ended.
    result["code_version"] = stretch["code_version"]
    result["started_utc"] = stretches[0]["started_utc"]
    result["finished_utc"] = utc_now()
    result["stretches"] = stretches
    if head_maps:
        result["head_maps"] = head_map_means(model, data, device)
    if paths is not None:
        cu.atomic_write_text(paths["result"], json.dumps(result, indent=1) + "\n")
        paths["ckpt"].unlink(missing_ok=True)
    return result


def _evaluate_into(model: nn.Module, data: TaskData, state: RunState, device: torch.device) -> None:
    """One evaluation: append to the curve, then apply the plateau rule."""
    cfg = data.cfg
    val_loss, val_metric = evaluate(model, data, data.val, device)
    test_loss, test_metric = evaluate(model, data, data.test, device)
    c = state.curve
    c["step"].append(state.step)
    c["train_loss"].append(float(np.mean(state.window)) if state.window else math.nan)
    c["val_loss"].append(val_loss)
    c["val_metric"].append(val_metric)
    c["test_loss"].append(test_loss)
    c["test_metric"].append(test_metric)
    c["lr_scale"].append(state.lr_scale)
    c["train_time_s"].append(state.train_time)
    state.window = []
    if not math.isfinite(val_loss):
        state.stop_reason = "diverged"
        return
    plateau_rule(cfg, state)


def plateau_rule(cfg: TaskConfig, state: RunState) -> None:
    """After the evaluation just appended to ``state.curve``: note a new best, or count a flat one.

    An improvement means beating the best validation metric so far by more
    than ``min_delta``. After ``patience`` evaluations without one, the
    learning rate is multiplied by ``lr_decay`` (at most ``max_decays``
    times); the next such plateau stops the run.
    """
    c = state.curve
    i = len(c["step"]) - 1
    best = state.best_index
    if best is None or _score(cfg, c["val_metric"][i]) > _score(cfg, c["val_metric"][best]) + cfg.min_delta:
        state.best_index, state.bad_evals = i, 0
        return
    state.bad_evals += 1
    if state.bad_evals >= cfg.patience:
        if len(state.decays) < cfg.max_decays:
            state.lr_scale *= cfg.lr_decay
            state.decays.append(state.step)
            state.bad_evals = 0
        else:
            state.stop_reason = "plateau"


def best_index_up_to(cfg: TaskConfig, curve: dict[str, list[float]], last: int) -> int | None:
    """Index of the best validation metric among evaluations 0..last (earliest on ties), None if none."""
    best = None
    for i in range(min(last, len(curve["step"]) - 1) + 1):
        v = curve["val_metric"][i]
        if math.isfinite(v) and (best is None or _score(cfg, v) > _score(cfg, curve["val_metric"][best])):
            best = i
    return best


def _result(
    cfg: TaskConfig, identity: dict[str, Any], state: RunState, model: nn.Module, resumed_at: int | None
) -> dict[str, Any]:
    c = state.curve
    best = best_index_up_to(cfg, c, len(c["step"]) - 1)
    reached: dict[str, float | None] = {}
    for thr in cfg.thresholds:
        hit = [s for s, v in zip(c["step"], c["val_metric"]) if math.isfinite(v) and _score(cfg, v) >= _score(cfg, thr)]
        reached[f"{thr:g}"] = hit[0] if hit else None
    steps = max(state.step, 1)
    return {
        "identity": _json_roundtrip(identity),
        "variant": identity["variant"]["name"],
        "lr": identity["lr"],
        "seed": identity["seed"],
        "params": count_parameters(model),
        "mlp_hidden": identity["mlp_hidden"],
        "steps": state.step,
        "stop_reason": state.stop_reason,
        "lr_decays": state.decays,
        "diverged": state.stop_reason == "diverged",
        "best_step": c["step"][best] if best is not None else None,
        "best_val_metric": c["val_metric"][best] if best is not None else math.nan,
        "best_val_loss": c["val_loss"][best] if best is not None else math.nan,
        "test_metric": c["test_metric"][best] if best is not None else math.nan,
        "test_loss": c["test_loss"][best] if best is not None else math.nan,
        "steps_to_threshold": reached,
        "loss_spikes": len(state.spikes),
        "spike_steps": state.spikes[:50],
        "time_per_step_s": state.train_time / steps,
        "cpu_per_step_s": state.cpu_time / steps,
        "train_time_s": state.train_time,
        "resumed_at_step": resumed_at,
        "final_params_sha256": params_sha256(model),
        "curve": c,
    }


def params_sha256(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes in ``named_parameters`` order: equal iff the weights are bitwise equal."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------- heatmaps


def head_map_means(model: nn.Module, data: TaskData, device: torch.device, tokens: int = 4096) -> list | None:
    """Mean learned cross-head factor per DAMCHA layer on validation inputs, or None for baselines.

    Each layer's query input is captured with a forward pre-hook, and its
    canonical parameters and config go through the NumPy reference
    (``damcha_core.damcha_attention(..., return_metric=True)``), so the map
    is the spec's l(t) = I + diag(g) A(t) (query side), averaged over tokens;
    for metric "lowrank" the (S, S) block norms of L(t)/sqrt(d). About
    ``tokens`` tokens are used (the dense lowrank map is large).
    """
    from damcha_core import damcha_attention

    layers = damcha_layers(model)
    if not layers:
        return None
    inputs = data.val[0]
    per_example = int(np.prod(inputs.shape[1:2])) if not data.images else 17
    count = max(1, min(len(inputs), tokens // max(1, per_example)))
    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: captured.append(args[0].detach())) for layer in layers]
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            model(_to_device(inputs[:count], device))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    maps = []
    for layer, x in zip(layers, captured):
        params = {k: np.asarray(v, dtype=np.float64) for k, v in layer.to_canonical().items()}
        _, metric = damcha_attention(params, layer.config, x.double().cpu().numpy(), return_metric=True)
        q = metric["q"]
        if q.ndim == 6:  # lowrank: dense L (B, T, S, d, S, d) -> per-head-pair block norms
            d = q.shape[3]
            q = np.sqrt(np.sum(q * q, axis=(3, 5)) / d)
        maps.append(np.mean(q, axis=(0, 1)).tolist())
    return maps
