"""Data-parallel training step on 2 simulated CPU devices equals the single-device step.

The device count is fixed when JAX initialises its backend, so this runs in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=2.
"""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
import damcha_jax as dj

assert len(jax.devices()) == 2, jax.devices()
# Cheap compiles (see test_jax_module.py), and the initialisers as one program.
FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
factory = lambda: dj.DamchaEncoder(2, 16, 4, 32, coupling="tied", rngs=nnx.Rngs(0))
model = nnx.merge(nnx.split(nnx.eval_shape(factory))[0], jax.jit(lambda: nnx.split(factory())[1], compiler_options=FAST)())
for layer in model.layers:  # open the gates so the metric takes part in the step
    layer.attention.metric["qk"].gate[...] = jnp.full((4,), 0.4)
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
rng = np.random.default_rng(1)
x = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)
target = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)
mask = jnp.asarray(np.arange(6)[None, None, None, :] < np.array([6, 4, 5, 6, 3, 6, 2, 6])[:, None, None, None])

def train_step(params, x, target, mask):
    def loss(params):
        y = nnx.merge(graphdef, params, rest)(x, mask=mask, is_causal=True)
        return jnp.mean((y - target) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

step = jax.jit(train_step, compiler_options=FAST)
loss_1, params_1 = step(params, x, target, mask)

mesh = jax.make_mesh((2,), ("data",))
batch = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())
xs, ts, ms = (jax.device_put(a, batch) for a in (x, target, mask))
ps = jax.device_put(params, replicated)
assert len(xs.sharding.device_set) == 2 and xs.addressable_shards[0].data.shape == (4, 6, 16)
loss_2, params_2 = step(ps, xs, ts, ms)
assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(params_2))
np.testing.assert_allclose(loss_2, loss_1, rtol=1e-5)
flat_1, flat_2 = jax.tree.leaves(params_1), jax.tree.leaves(params_2)
assert len(flat_1) == len(flat_2) > 10
for a, b in zip(flat_1, flat_2):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
moved = max(float(jnp.abs(a - b).max()) for a, b in zip(flat_1, jax.tree.leaves(params)))
assert moved > 1e-4, "the step must change the parameters"
print("ok", float(loss_1), float(loss_2))
"""


def test_data_parallel_step_equals_single_device() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]
