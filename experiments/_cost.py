"""Claim 3: whole-model cost of one training step, DAMCHA vs MHA, measured interleaved.

Every variant's model (at its budget-matched width, the same batch) trains
``cost_steps`` steps per round, the variants in a rotating order, for
``cost_rounds`` rounds, all in one process: a slow moment of the machine
hits every variant alike. A round's time is the median of its steps' times
(each step timed alone). Reported per variant: the median over rounds, and
the median over rounds of the ratio to MHA's time in the same round. Memory, device-agnostic and exact: the bytes of the tensors autograd
saves for backward during one step (activation memory, parameters
excluded), plus parameters, gradients and optimiser state; on CUDA also the
allocator's peak (``torch.cuda.max_memory_allocated``) over one step.

Timings are only meaningful on a quiet machine: the JSON records the load
average before and after, and the report calls a measurement taken under
load inconclusive.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.nn import functional as F

from ._models import count_parameters
from ._suite import environment
from ._tasks import RESULTS_FORMAT, TaskConfig, TaskData
from ._train import _sync, _to_device, build_model, model_width, param_groups
from ._variants import get_variant


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
    cfg: TaskConfig, variants: list[str], *, device: torch.device | str = "cpu", data: TaskData | None = None
) -> dict[str, Any]:
    """Time per training step and memory of each variant's whole model; plain JSON."""
    device = torch.device(device)
    data = data if data is not None else TaskData(cfg)
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
    times: dict[str, list[float]] = {name: [] for name in variants}
    means: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(cfg.cost_rounds):
        rotated = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name in rotated:
            v = get_variant(name)
            steps = []
            for _ in range(cfg.cost_steps):
                _sync(device)
                t0 = time.perf_counter()
                _step(models[name], opts[name], x, y, v.penalty, cfg.clip)
                _sync(device)
                steps.append(time.perf_counter() - t0)
            # A round's time is the median of its steps, so that a step preempted
            # now and then does not move it. (This did not explain the drift seen
            # in session 10: on this VM, idle, one model's round medians still
            # moved 1.5-1.6x between rounds seconds apart, 7.4 to 12 ms, whole
            # rounds fast or slow; the per-round ratios moved with them.)
            times[name].append(statistics.median(steps))
            means[name].append(statistics.fmean(steps))
    for name in variants:
        e = entries[name]
        e["round_statistic"] = "median step"
        e["round_s_per_step"] = times[name]
        e["round_mean_s_per_step"] = means[name]
        e["s_per_step"] = statistics.median(times[name])
        if "mha" in times:
            e["time_ratio_vs_mha"] = statistics.median(a / b for a, b in zip(times[name], times["mha"]))
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
        "variants": entries,
        "environment": env_before | {"loadavg_after": environment(device).get("loadavg")},
        "params_check": {name: count_parameters(models[name]) for name in variants},
    }
