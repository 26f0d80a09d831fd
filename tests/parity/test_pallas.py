"""The fused Q-forward kernel (pallas_kernels/q_forward.py) equals the Flax network.

Run in Pallas' interpret mode on the CPU, on fresh random parameters and observations, against
the Flax forward (same dtype) and an independent float64 NumPy forward pass that rounds to
bfloat16 where the bf16 network does. The GPU (Triton) build is checked by ``foxhunt-jax bench``.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent.learner import epsilon_greedy
from foxhunt_jax.agent.loss import bootstrap_loss
from foxhunt_jax import backend as backends
from foxhunt_jax.agent.network import (QNetwork, act, explore_actions, explore_draws,
                                       greedy_actions, q_forward, select_action, support,
                                       taken_logits)
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import ConfigError
from pallas_kernels import q_forward as qf
from pallas_kernels import tuning
from pallas_kernels.q_forward import (KernelConfig, chunks, forward_flops, fused_logits,
                                      fused_q_forward, make_plan, pack_params)

D = 40
BRANCHES = (5, 3, 3)
Z = support(-10.0, 10.0, 11)
XLA = backends.make("xla", tuning.for_device())
PALLAS = backends.make("pallas", tuning.for_device())  # interpret mode off a CUDA GPU


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"numpy/jax seed {seed}")  # pytest shows it when the test fails
    return np.random.default_rng(seed)


@functools.lru_cache(maxsize=None)
def _net(dtype="float32", branches=BRANCHES, trunk=(256, 256), head=160, atoms=11):
    return QNetwork(branch_sizes=branches, trunk=trunk, head=head, atoms=atoms, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _init_fn(net: QNetwork, dim: int):
    return jax.jit(lambda k: net.init(k, jnp.zeros((1, dim), jnp.float32)))


def _params(rng, net, dim):
    """Fresh parameters with non-zero biases (Flax initializes biases to zero, which would leave
    the bias path of the kernel untested)."""
    params = _init_fn(net, dim)(jax.random.key(int(rng.integers(2**31))))
    return jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32),
                        params)


@functools.lru_cache(maxsize=None)
def _kernel(net: QNetwork, layout: str, z_len: int):
    z = support(-10.0, 10.0, z_len)
    cfg = KernelConfig(block_rows=32, num_warps=4, layout=layout)
    return jax.jit(lambda p, o: fused_q_forward(p, o, net, z, config=cfg, interpret=True))


@functools.lru_cache(maxsize=None)
def _flax(net: QNetwork, z_len: int):
    z = support(-10.0, 10.0, z_len)
    return jax.jit(lambda p, o: q_forward(p, o, net, z, with_q=True))


def _np_forward(params, obs, net: QNetwork, z):
    """Float64 expected Q per branch from :func:`_np_logits`."""
    qs = []
    for logits in _np_logits(params, obs, net):
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        qs.append((e / e.sum(axis=-1, keepdims=True)) @ np.asarray(z, np.float64))
    return qs


def _np_logits(params, obs, net: QNetwork):
    """Float64 logits per branch ``[N, n_d, K]`` from the layer formulas; bf16 networks round
    GEMM inputs to bf16."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)["params"]
    if net.dtype == "bfloat16":
        rnd = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), np.float64)
    else:
        rnd = lambda x: x

    def dense(name, x):
        return rnd(x) @ rnd(p[name]["kernel"]) + p[name]["bias"]

    h = np.asarray(obs, np.float64)
    for i in range(len(net.trunk)):
        h = np.maximum(dense(f"trunk_{i}", h), 0.0)
    v = dense("value_out", np.maximum(dense("value_hidden", h), 0.0))
    out = []
    for d, n in enumerate(net.branch_sizes):
        a = dense(f"adv{d}_out", np.maximum(dense(f"adv{d}_hidden", h), 0.0))
        a = a.reshape(a.shape[:-1] + (n, net.atoms))
        out.append(v[:, None, :] + a - a.mean(axis=1, keepdims=True))
    return out


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _close(got, ref, dtype: str) -> None:
    """``got`` equals the float64 ``ref`` to float32 rounding (1e-5 of the largest ``|ref|``),
    or for a bf16 network to bf16 accuracy. There the GEMM inputs are rounded to bf16 from
    float32 values in the kernel and from float64 values in the reference, and now and then a
    hidden activation lies between the two and rounds to the neighbouring bf16 value, which
    moves its row's outputs by up to about 1e-2 of the largest output (6e-3 seen). So at least
    9 rows in 10 (first axis) agree to 1e-4 and every row to 3e-2."""
    a, b = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(a - b).reshape(a.shape[0], -1).max(axis=1) / np.max(np.abs(b))
    if dtype == "float32":
        assert err.max() < 1e-5, err.max()
        return
    assert np.mean(err < 1e-4) >= 0.9, np.sort(err)[-8:]
    assert err.max() < 3e-2, err.max()


def _check_actions(actions, qs, qs_ref):
    """Greedy actions equal the reference argmax wherever the reference's top two expected Q
    are further apart than twice the largest Q error (only then is the argmax determined)."""
    actions = np.asarray(actions)
    for d, (q, ref) in enumerate(zip(qs, qs_ref)):
        ref = np.asarray(ref, np.float64)
        err = float(np.max(np.abs(np.asarray(q, np.float64) - ref)))
        top = np.sort(ref, axis=1)
        gap = top[:, -1] - top[:, -2] if ref.shape[1] > 1 else np.full(ref.shape[0], np.inf)
        decided = gap > 2 * err + 1e-12
        np.testing.assert_array_equal(actions[decided, d], np.argmax(ref, axis=1)[decided],
                                      err_msg=f"branch {d}: greedy actions differ")
        assert np.mean(decided) > 0.9  # the check is not vacuous


def test_chunks_are_powers_of_two_covering_the_width():
    for width in [1, 11, 16, 40, 160, 255, 256, 257, 600]:
        cs = chunks(width)
        assert sum(cs) == -(-width // 16) * 16
        assert all(c >= 16 and c <= 256 and c & (c - 1) == 0 for c in cs)
    assert chunks(160) == (128, 32)


def test_f32_kernel_equals_flax_and_float64(rng, layout="grouped"):
    """The default network (the per-action layout is checked on odd widths below)."""
    net = _net()
    params = _params(rng, net, D)
    obs = jnp.asarray(2.0 * rng.standard_normal((77, D)), jnp.float32)  # 77: rows get padded
    q, a = _kernel(net, layout, 11)(params, obs)
    q_flax, a_flax = _flax(net, 11)(params, obs)
    ref = _np_forward(params, obs, net, Z)
    chex.assert_shape(a, (77, len(BRANCHES)))
    chex.assert_type(a, jnp.int32)
    for d, n in enumerate(BRANCHES):
        chex.assert_shape(q[d], (77, n))
        chex.assert_type(q[d], jnp.float32)
        assert _rel(q[d], q_flax[d]) < 1e-5
        assert _rel(q[d], ref[d]) < 1e-5
    _check_actions(a, q, ref)
    _check_actions(a_flax, q_flax, ref)


def test_bf16_kernel_equals_flax_bf16(rng):
    net = _net("bfloat16")
    params = _params(rng, net, D)
    obs = jnp.asarray(2.0 * rng.standard_normal((64, D)), jnp.float32)
    q, a = _kernel(net, "grouped", 11)(params, obs)
    q_flax, a_flax = _flax(net, 11)(params, obs)
    ref = _np_forward(params, obs, net, Z)
    ref_f32 = _np_forward(params, obs, _net(), Z)
    for d in range(len(BRANCHES)):
        # The same bf16 GEMM inputs with f32 accumulation: only the summation order differs,
        # but that can move a hidden activation across a bf16 rounding boundary (one bf16 step
        # is 2^-8 relative), so the outputs agree to bf16 accuracy, not to f32 rounding.
        assert _rel(q[d], q_flax[d]) < 5e-3
        _close(q[d], ref[d], "bfloat16")
        assert _rel(q[d], ref_f32[d]) < 3e-2  # bf16 against the f32 network
    _check_actions(a, q, ref)


@pytest.mark.parametrize("layout", ["grouped", "per_action"])
def test_odd_widths_and_one_branch(rng, layout):
    """Widths that are not multiples of 16, 7 atoms, one branch of 6 actions."""
    net = _net("float32", (6,), (48, 37), 24, 7)
    dim = 13
    z = support(-10.0, 10.0, 7)
    params = _params(rng, net, dim)
    obs = jnp.asarray(rng.standard_normal((40, dim)), jnp.float32)
    q, a = _kernel(net, layout, 7)(params, obs)
    ref = _np_forward(params, obs, net, z)
    chex.assert_shape((q[0], a), [(40, 6), (40, 1)])
    assert _rel(q[0], ref[0]) < 1e-5
    _check_actions(a, q, ref)


@pytest.mark.parametrize("layout", ["grouped", "per_action"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_kernel_equals_flax_and_float64(rng, layout, dtype):
    """fused_logits is network.apply: the default network in both dtypes and both layouts,
    rows that get padded (45 of 64). With ``actions`` (float32) it is each branch's
    ``select_action`` of those logits."""
    net = _net(dtype)
    params = _params(rng, net, D)
    obs = jnp.asarray(2.0 * rng.standard_normal((45, D)), jnp.float32)
    cfg = KernelConfig(block_rows=32, num_warps=4, layout=layout)
    logits = jax.jit(lambda p, o: fused_logits(p, o, net, config=cfg, interpret=True))(params, obs)
    flax_logits = jax.jit(net.apply)(params, obs)
    ref = _np_logits(params, obs, net)
    tol = 1e-5 if dtype == "float32" else 5e-3  # bf16: see test_bf16_kernel_equals_flax_bf16
    for d, n in enumerate(BRANCHES):
        chex.assert_shape(logits[d], (45, n, 11))
        chex.assert_type(logits[d], jnp.float32)
        assert _rel(logits[d], flax_logits[d]) < tol
        _close(logits[d], ref[d], dtype)
    if dtype == "float32":  # the selection does not depend on the GEMM dtype
        actions = jnp.asarray(rng.integers(0, BRANCHES, (45, len(BRANCHES))), jnp.int32)
        taken = jax.jit(lambda p, o, a: fused_logits(p, o, net, actions=a, config=cfg,
                                                     interpret=True))(params, obs, actions)
        for d in range(len(BRANCHES)):
            chex.assert_shape(taken[d], (45, 11))
            want = ref[d][np.arange(45), np.asarray(actions[:, d])]
            assert _rel(taken[d], want) < tol
            assert _rel(taken[d], select_action(flax_logits[d], actions[:, d])) < tol


@pytest.mark.parametrize("layout", ["grouped", "per_action"])
def test_act_kernel_equals_flax_and_float64(rng, layout):
    """network.act, the collection forward: the greedy actions, the epsilon-greedy ones and
    each branch's logits of the action taken, from one fused kernel (rows padded, 45 of 64)
    equal to the Flax forward and the float64 one, with about half the branches exploring."""
    net = _net("float32")
    params = _params(rng, net, D)
    obs = jnp.asarray(2.0 * rng.standard_normal((45, D)), jnp.float32)
    draws = explore_draws(jax.random.key(int(rng.integers(1 << 30))), 45, BRANCHES, 0.5)
    cfg = KernelConfig(block_rows=32, num_warps=4, layout=layout)
    greedy, taken = jax.jit(lambda p, o, r: qf.fused_act(p, o, net, Z, r, config=cfg,
                                                         interpret=True))(params, obs, draws)
    ref_greedy, ref_action, ref_taken = jax.jit(
        lambda p, o, r: act(p, o, r, net, Z))(params, obs, draws)
    chex.assert_shape([greedy, ref_action], [(45, len(BRANCHES))] * 2)
    chex.assert_type(greedy, jnp.int32)
    _check_actions(greedy, [np.asarray(q) for q in _flax(net, 11)(params, obs)[0]],
                   _np_forward(params, obs, net, Z))
    action = np.where(np.asarray(draws) >= 0, draws, greedy)
    assert 0 < np.mean(np.asarray(draws) >= 0) < 1  # both kinds of branch are present
    ref = _np_logits(params, obs, net)
    for d in range(len(BRANCHES)):
        chex.assert_shape([taken[d], ref_taken[d]], [(45, 11)] * 2)
        assert _rel(taken[d], ref[d][np.arange(45), action[:, d]]) < 1e-5
        assert _rel(ref_taken[d], ref[d][np.arange(45), np.asarray(ref_action[:, d])]) < 1e-5
    np.testing.assert_array_equal(ref_action, np.where(np.asarray(draws) >= 0, draws,
                                                        ref_greedy))
    via_act = jax.jit(lambda p, o, r: PALLAS.act(p, o, r, net, Z))(params, obs, draws)
    np.testing.assert_array_equal(via_act[1], np.where(np.asarray(draws) >= 0, draws,
                                                       via_act[0]))


@pytest.mark.parametrize("layout", ["grouped", "per_action"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bootstrap_loss_kernel_equals_c51_loss_and_float64(rng, layout, dtype):
    """fused_bootstrap_loss is c51_loss of the given online logits against the target network's
    logits of the bootstrap actions: rows padded (45 of 64), returns inside and beyond the
    support, terminated rows (discount 0), a return on an atom; against the XLA backend and a
    float64 loss over the float64 logits."""
    from test_loss import np_projection, np_softmax

    net = _net(dtype)
    params = _params(rng, net, D)
    m, nb = 45, len(BRANCHES)
    obs = jnp.asarray(2.0 * rng.standard_normal((m, D)), jnp.float32)
    best = jnp.asarray(rng.integers(0, BRANCHES, (m, nb)), jnp.int32)
    taken = tuple(jnp.asarray(2.0 * rng.standard_normal((m, 11)), jnp.float32)
                  for _ in BRANCHES)
    returns = 4.0 * rng.standard_normal(m)
    returns[:5] = [30.0, -30.0, 10.0, -10.0, 2.0]  # beyond and on the support's ends, an atom
    discounts = 0.99 ** rng.integers(1, 4, m)
    discounts[rng.uniform(size=m) < 0.2] = 0.0
    discounts[4] = 0.0
    returns, discounts = jnp.asarray(returns, jnp.float32), jnp.asarray(discounts, jnp.float32)
    cfg = KernelConfig(block_rows=32, num_warps=4, layout=layout)
    loss = jax.jit(lambda p, o, a, t, r, g: qf.fused_bootstrap_loss(
        p, o, net, Z, a, t, r, g, config=cfg, interpret=True))(params, obs, best, taken,
                                                               returns, discounts)
    chex.assert_shape(loss, (m,))
    chex.assert_type(loss, jnp.float32)
    via_xla = jax.jit(lambda p, o, a, t, r, g: bootstrap_loss(p, o, a, t, r, g, net, Z))(
        params, obs, best, taken, returns, discounts)
    tol = 1e-5 if dtype == "float32" else 5e-3  # bf16: the target logits' GEMMs round
    assert _rel(loss, via_xla) < tol
    rows, zr = np.arange(m), np.linspace(-10.0, 10.0, 11)
    ref = np.zeros(m)
    for d, target in enumerate(_np_logits(params, obs, net)):
        proj = np_projection(np_softmax(target[rows, np.asarray(best[:, d])]), returns,
                             discounts, zr)
        x = np.asarray(taken[d], np.float64)
        log_q = x - x.max(axis=1, keepdims=True)
        log_q -= np.log(np.exp(log_q).sum(axis=1, keepdims=True))
        ref -= (proj * log_q).sum(axis=1) / nb
    _close(loss, ref, dtype)
    via_backend = jax.jit(lambda p, o, a, t, r, g: PALLAS.bootstrap_loss(p, o, a, t, r, g, net,
                                                                          Z))(
        params, obs, best, taken, returns, discounts)
    assert _rel(via_backend, via_xla) < tol


def test_taken_logits_backends_agree_with_leading_axes(rng):
    net = _net("float32", (6,), (48, 37), 24, 7)
    params = _params(rng, net, 13)
    obs = jnp.asarray(rng.standard_normal((2, 9, 13)), jnp.float32)
    actions = jnp.asarray(rng.integers(0, 6, (2, 9, 1)), jnp.int32)
    fwd = jax.jit(lambda p, o, a, b: b.taken_logits(p, o, a, net), static_argnums=3)
    x, p = fwd(params, obs, actions, XLA), fwd(params, obs, actions, PALLAS)  # interpreted
    chex.assert_shape([x[0], p[0]], [(2, 9, 7)] * 2)
    assert _rel(p[0], x[0]) < 1e-5
    ref = _np_logits(params, obs.reshape(18, 13), net)[0][np.arange(18), np.ravel(actions)]
    assert _rel(p[0], ref.reshape(2, 9, 7)) < 1e-5
    assert _rel(taken_logits(params, obs, actions, net)[0], x[0]) == 0


@pytest.mark.parametrize("layout", ["grouped", "per_action"])
def test_logits_kernel_lowers_for_cuda_on_this_cpu(layout):
    """Pallas -> Triton lowering of the logits outputs (3-D blocks; one action row at a time in
    the per-action layout) at the default network width, no GPU needed."""
    net = _net("bfloat16")
    params = _init_fn(net, D)(jax.random.key(0))
    gpu = tuning.for_device(SimpleNamespace(platform="gpu", core_count=132))
    cfg = dataclasses.replace(gpu.q_forward_config("bfloat16"), layout=layout)
    assert cfg.lookahead > 0  # the default reads blocks ahead: that path is lowered here
    fn = jax.jit(lambda p, o: fused_logits(p, o, net, config=cfg, interpret=False))
    text = fn.trace(params, jnp.zeros((300, D), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and "fused_q_forward" in text
    # each branch's logits of given actions, batched over data-parallel shards (collect_shards
    # vmaps the priorities)
    sharded = jax.jit(jax.vmap(lambda o, a: fused_logits(params, o, net, actions=a, config=cfg,
                                                         interpret=False)))
    assert "xla.gpu.triton" in sharded.trace(
        jnp.zeros((2, 300, D), jnp.float32), jnp.zeros((2, 300, len(BRANCHES)), jnp.int32)
    ).lower(lowering_platforms=("cuda",)).as_text()
    # the C51 loss against the target's bootstrap distribution (the initial priorities)
    k, rows = 11, 300
    lossing = jax.jit(lambda p, o, a, t, r, g: qf.fused_bootstrap_loss(p, o, net, Z, a, t, r, g,
                                                                       config=cfg,
                                                                       interpret=False))
    assert "xla.gpu.triton" in lossing.trace(
        params, jnp.zeros((rows, D), jnp.float32), jnp.zeros((rows, len(BRANCHES)), jnp.int32),
        (jnp.zeros((rows, k), jnp.float32),) * len(BRANCHES), jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    # the collection forward: greedy actions and the taken actions' logits
    acting = jax.jit(lambda p, o, r: qf.fused_act(p, o, net, Z, r, config=cfg, interpret=False))
    assert "xla.gpu.triton" in acting.trace(
        params, jnp.zeros((300, D), jnp.float32), jnp.zeros((300, len(BRANCHES)), jnp.int32)
    ).lower(lowering_platforms=("cuda",)).as_text()


def test_narrow_operand_blocks_equal_flax(rng):
    """``max_chunk`` splits every GEMM into narrower blocks (256 -> 8 x 32): same result."""
    net = _net()
    params = _params(rng, net, D)
    obs = jnp.asarray(rng.standard_normal((40, D)), jnp.float32)
    cfg = KernelConfig(block_rows=32, num_warps=4, max_chunk=32)
    q, a = jax.jit(lambda p, o: fused_q_forward(p, o, net, Z, config=cfg, interpret=True))(
        params, obs)
    q_flax, _ = _flax(net, 11)(params, obs)
    for d in range(len(BRANCHES)):
        assert _rel(q[d], q_flax[d]) < 1e-5
    _check_actions(a, q, _np_forward(params, obs, net, Z))
    assert make_plan(net, D, 32).chunks(256) == (32,) * 8
    with pytest.raises(ValueError, match="max_chunk"):
        make_plan(net, D, 24)


@pytest.mark.parametrize("layout", ["grouped", "per_action"])
def test_reading_blocks_ahead_changes_nothing(rng, layout):
    """``lookahead`` only moves loads earlier: Q, actions and logits are bit-equal to reading
    each block as it is used (64-wide blocks, so the forward reads dozens of them)."""
    net = _net("bfloat16")
    params = _params(rng, net, D)
    obs = jnp.asarray(2.0 * rng.standard_normal((40, D)), jnp.float32)
    outs = []
    for ahead in (0, 1, 3):
        cfg = KernelConfig(block_rows=16, num_warps=4, layout=layout, max_chunk=64,
                           lookahead=ahead)
        outs.append(jax.jit(lambda p, o, _c=cfg: (
            fused_q_forward(p, o, net, Z, config=_c, interpret=True),
            fused_logits(p, o, net, config=_c, interpret=True)))(params, obs))
    for other in outs[1:]:
        chex.assert_trees_all_equal(other, outs[0])


class _LoggedBlocks(qf._Blocks):
    """Blocks that are zeros, logging each read and how many reads preceded each hand-out."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.reads, self.handed = [], []

    def _read(self, key):
        self.reads.append(key)
        _, cols, rows = key
        return jnp.zeros((cols[1],) if rows is None else (rows[1], cols[1]),
                         jnp.float32 if rows is None else self.cd)

    def __call__(self, name, cols, rows=None):
        out = super().__call__(name, cols, rows)
        self.handed.append(len(self.reads))
        return out


@pytest.mark.parametrize("layout", ["grouped", "per_action"])
@pytest.mark.parametrize("ahead", [1, 2, 5])
def test_blocks_are_read_ahead_in_the_forwards_order(layout, ahead):
    net = _net("bfloat16")
    plan = make_plan(net, D, 64)
    cd = jnp.bfloat16
    order = qf.read_blocks(plan, cd, layout, None, 16, ahead).order
    weights = [i for i, key in enumerate(order) if key[2] is not None]
    assert len(weights) > 40 and len(set(order)) == len(order)
    blocks = _LoggedBlocks({}, cd, order, ahead)
    xs = [jnp.zeros((16, c), cd) for c in plan.chunks(D)]
    actions = qf.forward_rows(plan, cd, layout, blocks, xs, jnp.zeros((16,), jnp.float32))
    assert len(actions) == len(BRANCHES)
    assert blocks.reads == order  # each block once, in the order the forward uses them
    for i, done in enumerate(blocks.handed):
        later = [j for j in weights if j > i][:ahead]
        assert done >= (later[-1] + 1 if later else i + 1), f"block {i} handed out too early"


def test_pack_params_pads_with_exact_zeros(rng):
    net = _net("float32", (6,), (48, 37), 24, 7)
    params = _params(rng, net, 13)
    plan = make_plan(net, 13)
    packed = pack_params(params, plan, "float32")
    w = np.asarray(packed["trunk_1_w"])
    chex.assert_shape(w, (48, 48))  # 48 -> 48, 37 -> 48
    np.testing.assert_array_equal(w[:, 37:], 0.0)
    np.testing.assert_array_equal(w[:48, :37], np.asarray(params["params"]["trunk_1"]["kernel"]))
    out_w = np.asarray(packed["adv0_out_w"]).reshape(32, 8, 16)  # head 24 -> 32, 6 -> 8, 7 -> 16
    np.testing.assert_array_equal(out_w[24:], 0.0)
    np.testing.assert_array_equal(out_w[:, 6:], 0.0)
    np.testing.assert_array_equal(out_w[:, :, 7:], 0.0)
    np.testing.assert_array_equal(out_w[:24, :6, :7],
                                  np.asarray(params["params"]["adv0_out"]["kernel"]).reshape(24, 6, 7))
    assert packed["adv0_out_w"].dtype == jnp.float32
    assert pack_params(params, plan, "bfloat16")["adv0_out_w"].dtype == jnp.bfloat16


def test_q_forward_backends_agree_with_leading_axes(rng):
    net = _net("float32", (6,), (48, 37), 24, 7)
    z = support(-10.0, 10.0, 7)
    params = _params(rng, net, 13)
    obs = jnp.asarray(rng.standard_normal((2, 9, 13)), jnp.float32)
    fwd = jax.jit(lambda p, o, b: b.q_forward(p, o, net, z, with_q=True), static_argnums=2)
    q_x, a_x = fwd(params, obs, XLA)
    q_p, a_p = fwd(params, obs, PALLAS)  # interpret mode off a CUDA GPU
    chex.assert_shape([a_x, a_p, q_p[0]], [(2, 9, 1), (2, 9, 1), (2, 9, 6)])
    assert _rel(q_p[0], q_x[0]) < 1e-5
    np.testing.assert_array_equal(np.asarray(a_p), np.asarray(a_x))
    assert q_forward(params, obs, net, z)[0] is None
    assert PALLAS.q_forward(params, obs, net, z)[0] is None


def test_explore_actions_is_epsilon_greedy(rng):
    """The collector's exploration from greedy actions equals the learner's epsilon_greedy."""
    n = 512
    logits = tuple(jnp.asarray(rng.standard_normal((n, k, 11)), jnp.float32) for k in BRANCHES)
    key = jax.random.key(int(rng.integers(2**31)))
    for eps in (0.0, 0.3, 1.0):
        want = epsilon_greedy(key, logits, Z, eps)
        got = explore_actions(key, greedy_actions(logits, Z), BRANCHES, eps)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    greedy = np.asarray(greedy_actions(logits, Z))
    rand = np.asarray(explore_actions(key, jnp.asarray(greedy), BRANCHES, 0.5))
    frac = np.mean(rand != greedy, axis=0)  # P(differ) = eps * (1 - 1/n_d)
    np.testing.assert_allclose(frac, [0.5 * (1 - 1 / k) for k in BRANCHES], atol=0.08)


def test_backend_config_is_validated():
    cfg = load_config(None, ["network.backend=pallas", "network.dtype=bfloat16"])
    assert (cfg.network.backend, cfg.network.dtype) == ("pallas", "bfloat16")
    assert load_config(None).network.backend == "auto"
    with pytest.raises(ConfigError, match="network.backend"):
        load_config(None, ["network.backend=triton"])
    with pytest.raises(ConfigError, match="needs network.dtype=bfloat16"):
        load_config(None, ["network.backend=pallas", "network.dtype=float32"])  # XLA is faster
    # dtype auto is bfloat16 exactly where the kernels compile (foxhunt_jax.backend.resolve_config)
    assert load_config(None, ["network.backend=pallas"]).network.dtype == "auto"


def test_forward_flops_counts_the_ten_gemms():
    # 40*256 + 256*256 + 256*160 + 160*11 + 3 * 256*160 + 160*(55 + 33 + 33) MACs
    macs = 40 * 256 + 256 * 256 + 4 * 256 * 160 + 160 * 11 + 160 * 121
    assert forward_flops(40, (256, 256), 160, 11, BRANCHES) == 2 * macs
