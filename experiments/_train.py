"""Tasks, the training loop and the seed-noise comparison.

``run_experiment`` trains every variant for every seed on one task and
returns a plain-JSON dict; ``write_results`` saves it with its plots.
Seeds change the initialisation and batch order; the data sets are fixed per
task so that every variant sees the same examples.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from damcha_core import DamchaTypeError, DamchaValueError

from . import _data
from ._models import TinyTransformer, Variant, attention_factory, count_parameters, get_variant


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Defaults of one task: model size, optimisation and evaluation."""

    name: str
    description: str
    metric: str  # name of the reported metric
    higher_is_better: bool
    steps: int
    batch: int
    lr: float
    embed_dim: int
    num_heads: int
    num_layers: int
    mlp_hidden: int
    eval_every: int
    eval_size: int
    train_size: int = 0  # classification tasks: fixed training-set size
    seq_len: int = 0  # language model window


# Sized so that the 7 default variants x 3 seeds finish in under 10 minutes per
# task on a shared 2-core CPU (one torch thread); evaluation is kept sparse
# because on ListOps it would otherwise cost as much as training.
TASKS: dict[str, TaskSpec] = {
    "crosshead": TaskSpec(
        "crosshead", "shifted-block retrieval: the match is split across heads (see make_crosshead)",
        "accuracy", True, steps=800, batch=64, lr=3e-3, embed_dim=32, num_heads=4, num_layers=2,
        mlp_hidden=64, eval_every=100, eval_size=1000, train_size=20000,
    ),
    "charlm": TaskSpec(
        "charlm", "byte-level language model on the Python standard library's own source",
        "val_bits_per_char", False, steps=400, batch=32, lr=3e-3, embed_dim=64, num_heads=4, num_layers=2,
        mlp_hidden=128, eval_every=100, eval_size=64, seq_len=48,
    ),
    "listops": TaskSpec(
        "listops", "ListOps-style nested MAX/MIN/MED/SM expressions, classify the value 0-9",
        "accuracy", True, steps=400, batch=32, lr=2e-3, embed_dim=64, num_heads=4, num_layers=2,
        mlp_hidden=128, eval_every=100, eval_size=500, train_size=10000,
    ),
}

DEFAULT_VARIANTS = (
    "mha",
    "talking-heads",
    "damcha-heads-tied",
    "damcha-heads-tied-shared",
    "damcha-heads-separate",
    "damcha-heads-query",
    "damcha-lowrank-tied",
)

# Fixed data seeds: the training seed of a run must not change the data.
TRAIN_DATA_SEED, EVAL_DATA_SEED = 0, 1


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise DamchaValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    return TASKS[name]


# ------------------------------------------------------------------- data


class _TaskData:
    """Batches and the fixed evaluation set of one task."""

    def __init__(self, spec: TaskSpec, steps: int, eval_size: int) -> None:
        self.spec = spec
        if spec.name == "charlm":
            corpus = _data.stdlib_corpus()
            self.corpus = corpus
            self.vocab_sizes, self.num_outputs = (256,), 256
            self.readout, self.causal, self.max_len, self.pad_id = None, True, spec.seq_len, None
            self.eval_inputs, self.eval_targets = _data.lm_eval_windows(corpus.val, spec.seq_len, eval_size)
            self.info = {"corpus_files": len(corpus.files), "corpus_sha256": corpus.sha256,
                         "train_bytes": int(len(corpus.train)), "val_bytes": int(len(corpus.val)),
                         "python_version": corpus.python_version}
            return
        self.corpus = None
        # A tiny run needs no 20k examples: generate only what it will read.
        n_train = max(spec.batch, min(spec.train_size, steps * spec.batch))
        make = _data.make_crosshead if spec.name == "crosshead" else _data.make_listops
        train, held = make(n_train, TRAIN_DATA_SEED), make(eval_size, EVAL_DATA_SEED)
        self.train_inputs, self.train_targets = train.inputs, train.targets
        self.eval_inputs, self.eval_targets = held.inputs, held.targets
        self.vocab_sizes, self.num_outputs, self.readout = train.vocab_sizes, train.num_classes, train.readout
        self.causal = False
        self.max_len = train.inputs.shape[1] if spec.name == "listops" else 0  # crosshead items are a set
        self.pad_id = _data.PAD if spec.name == "listops" else None
        self.info = {"train_examples": int(n_train), "eval_examples": int(eval_size),
                     "chance_accuracy": float(np.max(np.bincount(held.targets)) / len(held.targets))}

    def batch(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.corpus is not None:
            x, y = _data.lm_batch(self.corpus.train, self.spec.batch, self.spec.seq_len, rng)
        else:
            idx = rng.integers(0, len(self.train_targets), size=self.spec.batch)
            x, y = self.train_inputs[idx], self.train_targets[idx]
        return torch.from_numpy(x), torch.from_numpy(y)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, data: _TaskData, chunk: int = 256) -> tuple[float, float]:
    """(mean loss in nats, metric): accuracy, or bits per char for the LM."""
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(data.eval_targets), chunk):
        x = torch.from_numpy(data.eval_inputs[start : start + chunk])
        y = torch.from_numpy(data.eval_targets[start : start + chunk])
        logits = model(x)
        total_loss += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    model.train()
    loss = total_loss / count
    return loss, (loss / math.log(2) if data.corpus is not None else correct / count)


# ------------------------------------------------------------------ models


def build_model(data: _TaskData, variant: Variant, mlp_hidden: int) -> TinyTransformer:
    spec = data.spec
    factory = attention_factory(variant, spec.embed_dim, spec.num_heads, spec.num_layers)
    return TinyTransformer(
        data.vocab_sizes, data.num_outputs, factory, embed_dim=spec.embed_dim, num_layers=spec.num_layers,
        mlp_hidden=mlp_hidden, max_len=data.max_len, causal=data.causal, readout=data.readout, pad_id=data.pad_id,
    )


def matched_widths(data: _TaskData, variants: list[Variant]) -> dict[str, tuple[int, int]]:
    """MLP width per variant so every model has (nearly) the largest variant's parameter count.

    Extra attention parameters differ by variant; widening the MLP of the
    smaller models by whole units makes the comparison one of attention
    structure at equal size, not of size. Returns name -> (mlp_hidden, params).
    """
    spec = data.spec
    base = {v.name: count_parameters(build_model(data, v, spec.mlp_hidden)) for v in variants}
    target = max(base.values())
    per_unit = spec.num_layers * (2 * spec.embed_dim + 1)  # one hidden unit in every layer's MLP
    out = {}
    for v in variants:
        hidden = spec.mlp_hidden + round((target - base[v.name]) / per_unit)
        out[v.name] = (hidden, count_parameters(build_model(data, v, hidden)))
    return out


# ---------------------------------------------------------------- training


def train_one(data: _TaskData, variant: Variant, mlp_hidden: int, seed: int, steps: int,
              on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Train one model; returns its curve, final metric and timing."""
    spec = data.spec
    torch.manual_seed(seed)
    rng = np.random.default_rng(10_000 + seed)
    model = build_model(data, variant, mlp_hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = max(1, min(50, steps // 10))
    # Linear warm-up then cosine decay to 10%: the same schedule for every variant.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(s, steps) / steps))
    )
    curve: dict[str, list[float]] = {"step": [], "train_loss": [], "val_loss": [], "val_metric": []}
    train_time, cpu_time, window = 0.0, 0.0, []
    for step in range(1, steps + 1):
        x, y = data.batch(rng)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = _loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        train_time += time.perf_counter() - t0
        # CPU time too: on a shared, loaded machine wall time mostly measures the neighbours.
        cpu_time += time.process_time() - c0
        window.append(loss.item())
        if not math.isfinite(window[-1]):
            raise DamchaValueError(f"training diverged: variant={variant.name}, seed={seed}, step={step}, loss={window[-1]}")
        if step % spec.eval_every == 0 or step == steps:
            val_loss, metric = evaluate(model, data)
            curve["step"].append(step)
            curve["train_loss"].append(float(np.mean(window)))
            curve["val_loss"].append(val_loss)
            curve["val_metric"].append(metric)
            window = []
        if on_step is not None:
            on_step()
    return {
        "seed": seed,
        "final_metric": curve["val_metric"][-1],
        "final_val_loss": curve["val_loss"][-1],
        "time_per_step_s": train_time / steps,
        "cpu_per_step_s": cpu_time / steps,
        "curve": curve,
        "model": model,
    }


def head_maps(model: TinyTransformer, data: _TaskData, count: int = 256) -> list[list[list[float]]] | None:
    """Mean learned cross-head factor per layer on evaluation tokens, or None for non-DAMCHA models.

    For each layer the attention input (after LayerNorm) is captured with a
    forward hook, and the layer's canonical parameters and config go through
    the NumPy reference (``damcha_attention(..., return_metric=True)``), so the
    heatmap shows the spec's l(t) = I + diag(g) A(t) (queries' side), averaged
    over tokens; for metric "lowrank" the (S, S) block norms of L(t)/sqrt(d).
    """
    from damcha_core import damcha_attention

    layers = [b.attention.inner for b in model.blocks]
    if not all(hasattr(a, "to_canonical") and hasattr(a, "config") for a in layers):
        return None
    captured: list[torch.Tensor] = []
    hooks = [b.attention.register_forward_hook(lambda m, args, out: captured.append(args[0].detach()))
             for b in model.blocks]
    try:
        with torch.no_grad():
            model.eval()
            model(torch.from_numpy(data.eval_inputs[:count]))
            model.train()
    finally:
        for h in hooks:
            h.remove()
    maps = []
    for layer, x in zip(layers, captured):
        params = {k: np.asarray(v, dtype=np.float64) for k, v in layer.to_canonical().items()}
        _, metric = damcha_attention(params, layer.config, x.double().numpy(), return_metric=True)
        q = metric["q"]
        if q.ndim == 6:  # lowrank: dense L (B, T, S, d, S, d) -> per-head-pair block norms
            d = q.shape[3]
            q = np.sqrt(np.sum(q * q, axis=(3, 5)) / d)
        maps.append(np.mean(q, axis=(0, 1)).tolist())
    return maps


def seed_noise_comparison(summary: dict[str, dict[str, float]], baseline: str, higher_is_better: bool) -> list[dict[str, Any]]:
    """Each variant vs ``baseline``: difference of means and whether it exceeds seed noise.

    "Exceeds noise" means |difference| > 2 standard errors of the difference,
    sqrt(s_a^2/n_a + s_b^2/n_b) with the sample standard deviations over seeds
    (roughly a 95% two-sided test; with 3 seeds it is a screen, not proof).
    """
    if baseline not in summary:
        return []
    base = summary[baseline]
    rows = []
    for name, s in summary.items():
        if name == baseline:
            continue
        diff = s["mean"] - base["mean"]
        better = diff > 0 if higher_is_better else diff < 0
        if min(s["n"], base["n"]) < 2:
            # One seed has no noise estimate: say so rather than call any gap significant.
            se, z, exceeds = None, None, None
        else:
            se = math.sqrt(s["std"] ** 2 / s["n"] + base["std"] ** 2 / base["n"])
            z = diff / se if se > 0 else None
            exceeds = bool(abs(diff) > 2 * se)
        rows.append({
            "variant": name, "baseline": baseline, "difference": diff, "stderr": se,
            "z": z, "exceeds_noise": exceeds,
            "direction": "better" if better else ("worse" if diff else "equal"),
        })
    return rows


def run_experiment(task: str, variants: list[str] | None = None, seeds: int = 3, steps: int | None = None,
                   eval_size: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Train ``variants`` x ``seeds`` on ``task`` and return the plain-JSON results."""
    spec = get_task(task)
    names = list(DEFAULT_VARIANTS if not variants else variants)
    chosen = [get_variant(n) for n in names]
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise DamchaTypeError(f"`seeds` must be an int >= 1. Received: seeds={seeds!r}")
    steps = spec.steps if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise DamchaValueError(f"`steps` must be an int >= 1. Received: steps={steps!r}")
    eval_size = spec.eval_size if eval_size is None else eval_size
    data = _TaskData(spec, steps, eval_size)
    widths = matched_widths(data, chosen)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chosen) * seeds * steps, desc=task, unit="step", dynamic_ncols=True)
    started, cpu_started = time.perf_counter(), time.process_time()
    results: dict[str, Any] = {}
    try:
        for v in chosen:
            hidden, n_params = widths[v.name]
            runs, maps = [], None
            for seed in range(seeds):
                if bar is not None:
                    bar.set_postfix_str(f"{v.name} seed {seed}")
                run = train_one(data, v, hidden, seed, steps, on_step=(bar.update if bar is not None else None))
                model = run.pop("model")
                if seed == 0 and v.kind == "damcha":
                    maps = head_maps(model, data)
                runs.append(run)
            finals = np.array([r["final_metric"] for r in runs])
            results[v.name] = {
                "description": v.description, "kind": v.kind, "metric": v.metric, "coupling": v.coupling,
                "metric_rank": v.metric_rank, "share_metric": v.share_metric,
                "params": n_params, "mlp_hidden": hidden,
                "mean": float(finals.mean()), "std": float(finals.std(ddof=1)) if seeds > 1 else 0.0, "n": seeds,
                "time_per_step_s": float(np.mean([r["time_per_step_s"] for r in runs])),
                "cpu_per_step_s": float(np.mean([r["cpu_per_step_s"] for r in runs])),
                "runs": runs, "head_maps_seed0": maps,
            }
    finally:
        if bar is not None:
            bar.close()
    summary = {k: {"mean": r["mean"], "std": r["std"], "n": r["n"]} for k, r in results.items()}
    return {
        "task": task,
        "spec": dataclasses.asdict(spec) | {"steps": steps, "eval_size": eval_size},
        "metric": spec.metric,
        "higher_is_better": spec.higher_is_better,
        "seeds": seeds,
        "data": data.info,
        "variants": results,
        "comparison_vs_mha": seed_noise_comparison(summary, "mha", spec.higher_is_better),
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        },
    }
