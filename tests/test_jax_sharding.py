"""Data-parallel training step on 2 simulated CPU devices equals the single-device step;
from_mha keeps a sharded layer's sharding.

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


def _two_devices_env() -> dict[str, str]:
    """Two host devices, on top of the XLA flags the test process has (conftest.py's cheaper codegen)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def test_data_parallel_step_equals_single_device() -> None:
    env = _two_devices_env()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]


_FROM_MHA_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
import damcha_jax as dj
x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)
for kind in ("Auto", "Explicit"):
    mesh = jax.make_mesh((2,), ("model",), axis_types=(getattr(jax.sharding.AxisType, kind),))
    with jax.set_mesh(mesh):
        mha = nnx.MultiHeadAttention(4, 16, decode=False, normalize_qk=True, rngs=nnx.Rngs(0),
                                     kernel_metadata={"out_sharding": (None, "model", None)},
                                     out_kernel_metadata={"out_sharding": ("model", None, None)},
                                     bias_metadata={"out_sharding": ("model", None)}, out_bias_metadata={"out_sharding": (None,)})
        layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
        theirs, ours = nnx.get_partition_spec(nnx.state(mha)), nnx.get_partition_spec(nnx.state(layer))
        for name in ("query", "key", "value", "out"):
            for leaf in ("kernel", "bias"):
                assert ours[name][leaf] == theirs[name][leaf], (kind, name, leaf, ours[name][leaf], theirs[name][leaf])
        assert ours["query_ln"]["scale"] == theirs["query_ln"]["scale"]
        assert layer.query.kernel[...].sharding.spec == mha.query.kernel[...].sharding.spec
        if kind == "Auto":
            np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(mha(x)))

# Heads sharded (docs/jax.md): the maps mix them; an Auto mesh computes the unsharded
# layer's output, an Explicit one refuses the per-head slicing (as documented).
ref = dj.DamchaAttention(4, 16, rngs=nnx.Rngs(0))
for side in ref.metric:
    ref.metric[side].gate[...] = jnp.full((4,), 0.5)
want = np.asarray(ref(x))
kw = dict(kernel_metadata={"out_sharding": (None, "model", None)}, out_kernel_metadata={"out_sharding": ("model", None, None)})
for kind in ("Auto", "Explicit"):
    mesh = jax.make_mesh((2,), ("model",), axis_types=(getattr(jax.sharding.AxisType, kind),))
    with jax.set_mesh(mesh):
        lay = dj.DamchaAttention(4, 16, rngs=nnx.Rngs(0), **kw)
        for side in lay.metric:
            lay.metric[side].gate[...] = jnp.full((4,), 0.5)
        if kind == "Auto":
            np.testing.assert_allclose(np.asarray(lay(x)), want, rtol=1e-5, atol=1e-6)
        else:
            try:
                lay(x, out_sharding=P())
            except Exception as error:
                assert type(error).__name__ == "ShardingTypeError", error
            else:
                raise AssertionError("docs/jax.md says an Explicit mesh refuses sharded heads; update it")
print("ok")
"""


def test_from_mha_keeps_the_sharding_of_every_parameter() -> None:
    """from_mha dropped the *_metadata of the layer it copies: the converted
    layer's partition specs were P() (Flax's sharded-init recipe would replicate
    it), and under an explicit-sharding mesh copying a sharded kernel into the
    unsharded one was a raw JAX type error."""
    env = _two_devices_env()
    proc = subprocess.run(
        [sys.executable, "-c", _FROM_MHA_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]
