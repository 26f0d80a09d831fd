"""QNetwork against an independent float64 NumPy forward pass, plus shapes, dueling and bf16."""

from __future__ import annotations

import functools
import secrets

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent.network import (
    F32_PRECISION,
    F32_PRECISION_MIN_ROWS,
    QNetwork,
    expected_q,
    f32_precision,
    greedy_actions,
    make_network,
    param_count,
    support,
)
from foxhunt_jax.config import NetworkConfig
from foxhunt_jax.errors import ConfigError

D = 40
DEFAULT_BRANCHES = (5, 3, 3)


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"numpy/jax seed {seed}")  # pytest shows it when the test fails
    return np.random.default_rng(seed)


_DEFAULT_NET = make_network(NetworkConfig(), DEFAULT_BRANCHES)
# Compiled once per module: XLA CPU compiles of init (20 random tensors) take seconds.
_jit_init = jax.jit(_DEFAULT_NET.init)


def _init(rng: np.random.Generator, branches: tuple[int, ...] = DEFAULT_BRANCHES):
    """Fresh default-width parameters; the first ``len(branches)`` advantage streams are kept.

    A network with fewer branches of the same widths has exactly that subset of layers, so one
    compiled init serves both (checked against ``jax.eval_shape`` of its own init).
    """
    key = jax.random.key(int(rng.integers(2**31)))
    params = _jit_init(key, jnp.zeros((1, D), jnp.float32))["params"]
    keep = {"trunk_0", "trunk_1", "value_hidden", "value_out"}
    for d, n in enumerate(branches):
        if n != DEFAULT_BRANCHES[d]:
            raise ValueError("test helper: branch sizes must be a prefix of the default ones")
        keep |= {f"adv{d}_hidden", f"adv{d}_out"}
    params = {"params": {k: v for k, v in params.items() if k in keep}}
    net = make_network(NetworkConfig(), branches)
    chex.assert_trees_all_equal_shapes_and_dtypes(
        params, jax.eval_shape(net.init, key, jnp.zeros((1, D), jnp.float32)))
    return net, params


def _np_forward(params, obs, branch_sizes, trunk_layers, atoms):
    """Float64 forward pass from the parameter tree, written from the layer formulas."""
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)["params"]

    def dense(name, x):
        return x @ p[name]["kernel"] + p[name]["bias"]

    h = np.asarray(obs, np.float64)
    for i in range(trunk_layers):
        h = np.maximum(dense(f"trunk_{i}", h), 0.0)
    v = dense("value_out", np.maximum(dense("value_hidden", h), 0.0))
    out = []
    for d, n in enumerate(branch_sizes):
        a = dense(f"adv{d}_out", np.maximum(dense(f"adv{d}_hidden", h), 0.0))
        a = a.reshape(a.shape[:-1] + (n, atoms))
        out.append(v[..., None, :] + a - a.mean(axis=-2, keepdims=True))
    return v, out


def _np_expected_q(logits, z):
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ np.asarray(z, np.float64)


@functools.lru_cache(maxsize=None)
def _apply(net: QNetwork):
    """One jitted apply per network (modules are hashable), so tests share compilations."""
    return jax.jit(net.apply)


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("branches", [(5,), DEFAULT_BRANCHES])
def test_shapes_dtypes_and_numpy_reference(rng, branches):
    net, params = _init(rng, branches)
    obs = rng.normal(size=(64, D)).astype(np.float32)
    logits = _apply(net)(params, obs)
    assert isinstance(logits, tuple) and len(logits) == len(branches)
    chex.assert_shape(logits, [(64, n, 11) for n in branches])
    chex.assert_type(logits, jnp.float32)
    _, ref = _np_forward(params, obs, branches, 2, 11)
    for l, r in zip(logits, ref):
        err = _rel_err(l, r)
        assert err < 1e-5, f"relative error {err}"
    # Any leading batch dims, or none: the same function of each observation.
    lead = _apply(net)(params, obs.reshape(4, 16, D))
    chex.assert_shape(lead, [(4, 16, n, 11) for n in branches])
    single = _apply(net)(params, obs[5])
    chex.assert_shape(single, [(n, 11) for n in branches])
    for a, b, c in zip(logits, lead, single):
        np.testing.assert_allclose(np.asarray(b).reshape(a.shape), a, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(c, a[5], rtol=1e-6, atol=1e-6)


def test_f32_algorithm_switch_keeps_float64_accuracy(rng):
    """Below F32_PRECISION_MIN_ROWS rows the float32 GEMMs run as HIGHEST, from it as bf16x6
    (on a GPU; the CPU computes both as f32): both sides match float64 to 1e-5 (relative to the
    largest logit), and the rows of one call do not depend on the others beyond rounding."""
    assert f32_precision(F32_PRECISION_MIN_ROWS - 1) == jax.lax.Precision.HIGHEST
    assert f32_precision(F32_PRECISION_MIN_ROWS) == F32_PRECISION
    net, params = _init(rng)
    obs = rng.normal(size=(F32_PRECISION_MIN_ROWS, D)).astype(np.float32)
    _, ref = _np_forward(params, obs, DEFAULT_BRANCHES, 2, 11)
    many = _apply(net)(params, obs)
    few = _apply(net)(params, obs[:F32_PRECISION_MIN_ROWS - 1])
    for big, small, r in zip(many, few, ref):
        chex.assert_type([big, small], jnp.float32)
        assert _rel_err(big, r) < 1e-5, f"relative error {_rel_err(big, r)} at many rows"
        assert _rel_err(small, r[:-1]) < 1e-5, f"relative error {_rel_err(small, r[:-1])}"
        np.testing.assert_allclose(big[:-1], small, rtol=0, atol=2e-5 * np.max(np.abs(r)))


def test_layer_names_and_tensor_count(rng):
    _, params = _init(rng)
    params = params["params"]
    names = {"trunk_0", "trunk_1", "value_hidden", "value_out"}
    names |= {f"adv{d}_{part}" for d in range(3) for part in ("hidden", "out")}
    assert set(params) == names  # ten Dense layers
    assert len(jax.tree_util.tree_leaves(params)) == 20
    for layer in params.values():
        assert set(layer) == {"kernel", "bias"}
        chex.assert_type([layer["kernel"], layer["bias"]], jnp.float32)
    chex.assert_shape(params["trunk_0"]["kernel"], (D, 256))
    chex.assert_shape(params["value_out"]["kernel"], (160, 11))
    chex.assert_shape(params["adv0_out"]["kernel"], (160, 5 * 11))
    chex.assert_shape(params["adv2_out"]["kernel"], (160, 3 * 11))


def test_dueling_identity(rng):
    """mean_a logits_d equals V, and logits_d - mean_a logits_d does not depend on V."""
    net, params = _init(rng)
    obs = rng.normal(size=(64, D)).astype(np.float32)
    v_ref, _ = _np_forward(params, obs, DEFAULT_BRANCHES, 2, 11)
    logits = _apply(net)(params, obs)
    for l in logits:
        np.testing.assert_allclose(np.asarray(l).mean(axis=-2), v_ref, rtol=1e-5, atol=1e-5)

    inner = dict(params["params"])
    for name in ("value_hidden", "value_out"):
        inner[name] = jax.tree_util.tree_map(
            lambda x: x + jnp.asarray(0.1 * rng.normal(size=x.shape), jnp.float32), inner[name])
    logits2 = _apply(net)({"params": inner}, obs)
    for a, b in zip(logits, logits2):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a.mean(axis=-2) - b.mean(axis=-2))) > 1e-2  # V really changed
        # float32 rounding of V + A scales with |V|, so the tolerance does too.
        scale = max(np.max(np.abs(a)), np.max(np.abs(b)))
        np.testing.assert_allclose(a - a.mean(axis=-2, keepdims=True),
                                   b - b.mean(axis=-2, keepdims=True), rtol=0, atol=1e-5 * scale)


def test_param_count_default_config(rng):
    _, params = _init(rng)
    count = param_count(params)
    trunk = (D * 256 + 256) + (256 * 256 + 256)
    value = (256 * 160 + 160) + (160 * 11 + 11)
    adv = sum((256 * 160 + 160) + (160 * n * 11 + n * 11) for n in DEFAULT_BRANCHES)
    assert count == trunk + value + adv
    target = 1.1e6 / 4
    print(f"default QNetwork, D={D}: {count} parameters, {4 * count} bytes of float32")
    assert abs(count - target) <= 0.1 * target


def test_support_and_expected_q(rng):
    z = support(-3.0, 5.0, 9)
    chex.assert_shape(z, (9,))
    np.testing.assert_allclose(z, np.linspace(-3, 5, 9), rtol=0, atol=1e-6)
    logits = rng.normal(size=(6, 4, 9)).astype(np.float32) * 3
    q = expected_q(jnp.asarray(logits), z)
    chex.assert_shape(q, (6, 4))
    np.testing.assert_allclose(q, _np_expected_q(logits, np.linspace(-3, 5, 9)), rtol=1e-5,
                               atol=1e-5)


def test_greedy_actions_match_numpy(rng):
    branches = DEFAULT_BRANCHES
    net, params = _init(rng)
    z = support(-10.0, 10.0, 11)
    obs = rng.normal(size=(64, D)).astype(np.float32)
    logits = _apply(net)(params, obs)
    acts = jax.jit(greedy_actions)(logits, z)
    chex.assert_shape(acts, (64, len(branches)))
    chex.assert_type(acts, jnp.int32)
    for d, l in enumerate(logits):
        q = _np_expected_q(l, np.linspace(-10, 10, 11))
        top2 = np.sort(q, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-4  # float32 vs float64 may differ on near ties
        assert clear.mean() > 0.8
        np.testing.assert_array_equal(np.asarray(acts[clear, d]), np.argmax(q, axis=-1)[clear])


def test_bfloat16_error_against_float32(rng):
    """bf16 GEMM inputs with f32 accumulation: parameters and logits stay f32, error is small."""
    f32, params = _init(rng)
    bf16 = make_network(NetworkConfig(dtype="bfloat16"), DEFAULT_BRANCHES)
    obs = jnp.asarray(rng.normal(size=(4096, D)), jnp.float32)
    chex.assert_trees_all_equal_shapes_and_dtypes(params, jax.eval_shape(bf16.init,
                                                                         jax.random.key(0), obs))
    z = support(-10.0, 10.0, 11)
    lf, lb = _apply(f32)(params, obs), _apply(bf16)(params, obs)
    worst = 0.0
    for a, b in zip(lf, lb):
        chex.assert_type(b, jnp.float32)
        chex.assert_equal_shape([a, b])
        worst = max(worst, float(jnp.max(jnp.abs(expected_q(a, z) - expected_q(b, z)))))
    print(f"bf16 vs f32: largest |expected Q error| over 4096 obs = {worst:.4f} "
          f"({worst / 20.0:.2e} of the support range 20)")
    assert worst > 0.0  # the bf16 path really computes in bf16
    assert worst < 0.1  # measured about 0.02-0.03; see docs/agent.md


def test_bad_configuration_raises():
    with pytest.raises(ConfigError, match="branch sizes"):
        make_network(NetworkConfig(), ())
    with pytest.raises(ConfigError, match="branch sizes"):
        make_network(NetworkConfig(), (5, 0))
    with pytest.raises(ConfigError, match="dtype"):
        make_network(NetworkConfig(dtype="float16"), (5,))
    with pytest.raises(ConfigError, match="dtype"):
        jax.eval_shape(QNetwork(branch_sizes=(3,), dtype="int8").init, jax.random.key(0),
                       jnp.zeros((1, 4)))


def test_init_params_matches_flax_structure_and_lecun_normal_scale():
    from foxhunt_jax.agent.network import init_params

    net = QNetwork(branch_sizes=(5, 3, 3))
    obs = jnp.zeros((1, 40), jnp.float32)
    ref = net.init(jax.random.PRNGKey(0), obs)
    got = init_params(net, jax.random.PRNGKey(1), obs)
    assert jax.tree.structure(ref) == jax.tree.structure(got)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(got)):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        b = np.asarray(b, np.float64)
        if path[-1].key == "bias":
            assert not b.any()
        else:  # lecun normal: std 1/sqrt(fan_in), truncated at 2 std before rescaling
            std = 1.0 / np.sqrt(b.shape[0])
            assert abs(b.std() / std - 1) < 0.1 and np.abs(b).max() <= 2 * std / 0.8796 + 1e-6
