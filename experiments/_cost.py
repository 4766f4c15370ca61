"""Claim 3: whole-model cost of one training step, DAMCHA vs MHA, measured interleaved.

Every variant's model (at its budget-matched width, the same batch) is
built in one process and timed in ``cost_rounds`` short rounds of
``cost_steps`` steps each. Within a round the variants alternate step by
step: step k of the measurement runs every variant once, in an order
rotated by one at every step (so each variant is as often first as last),
and an MHA step sits a few milliseconds from each DAMCHA step. A slow phase
of the machine, which on the shared VM lasts seconds and made whole rounds
of the older schedule (20 steps of one variant, then the next) 1.5-1.6x
slower than others, then hits every variant of the round alike.

Clock. With one torch intra-op thread on CPU (``--threads 1``, the
default) a step runs on the calling thread alone (autograd runs CPU
backward on the thread that calls it), so its *thread CPU time*
(``time.thread_time``) counts its own work and not the time other processes
held the core; that is the clock the ratio uses (``clock``:
"thread_time"). It is not immune to everything: a co-tenant still slows the
step through shared caches, memory bandwidth, clock frequency and
hypervisor steal time the guest kernel does not account. With more threads
(work on threads the clock does not see) or on CUDA (work on the GPU) the
clock is the wall clock (``clock``: "perf_counter"). Both are recorded for
every step (``step_cpu_s``, ``step_wall_s``).

A clock can fail to time a step: one coarser than a step reads 0 (thread
CPU time advances in 15.6 ms ticks on Windows), and a broken or faked one
can read a negative, NaN or infinite time. A ratio needs every step time
of every variant finite and > 0 on its clock (a round time of 0 divided by
zero, a negative one gave a negative ratio, and a clock with coarse ticks
gives round medians of whole ticks). ``unusable_clocks`` names each clock
that failed with its first bad step. When thread CPU time fails and the
wall clock does not, the ratio uses the wall clock (``clock``
"perf_counter", ``clock_note`` says why); when the ratio's clock fails, no
time is derived from it: ``s_per_step``, ``time_ratio_vs_mha`` and its
interval are None, as are ``wall_s_per_step`` and ``wall_time_ratio_vs_mha``
when the wall clock fails (the report prints n/a and says why). The memory
figures do not depend on a clock and are always written.

Statistics. A round's time is the median of its steps on the chosen clock
(a step stalled now and then does not move it), a variant's ratio in a
round is its round time over MHA's, and the reported ratio is the median
of the per-round ratios with a 95% percentile bootstrap interval resampling
rounds (``_analysis.ratio_interval``, fixed seed: the same file always gives
the same interval). ``_analysis`` decides claim 3 by that interval.

Memory, device-agnostic and exact: the bytes of the tensors autograd saves
for backward during one step (activation memory, parameters excluded), plus
parameters, gradients and optimiser state; on CUDA also the allocator's peak
(``torch.cuda.max_memory_allocated``) over one step.

The JSON records the load average before and after. Files written before
this schedule (no ``cost_format``) timed 7 rounds of 20 consecutive steps of
one variant on the wall clock; their ``round_s_per_step`` reads the same and
``_analysis`` computes the same interval from it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from ._analysis import RATIO_CONFIDENCE, RATIO_RESAMPLES, RATIO_SEED, ratio_interval
from ._models import count_parameters
from ._provenance import code_version, utc_now
from ._suite import environment
from ._tasks import RESULTS_FORMAT, TaskConfig, TaskData
from ._train import RunInterrupted, _sync, _to_device, build_model, model_width, param_groups
from ._variants import get_variant

# Written as ``cost_format``; a file without it is the older schedule (see the module docstring).
COST_FORMAT = 2


def choose_clock(device: torch.device) -> tuple[str, str]:
    """Choose the clock a measurement on ``device`` times its ratios with, given torch's current
    thread count: its name ("thread_time" or "perf_counter", written as ``clock``) and why
    (``clock_note``). ``_analysis.recorded_clock`` reads the choice back from a cost file."""
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads == 1:
        return "thread_time", "one torch intra-op thread on CPU: the step's own CPU time, blind to preemption"
    if device.type != "cpu":
        return "perf_counter", f"device {device.type}: the work runs on the device, so wall time"
    return "perf_counter", f"{threads} torch intra-op threads: thread CPU time would miss the workers, so wall time"


def _bad_step(steps: dict[str, list[list[float]]]) -> str | None:
    """The first step time (of any variant) that is not finite and > 0, as "round R, step K of
    NAME: T s", or None when the clock timed every step (see the module docstring).

    Every step, not only the round medians: a clock with ticks longer than a step reads some steps
    as 0 and others as a whole tick, and its medians can all be a tick, a ratio of 1 that is none.
    """
    for name, rounds in steps.items():
        for r, times in enumerate(rounds):
            for k, t in enumerate(times):
                if not (math.isfinite(t) and t > 0):
                    return f"round {r}, step {k} of {name}: {t!r} s"
    return None


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, penalty: float, clip: float
) -> None:
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    if penalty:
        import damcha_torch

        loss = loss + penalty * damcha_torch.metric_penalty(model)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward in one forward (parameters excluded)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[tuple[int, str], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            storages[(s.data_ptr(), str(t.device))] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return int(sum(storages.values()))


def _tensor_bytes(tensors: Any) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))


def measure_cost(
    cfg: TaskConfig,
    variants: list[str],
    *,
    device: torch.device | str = "cpu",
    data: TaskData | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Time per training step and memory of each variant's whole model; plain JSON.

    MHA is timed too when ``variants`` leaves it out: every time ratio is taken round by round
    against MHA's steps interleaved with it, so a subset without it (``--cost-only --variants X``)
    would measure no ratio, and merged into an existing cost file it would replace a valid one.

    ``should_stop`` is asked between steps (``damcha experiment``'s Ctrl-C / SIGTERM): when it
    says so, ``RunInterrupted`` is raised and nothing is measured (a cost is never partial)."""
    device = torch.device(device)
    variants = list(variants) if "mha" in variants else ["mha", *variants]
    data = data if data is not None else TaskData(cfg)
    started_utc, code = utc_now(), code_version()
    env_before = environment(device)
    order = data.order(0)
    x_np, y_np = data.batch(order)
    x, y = _to_device(x_np, device), _to_device(y_np, device)
    models, opts, entries = {}, {}, {}
    for name in variants:
        v = get_variant(name)
        width, params = model_width(data, v)
        torch.manual_seed(0)
        model = build_model(data, v, width).to(device)
        opt = torch.optim.AdamW(param_groups(model, cfg.lrs[0], v, cfg.weight_decay), lr=cfg.lrs[0])
        models[name], opts[name] = model, opt
        activations = saved_activation_bytes(model, x, y)
        _step(model, opt, x, y, v.penalty, cfg.clip)  # creates the optimiser state, warms caches
        entry: dict[str, Any] = {
            "params": params,
            "mlp_hidden": width,
            "activation_bytes": activations,
            "param_bytes": _tensor_bytes(model.parameters()),
            "optimizer_bytes": _tensor_bytes(t for s in opt.state.values() for t in s.values()),
        }
        entry["grad_bytes"] = entry["param_bytes"]
        entry["train_bytes"] = entry["activation_bytes"] + 2 * entry["param_bytes"] + entry["optimizer_bytes"]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            _step(model, opt, x, y, v.penalty, cfg.clip)
            torch.cuda.synchronize(device)
            entry["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
            entry["cuda_peak_over_resident_bytes"] = int(torch.cuda.max_memory_allocated(device) - base)
        entries[name] = entry
    clock, clock_note = choose_clock(device)
    # step_s[name][clock][round] lists that round's steps of the variant.
    step_s: dict[str, dict[str, list[list[float]]]] = {name: {"wall": [], "cpu": []} for name in variants}
    n = len(variants)
    for r in range(cfg.cost_rounds):
        for name in variants:
            step_s[name]["wall"].append([])
            step_s[name]["cpu"].append([])
        for k in range(cfg.cost_steps):
            if should_stop is not None and should_stop():
                raise RunInterrupted("while measuring the cost")
            shift = (r * cfg.cost_steps + k) % n
            for name in variants[shift:] + variants[:shift]:
                v = get_variant(name)
                _sync(device)
                w0, c0 = time.perf_counter(), time.thread_time()
                _step(models[name], opts[name], x, y, v.penalty, cfg.clip)
                _sync(device)
                c1, w1 = time.thread_time(), time.perf_counter()
                step_s[name]["wall"][r].append(w1 - w0)
                step_s[name]["cpu"][r].append(c1 - c0)
    # A round's time is the median of its steps, so that a step preempted now
    # and then does not move it.
    by_clock = {
        c: {name: [statistics.median(st) for st in step_s[name][key]] for name in variants}
        for c, key in (("thread_time", "cpu"), ("perf_counter", "wall"))
    }
    unusable = {
        c: why
        for c, key in (("thread_time", "cpu"), ("perf_counter", "wall"))
        if (why := _bad_step({name: step_s[name][key] for name in variants})) is not None
    }
    if clock == "thread_time" and "thread_time" in unusable and "perf_counter" not in unusable:
        # Only from thread CPU time to the wall clock: with more threads or on a device the
        # wall clock is the one that sees the work, and thread CPU time would miss it.
        clock = "perf_counter"
        clock_note = (
            f"thread CPU time could not time the steps ({unusable['thread_time']}: a clock coarser than a "
            "step), so wall time, which preemption lengthens"
        )
    key = "cpu" if clock == "thread_time" else "wall"
    rounds, wall_rounds = by_clock[clock], by_clock["perf_counter"]
    timed, wall_timed = clock not in unusable, "perf_counter" not in unusable
    for name in variants:
        e = entries[name]
        e["round_statistic"] = "median step"
        e["step_wall_s"] = step_s[name]["wall"]
        e["step_cpu_s"] = step_s[name]["cpu"]
        e["round_s_per_step"] = rounds[name]
        e["round_wall_s_per_step"] = wall_rounds[name]
        e["round_mean_s_per_step"] = [statistics.fmean(st) for st in step_s[name][key]]
        # No time is derived from a clock that could not time the steps (None, never 0, inf or NaN).
        e["s_per_step"] = statistics.median(rounds[name]) if timed else None
        e["wall_s_per_step"] = statistics.median(wall_rounds[name]) if wall_timed else None
        if "mha" in rounds:
            iv = ratio_interval(rounds[name], rounds["mha"]) if timed else {"median": None, "ci": None}
            e["time_ratio_vs_mha"] = iv["median"]
            e["time_ratio_ci_vs_mha"] = iv["ci"]
            # Beside it, what the wall clock says (the difference is what preemption did).
            e["wall_time_ratio_vs_mha"] = (
                statistics.median(a / b for a, b in zip(wall_rounds[name], wall_rounds["mha"])) if wall_timed else None
            )
            m = entries["mha"]
            e["activation_ratio_vs_mha"] = e["activation_bytes"] / max(1, m["activation_bytes"])
            e["train_bytes_ratio_vs_mha"] = e["train_bytes"] / max(1, m["train_bytes"])
            if "cuda_peak_bytes" in e:
                e["cuda_peak_ratio_vs_mha"] = e["cuda_peak_bytes"] / max(1, m["cuda_peak_bytes"])
    return {
        "format": RESULTS_FORMAT,
        "kind": "cost",
        "task": cfg.task,
        "preset": cfg.preset,
        "device": device.type,
        "batch": cfg.batch,
        "cost_steps": cfg.cost_steps,
        "cost_rounds": cfg.cost_rounds,
        "cost_format": COST_FORMAT,
        "schedule": "steps interleaved, order rotated every step",
        "clock": clock,
        "clock_note": clock_note,
        "unusable_clocks": unusable,
        "torch_threads": torch.get_num_threads(),
        "ratio_interval": {
            "confidence": RATIO_CONFIDENCE,
            "method": "percentile bootstrap over rounds",
            "resamples": RATIO_RESAMPLES,
            "seed": RATIO_SEED,
        },
        "variants": entries,
        "environment": env_before | {"loadavg_after": environment(device).get("loadavg")},
        "params_check": {name: count_parameters(models[name]) for name in variants},
        "code_version": code,
        "started_utc": started_utc,
        "finished_utc": utc_now(),
    }
