"""C51 projection, double-Q loss and n-step targets against float64 NumPy references."""

from __future__ import annotations

import secrets

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent.loss import (EDGE_TOLERANCE, c51_double_q_loss, c51_loss,
                                    c51_loss_and_edge_mass, categorical_projection,
                                    clipped_edge_mass, n_step_targets)
from foxhunt_jax.agent.network import support
from foxhunt_jax.errors import ConfigError


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"numpy seed {seed}")  # pytest shows it when the test fails
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------------------
# float64 references, written from the textbook formulas (floor/ceil split, plain loops)


def np_projection(probs, returns, discounts, z):
    probs, returns, discounts, z = (np.asarray(x, np.float64)
                                    for x in (probs, returns, discounts, z))
    m_rows, k = probs.shape
    v_min, v_max = z[0], z[-1]
    dz = (v_max - v_min) / (k - 1)
    out = np.zeros((m_rows, k))
    for m in range(m_rows):
        for j in range(k):
            tz = min(max(returns[m] + discounts[m] * z[j], v_min), v_max)
            b = (tz - v_min) / dz
            lo, hi = int(np.floor(b)), int(np.ceil(b))
            lo, hi = min(max(lo, 0), k - 1), min(max(hi, 0), k - 1)
            if lo == hi:
                out[m, lo] += probs[m, j]
            else:
                out[m, lo] += probs[m, j] * (hi - b)
                out[m, hi] += probs[m, j] * (b - lo)
    return out


def np_edge_mass(probs, returns, discounts, z):
    """Mass of the atoms whose shifted value lies past an edge by more than the tolerance."""
    probs, returns, discounts, z = (np.asarray(x, np.float64)
                                    for x in (probs, returns, discounts, z))
    tol = EDGE_TOLERANCE * (z[-1] - z[0]) / (len(z) - 1)
    out = np.zeros(len(returns))
    for m in range(len(returns)):
        for j in range(len(z)):
            tz = returns[m] + discounts[m] * z[j]
            if tz < z[0] - tol or tz > z[-1] + tol:
                out[m] += probs[m, j]
    return out


def np_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_loss(online_s, online_next, target_next, actions, returns, discounts, z):
    z = np.asarray(z, np.float64)
    rows = np.arange(actions.shape[0])
    total = np.zeros(actions.shape[0])
    for d in range(len(online_s)):
        q_next = np_softmax(online_next[d]) @ z
        a_star = np.argmax(q_next, axis=-1)
        p_next = np_softmax(np.asarray(target_next[d], np.float64)[rows, a_star])
        m = np_projection(p_next, returns, discounts, z)
        x = np.asarray(online_s[d], np.float64)[rows, actions[:, d]]
        log_p = x - x.max(axis=-1, keepdims=True)
        log_p = log_p - np.log(np.exp(log_p).sum(axis=-1, keepdims=True))
        total += -(m * log_p).sum(axis=-1)
    return total / len(online_s)


def np_n_step(rewards, terminated, truncated, gamma, n):
    length, episodes = rewards.shape
    ret = np.zeros((length, episodes))
    disc = np.zeros((length, episodes))
    offs = np.zeros((length, episodes), np.int64)
    for e in range(episodes):
        for t in range(length):
            g, k, term = 0.0, 0, False
            for i in range(n):
                s = t + i
                if s >= length:
                    break
                g += gamma**i * rewards[s, e]
                k += 1
                if terminated[s, e]:
                    term = True
                    break
                if truncated[s, e]:
                    break
            ret[t, e], offs[t, e] = g, k
            disc[t, e] = 0.0 if term else gamma**k
    return ret, disc, offs


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)


# ---------------------------------------------------------------------------------------------
# categorical_projection


@pytest.mark.parametrize("k", [11, 51])
def test_projection_matches_reference_random(rng, k):
    m = 64
    z = support(-10.0, 10.0, k)
    probs = np_softmax(rng.normal(size=(m, k)) * 2).astype(np.float32)
    returns = rng.normal(size=m).astype(np.float32) * 6
    discounts = rng.uniform(0, 1, size=m).astype(np.float32)
    out = jax.jit(categorical_projection)(probs, returns, discounts, z)
    chex.assert_shape(out, (m, k))
    chex.assert_type(out, jnp.float32)
    ref = np_projection(probs, returns, discounts, z)
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_allclose(np.asarray(out).sum(axis=1), 1.0, atol=1e-5)
    assert np.all(np.asarray(out) >= 0)


def test_projection_edge_cases(rng):
    k, m = 11, 64
    z = support(-10.0, 10.0, k)  # atoms every 2.0
    probs = np_softmax(rng.normal(size=(m, k))).astype(np.float32)
    proj = jax.jit(categorical_projection)

    def check(returns, discounts, p=probs):
        out = np.asarray(proj(p, jnp.asarray(returns, jnp.float32),
                              jnp.asarray(discounts, jnp.float32), z))
        assert rel_err(out, np_projection(p, returns, discounts, z)) < 1e-5
        np.testing.assert_allclose(out.sum(axis=1), p.sum(axis=1), atol=1e-5)  # no mass lost
        return out

    ones = np.ones(m, np.float32)
    # Far beyond the support on both sides: every atom lands on an edge atom.
    out = check(np.full(m, 1e3), ones)
    np.testing.assert_allclose(out[:, -1], 1.0, atol=1e-6)
    out = check(np.full(m, -1e3), ones * 0.9)
    np.testing.assert_allclose(out[:, 0], 1.0, atol=1e-6)
    # gamma 0 / terminated (discount 0): a point mass at the return, split between two atoms.
    r = rng.uniform(-9.9, 9.9, size=m)
    out = check(r, np.zeros(m))
    b = (r + 10.0) / 2.0
    lo = np.floor(b).astype(int)
    np.testing.assert_allclose(out[np.arange(m), lo], lo + 1 - b, atol=1e-5)
    # A target exactly on an atom: b is an integer, so l == u and all mass goes there.
    atom = rng.integers(0, k, size=m)
    out = check(np.asarray(z)[atom], np.zeros(m))
    np.testing.assert_allclose(out, np.eye(k)[atom], atol=1e-6)
    # Discount 1 and a return of one atom spacing: the distribution shifts by one atom exactly.
    out = check(np.full(m, 2.0), ones)
    np.testing.assert_allclose(out[:, 1:-1], probs[:, :-2], atol=1e-6)
    np.testing.assert_allclose(out[:, -1], probs[:, -2] + probs[:, -1], atol=1e-6)
    assert np.all(out[:, 0] == 0)
    # All mass on an edge atom, with a random return and discount.
    edge = np.zeros((m, k), np.float32)
    edge[: m // 2, 0] = 1.0
    edge[m // 2:, -1] = 1.0
    check(rng.normal(size=m) * 4, rng.uniform(0, 1, size=m), p=edge)
    # Discount 1 with random returns (no shrinking of the support).
    check(rng.normal(size=m) * 3, ones)


# ---------------------------------------------------------------------------------------------
# c51_double_q_loss


def _loss_inputs(rng, m, branches, k):
    """Random logits; next-state Q of each row has a clear argmax so f32 and f64 agree on it."""
    z = np.linspace(-10.0, 10.0, k)
    online_s, online_next, target_next = [], [], []
    for n in branches:
        online_s.append(rng.normal(size=(m, n, k)).astype(np.float32) * 2)
        nxt = rng.normal(size=(m, n, k)).astype(np.float32) * 2
        while True:  # redraw rows with a near tie between the two best actions
            top2 = np.sort(np_softmax(nxt) @ z, axis=-1)[:, -2:] if n > 1 else None
            bad = np.zeros(m, bool) if n == 1 else (top2[:, 1] - top2[:, 0] < 1e-3)
            if not bad.any():
                break
            nxt[bad] = rng.normal(size=(int(bad.sum()), n, k)).astype(np.float32) * 2
        online_next.append(nxt)
        target_next.append(rng.normal(size=(m, n, k)).astype(np.float32) * 2)
    actions = np.stack([rng.integers(0, n, size=m) for n in branches], axis=1).astype(np.int32)
    returns = (rng.normal(size=m) * 5).astype(np.float32)
    discounts = (0.99 ** rng.integers(1, 6, size=m)).astype(np.float32)
    discounts[rng.uniform(size=m) < 0.2] = 0.0  # terminated transitions
    return tuple(online_s), tuple(online_next), tuple(target_next), actions, returns, discounts


@pytest.mark.parametrize("branches,k", [((5,), 11), ((5, 3, 3), 11), ((4, 2, 3), 51)])
def test_loss_matches_reference(rng, branches, k):
    m = 64
    args = _loss_inputs(rng, m, branches, k)
    z = support(-10.0, 10.0, k)
    loss = jax.jit(c51_double_q_loss)(*args, z)
    chex.assert_shape(loss, (m,))
    chex.assert_type(loss, jnp.float32)
    ref = np_loss(*args, np.linspace(-10.0, 10.0, k))
    assert rel_err(loss, ref) < 1e-5


def test_loss_from_chosen_rows_matches_reference(rng):
    """c51_loss takes each branch's chosen logits: the taken action's online row and the target
    row of the online greedy action at s' (picked here in NumPy); the same loss."""
    m, k, branches = 48, 11, (5, 3, 3)
    online_s, online_next, target_next, actions, returns, discounts = _loss_inputs(
        rng, m, branches, k)
    zr, rows = np.linspace(-10.0, 10.0, k), np.arange(m)
    best = [np.argmax(np_softmax(x) @ zr, axis=-1) for x in online_next]
    taken = tuple(x[rows, actions[:, d]] for d, x in enumerate(online_s))
    target = tuple(x[rows, best[d]] for d, x in enumerate(target_next))
    loss = jax.jit(c51_loss)(taken, target, returns, discounts, support(-10.0, 10.0, k))
    chex.assert_shape(loss, (m,))
    ref = np_loss(online_s, online_next, target_next, actions, returns, discounts, zr)
    assert rel_err(loss, ref) < 1e-5
    with pytest.raises(ValueError, match="same number of branches"):
        c51_loss(taken, target[:2], returns, discounts, support(-10.0, 10.0, k))


def test_loss_edge_cases(rng):
    m, k, branches = 64, 11, (5, 3, 3)
    z = support(-10.0, 10.0, k)
    online_s, online_next, target_next, actions, _, _ = _loss_inputs(rng, m, branches, k)
    fn = jax.jit(c51_double_q_loss)
    zr = np.linspace(-10.0, 10.0, k)
    cases = {
        "beyond v_max": (np.full(m, 500.0), np.full(m, 0.99)),
        "beyond v_min": (np.full(m, -500.0), np.full(m, 0.99)),
        "gamma 0": (rng.normal(size=m) * 3, np.zeros(m)),
        "on an atom": (zr[rng.integers(0, k, size=m)], np.zeros(m)),
        "discount 1": (rng.normal(size=m), np.ones(m)),
    }
    for name, (r, disc) in cases.items():
        r, disc = r.astype(np.float32), disc.astype(np.float32)
        loss = fn(online_s, online_next, target_next, actions, r, disc, z)
        ref = np_loss(online_s, online_next, target_next, actions, r, disc, zr)
        assert rel_err(loss, ref) < 1e-5, name
    # Target on an edge atom: the loss is minus the mean log-probability of that atom.
    loss = fn(online_s, online_next, target_next, actions, np.full(m, 1e3, np.float32),
              np.zeros(m, np.float32), z)
    rows = np.arange(m)
    expect = np.mean([-np.log(np_softmax(online_s[d][rows, actions[:, d]])[:, -1])
                      for d in range(3)], axis=0)
    assert rel_err(loss, expect) < 1e-5


def test_gradient_flows_only_into_online_s(rng):
    m, k, branches = 32, 11, (5, 3, 3)
    online_s, online_next, target_next, actions, returns, discounts = _loss_inputs(
        rng, m, branches, k)
    z = support(-10.0, 10.0, k)

    def total(o_s, o_n, t_n):
        return jnp.sum(c51_double_q_loss(o_s, o_n, t_n, actions, returns, discounts, z))

    g_s, g_n, g_t = jax.jit(jax.grad(total, argnums=(0, 1, 2)))(online_s, online_next,
                                                                target_next)
    zr = np.linspace(-10.0, 10.0, k)
    rows = np.arange(m)
    for d, n in enumerate(branches):
        chex.assert_trees_all_equal(g_n[d], jnp.zeros_like(g_n[d]))
        chex.assert_trees_all_equal(g_t[d], jnp.zeros_like(g_t[d]))
        # d/dlogits of cross-entropy is (softmax - target) / B on the taken action, 0 elsewhere.
        a_star = np.argmax(np_softmax(online_next[d]) @ zr, axis=-1)
        target = np_projection(np_softmax(target_next[d][rows, a_star]), returns, discounts, zr)
        expect = np.zeros((m, n, k))
        expect[rows, actions[:, d]] = (np_softmax(online_s[d][rows, actions[:, d]]) - target) / 3
        np.testing.assert_allclose(g_s[d], expect, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# n_step_targets


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_n_step_targets_match_loop_reference(rng, n):
    length, episodes = 13, 24
    rewards = rng.normal(size=(length, episodes)).astype(np.float32)
    u = rng.uniform(size=(length, episodes))
    terminated = u < 0.12
    truncated = (u > 0.88) | (rng.uniform(size=(length, episodes)) < 0.03)  # some both flags
    gamma = float(rng.uniform(0.8, 0.999))
    ret, disc, offs = jax.jit(n_step_targets, static_argnums=(3, 4))(
        rewards, terminated, truncated, gamma, n)
    chex.assert_shape([ret, disc, offs], (length, episodes))
    chex.assert_type([ret, disc, offs], [jnp.float32, jnp.float32, jnp.int32])
    r_ref, d_ref, o_ref = np_n_step(rewards, terminated, truncated, gamma, n)
    np.testing.assert_array_equal(offs, o_ref)
    np.testing.assert_allclose(ret, r_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(disc, d_ref, rtol=1e-5, atol=1e-7)


def test_n_step_semantics():
    # One episode: steps 0..5; step 2 terminates, step 5 truncates; window of 8 steps.
    rewards = np.arange(1, 9, dtype=np.float32)[:, None]
    terminated = np.zeros((8, 1), bool)
    truncated = np.zeros((8, 1), bool)
    terminated[2] = True
    truncated[5] = True
    fn = jax.jit(n_step_targets, static_argnums=(3, 4))
    ret, disc, offs = fn(rewards, terminated, truncated, 0.5, 3)
    ret, disc, offs = np.asarray(ret)[:, 0], np.asarray(disc)[:, 0], np.asarray(offs)[:, 0]
    np.testing.assert_array_equal(offs, [3, 2, 1, 3, 2, 1, 2, 1])
    np.testing.assert_allclose(ret[0], 1 + 0.5 * 2 + 0.25 * 3)  # ends on termination
    assert disc[0] == 0.0 and disc[1] == 0.0 and disc[2] == 0.0
    np.testing.assert_allclose(ret[4], 5 + 0.5 * 6)  # ends on truncation: bootstraps
    np.testing.assert_allclose(disc[[3, 4, 5]], [0.125, 0.25, 0.5])
    np.testing.assert_allclose(disc[[6, 7]], [0.25, 0.5])  # window end counts as truncation
    # gamma 0: one-step reward, discount 0 everywhere.
    ret0, disc0, _ = fn(rewards, terminated, truncated, 0.0, 4)
    np.testing.assert_allclose(ret0, rewards)
    assert np.all(np.asarray(disc0) == 0.0)


def test_n_step_rejects_bad_n():
    z = jnp.zeros((4, 2))
    with pytest.raises(ConfigError, match="n must be"):
        n_step_targets(z, z > 0, z > 0, 0.9, 0)
    with pytest.raises(ConfigError, match="n must be"):
        n_step_targets(z, z > 0, z > 0, 0.9, 2.5)
    # A NumPy integer (as read from arrays or configs) is accepted.
    _, _, offs = n_step_targets(z, z > 0, z > 0, 0.9, np.int64(2))
    np.testing.assert_array_equal(offs, [[2, 2], [2, 2], [2, 2], [1, 1]])


# ---------------------------------------------------------------------------------------------
# support_edge_mass: target probability clipped onto the edge atoms


@pytest.mark.parametrize("k", [11, 51])
def test_edge_mass_matches_float64_reference(rng, k):
    """Fresh random distributions, returns from well inside to far outside the support."""
    m = 256
    lo, hi = sorted(rng.uniform(-60.0, 60.0, size=2))
    hi += 1.0
    probs = np_softmax(rng.normal(size=(m, k)) * 2)
    returns = rng.normal(size=m) * (hi - lo) / 3
    discounts = rng.choice([0.0, 0.9, 0.99, 1.0], size=m)
    args = (probs.astype(np.float32), returns.astype(np.float32), discounts.astype(np.float32),
            support(lo, hi, k))
    got = jax.jit(clipped_edge_mass)(*args)
    ref = np_edge_mass(probs, returns, discounts, np.linspace(lo, hi, k))
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=1e-6)
    assert 0.0 < ref.mean() < 1.0  # the draw clips some mass and not all of it


def test_edge_mass_of_the_loss_and_its_extremes(rng):
    """The loss's edge mass is the branch mean of each branch's; returns far outside clip all
    the mass, a return that lands every atom inside none, and a constant reward's fixed point
    (a value on the edge) none."""
    m, k, branches = 64, 11, (5, 3, 3)
    z = support(-10.0, 10.0, k)
    taken = tuple(jnp.asarray(rng.normal(size=(m, k)), jnp.float32) for _ in branches)
    target = tuple(jnp.asarray(rng.normal(size=(m, k)), jnp.float32) for _ in branches)
    returns = jnp.asarray(rng.normal(size=m) * 5, jnp.float32)
    discounts = jnp.full((m,), 0.9, jnp.float32)
    loss, edge = jax.jit(c51_loss_and_edge_mass)(taken, target, returns, discounts, z)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(c51_loss(taken, target, returns,
                                                                     discounts, z)), rtol=1e-6)
    ref = np.mean([np_edge_mass(np_softmax(t), returns, discounts, np.linspace(-10, 10, k))
                   for t in target], axis=0)
    np.testing.assert_allclose(np.asarray(edge, np.float64), ref, atol=1e-6)
    probs = jnp.asarray(np_softmax(rng.normal(size=(m, k))), jnp.float32)
    ones = jnp.ones((m,), jnp.float32)
    for r, d, want in ((500.0, 0.99, 1.0), (-500.0, 0.99, 1.0), (0.0, 0.5, 0.0),
                       (-1.0, 0.9, 0.0)):  # -1 + 0.9 * -10 = -10: on the edge
        got = clipped_edge_mass(probs, r * ones, d * ones, z)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, err_msg=str((r, d)))
