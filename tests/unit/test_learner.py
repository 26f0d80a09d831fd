"""Learner step: the loss falls on a fixed batch; on a small deterministic MDP with known returns
the expected Q converges to the true values (within 2%); schedules and epsilon-greedy."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent import replay
from foxhunt_jax.agent.learner import (beta_at, beta_from, epsilon_at, epsilon_from,
                                       epsilon_greedy, init_agent, learner_step,
                                       schedule_values, make_learner, per_sample_loss,
                                       train_steps)
from foxhunt_jax.agent.network import expected_q
from foxhunt_jax.agent.value_range import (EDGE_MASS_WARNING, edge_mass_warning,
                                           holding_returns, resolve_trading, trading_range)
from foxhunt_jax.config import load_config
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.synthetic import make_synthetic
from foxhunt_jax.errors import ConfigError
from transitions import random_transitions

GAMMA = 0.9
N_STATES = 4


def chain_mdp():
    """States 0..3 (one-hot obs of width 5; index 4 is an unused absorbing marker).

    Action 0 (quit) pays 1 + 0.25 * s and terminates. Action 1 (go on) pays 0.5 and moves to
    s + 1; from the last state it pays 2 and terminates. Returns all 8 transitions and Q*.
    """
    obs, nxt, act, rew, disc = [], [], [], [], []
    eye = np.eye(5, dtype=np.float32)
    for s in range(N_STATES):
        obs.append(eye[s]); act.append(0); rew.append(1 + 0.25 * s); disc.append(0.0); nxt.append(eye[4])
        last = s == N_STATES - 1
        obs.append(eye[s]); act.append(1); rew.append(2.0 if last else 0.5)
        disc.append(0.0 if last else GAMMA); nxt.append(eye[4] if last else eye[s + 1])
    # Q* by backward induction in float64
    q = np.zeros((N_STATES, 2))
    for s in reversed(range(N_STATES)):
        q[s, 0] = 1 + 0.25 * s
        q[s, 1] = 2.0 if s == N_STATES - 1 else 0.5 + GAMMA * q[s + 1].max()
    items = {"obs": jnp.asarray(np.stack(obs)), "next_obs": jnp.asarray(np.stack(nxt)),
             "action": jnp.asarray(np.array(act, np.int32)[:, None]),
             "reward": jnp.asarray(np.array(rew, np.float32)),
             "discount": jnp.asarray(np.array(disc, np.float32))}
    return items, q


def _cfg(*extra):
    return load_config(None, ["network.trunk=[64]", "network.head=32", "network.atoms=21",
                              "network.support=explicit", "network.v_min=0", "network.v_max=5",
                              "curiosity.coef=0",
                              "replay.capacity=64", "replay.alpha=0", "train.batch_size=8",
                              f"train.gamma={GAMMA}", "train.learning_rate=3e-3",
                              "train.target_update=hard", "train.target_period=50", *extra])


def test_expected_q_converges_to_true_values_on_chain_mdp():
    items, q_true = chain_mdp()
    cfg = _cfg()
    learner = make_learner(cfg, (2,))
    agent = init_agent(jax.random.PRNGKey(1), learner, 5)
    buf = replay.add(replay.init(jax.tree.map(lambda x: x[0], items), 64), items)
    decode = lambda it: (it["obs"], it["next_obs"])
    run = jax.jit(lambda a, b, k: train_steps(learner, decode, a, b, k, jnp.float32(1.0), 1500))
    agent, buf, m = run(agent, buf, jax.random.PRNGKey(2))
    agent, buf, m = run(agent, buf, jax.random.PRNGKey(3))
    logits = learner.network.apply(agent.params, jnp.eye(5, dtype=jnp.float32)[:N_STATES])
    q = np.asarray(expected_q(logits[0], learner.support), np.float64)
    chex.assert_shape(q, (N_STATES, 2))
    rel = np.abs(q - q_true) / np.abs(q_true)
    assert rel.max() < 0.02, f"expected Q {q} vs true {q_true} (rel err {rel.max():.4f})"


def test_loss_falls_on_fixed_batch():
    cfg = _cfg("train.learning_rate=1e-3")
    learner = make_learner(cfg, (5, 3, 3))
    key = jax.random.PRNGKey(0)
    ks = jax.random.split(key, 6)
    m, d = 32, 12
    items = {"obs": jax.random.normal(ks[0], (m, d)), "next_obs": jax.random.normal(ks[1], (m, d)),
             "action": jnp.stack([jax.random.randint(k, (m,), 0, n) for k, n in
                                  zip(ks[2:5], (5, 3, 3))], -1).astype(jnp.int32),
             "reward": jax.random.uniform(ks[5], (m,), minval=-1, maxval=3),
             "discount": jnp.full((m,), 0.9)}
    agent = init_agent(jax.random.PRNGKey(4), learner, d)
    buf = replay.add(replay.init(jax.tree.map(lambda x: x[0], items), m), items)
    decode = lambda it: (it["obs"], it["next_obs"])

    def full_loss(a):
        return float(jnp.mean(per_sample_loss(learner, a.params, a.target_params, items["obs"],
                                              items["next_obs"], items["action"], items["reward"],
                                              items["discount"])))

    before = full_loss(agent)
    agent, buf, metrics = jax.jit(lambda a, b: train_steps(learner, decode, a, b,
                                                            jax.random.PRNGKey(5), 0.4, 200))(agent, buf)
    after = full_loss(agent)
    assert np.isfinite(after) and after < 0.7 * before, (before, after)
    assert int(agent.step) == 200
    assert set(metrics) >= {"loss", "grad_norm", "rnd_loss"}


@pytest.mark.parametrize("shards,dtype,target,copy", [(None, "float32", "hard", "select"),
                                                       (2, "float32", "hard", "select"),
                                                       (None, "bfloat16", "hard", "select"),
                                                       (None, "bfloat16", "hard", "conditional"),
                                                       (2, "bfloat16", "polyak", "select")])
def test_pipelined_train_steps_equal_sequential_learner_steps(shards, dtype, target, copy):
    """train_steps draws batch t + 1 after update t's priorities and beside its backward, and
    its forwards read the kernels' copies that each update writes (bfloat16): the same steps,
    keys and results as K learner_step calls in a row, whose forwards cast the parameters
    (plain and sharded buffers, prioritized, curiosity on, hard and Polyak targets, the hard
    copy as a select or a conditional, which moves the kernels' copies too)."""
    cfg = _cfg("replay.alpha=0.6", "curiosity.coef=0.1", "curiosity.hidden=8",
               "curiosity.embed=4", "train.target_period=2", f"network.dtype={dtype}",
               f"train.target_update={target}")
    learner = dataclasses.replace(make_learner(cfg, (3, 2)), target_copy=copy)
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    d, n, k = 6, 32, 3
    items = random_transitions(rng, n, d, (3, 2))
    raw = rng.gamma(1.0, 1.0, n).astype(np.float32)
    example = jax.tree.map(lambda x: x[0], items)
    if shards is None:
        buf = replay.add(replay.init(example, 64), items, raw, 0.6)
    else:
        split = lambda x: x.reshape((shards, n // shards) + x.shape[1:])  # noqa: E731
        buf = replay.add_shards(replay.init_shards(example, 64, shards),
                                jax.tree.map(split, items), split(raw), 0.6)
    agent = init_agent(jax.random.PRNGKey(0), learner, d)
    decode = lambda it: (it["obs"], it["next_obs"])  # noqa: E731
    key, beta = jax.random.PRNGKey(int(rng.integers(2**31))), jnp.float32(0.5)

    def sequential(a, b, key):
        ms = []
        for kk in jax.random.split(key, k):
            a, b, m = learner_step(learner, decode, a, b, kk, beta)
            ms.append(m)
        return a, b, jax.tree.map(lambda *x: jnp.mean(jnp.stack(x)), *ms)

    # the fresh key is an argument, not a constant, so the two programs hit the compile cache
    got = jax.jit(lambda a, b, kk: train_steps(learner, decode, a, b, kk, beta, k))(agent, buf,
                                                                                   key)
    want = jax.jit(sequential)(agent, buf, key)
    assert int(got[0].step) == k
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("target_copy", ["select", "conditional"])
def test_hard_target_copies_the_online_network_every_period_and_only_then(target_copy):
    """After step s the target network is the online network of the last step that is a
    multiple of ``target_period`` (the initial copy before any), bitwise, and unchanged between
    copies; vmapped members at different steps each copy at their own. Both forms of the
    copy."""
    period, k = 3, 8
    cfg = _cfg("train.target_period=3", "replay.alpha=0.6")
    learner = dataclasses.replace(make_learner(cfg, (3, 2)), target_copy=target_copy)
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    d, n = 6, 32
    items = random_transitions(rng, n, d, (3, 2))
    buf = replay.add(replay.init(jax.tree.map(lambda x: x[0], items), 64), items,
                     rng.gamma(1.0, 1.0, n).astype(np.float32), 0.6)
    agent = init_agent(jax.random.PRNGKey(int(rng.integers(2**31))), learner, d)
    decode = lambda it: (it["obs"], it["next_obs"])  # noqa: E731
    step = jax.jit(lambda a, b, kk: learner_step(learner, decode, a, b, kk, jnp.float32(0.5)))
    copied = agent.params
    for s, kk in enumerate(jax.random.split(jax.random.PRNGKey(int(rng.integers(2**31))), k), 1):
        before = agent.target_params
        agent, buf, _ = step(agent, buf, kk)
        assert int(agent.step) == s
        if s % period == 0:
            copied = agent.params
        else:
            chex.assert_trees_all_equal(agent.target_params, before)
        chex.assert_trees_all_equal(agent.target_params, copied)
    # vmapped members at different steps: each copies at its own step, as it would alone
    members = jax.tree.map(lambda x: jnp.stack([x, x * 0.5 if jnp.issubdtype(x.dtype, jnp.floating)
                                                else x]), agent)
    members = members.replace(step=members.step + jnp.array([0, 1], jnp.int32))
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    got = jax.jit(jax.vmap(lambda a, kk: step(a, buf, kk)[0]))(members, keys)
    copies = [int(s) % period == 0 for s in got.step]
    assert sorted(copies) == [False, True], got.step
    for i in range(2):
        alone = step(jax.tree.map(lambda x: x[i], members), buf, keys[i])[0]
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], got), alone, rtol=1e-6,
                                    atol=1e-7)
        member = jax.tree.map(lambda x: x[i], got)
        want = member.params if copies[i] else jax.tree.map(lambda x: x[i],
                                                            members.target_params)
        chex.assert_trees_all_equal(member.target_params, want)


def test_schedules():
    cfg = load_config(None, ["train.epochs=11", "train.epsilon_decay_epochs=10",
                             "train.epsilon_start=1.0", "train.epsilon_end=0.1",
                             "replay.beta_start=0.4", "replay.beta_end=1.0"])
    assert float(epsilon_at(cfg.train, 0)) == pytest.approx(1.0)
    assert float(epsilon_at(cfg.train, 5)) == pytest.approx(0.55)
    assert float(epsilon_at(cfg.train, 50)) == pytest.approx(0.1)
    assert float(beta_at(cfg.replay, cfg.train, 0)) == pytest.approx(0.4)
    assert float(beta_at(cfg.replay, cfg.train, 10)) == pytest.approx(1.0)
    # the phase programs compute both on the device from schedule_values and the epoch counter
    sched = jnp.asarray(schedule_values(cfg.replay, cfg.train))
    on_device = jax.jit(lambda s, e: (epsilon_from(s, e), beta_from(s, e)))
    for epoch in (0, 3, 5, 10, 11, 50):
        eps, beta = on_device(sched, jnp.int32(epoch))
        chex.assert_type([eps, beta], jnp.float32)
        assert float(eps) == pytest.approx(epsilon_at(cfg.train, epoch), rel=1e-6)
        assert float(beta) == pytest.approx(beta_at(cfg.replay, cfg.train, epoch), rel=1e-6)


def test_epsilon_greedy_explores_at_rate():
    n, sizes = 20000, (5, 3)
    z = jnp.linspace(-1, 1, 11)
    # a network output whose greedy action is 2 in branch 0 and 1 in branch 1
    l0 = jnp.zeros((n, 5, 11)).at[:, 2, -1].set(10.0)
    l1 = jnp.zeros((n, 3, 11)).at[:, 1, -1].set(10.0)
    acts = np.asarray(epsilon_greedy(jax.random.PRNGKey(0), (l0, l1), z, 0.3))
    chex.assert_shape(acts, (n, 2))
    # P(not greedy) = eps * (n_d - 1) / n_d per branch
    for d, (g, size) in enumerate(zip((2, 1), sizes)):
        rate = np.mean(acts[:, d] != g)
        assert abs(rate - 0.3 * (size - 1) / size) < 0.015
    greedy = np.asarray(epsilon_greedy(jax.random.PRNGKey(1), (l0, l1), z, 0.0))
    assert (greedy == np.array([2, 1])).all()


def test_misconfigured_support_puts_the_targets_on_an_edge_and_warns():
    """Negative returns (the chain MDP's rewards made negative) on a [0, 5] support: the
    projection clips nearly all target probability onto the lowest atom, and the run's one
    warning line names the keys to change; the support auto would derive holds them."""
    items, _ = chain_mdp()
    items = dict(items, reward=-items["reward"])
    learner = make_learner(_cfg(), (2,))
    agent = init_agent(jax.random.PRNGKey(1), learner, 5)
    buf = replay.add(replay.init(jax.tree.map(lambda x: x[0], items), 64), items)
    decode = lambda it: (it["obs"], it["next_obs"])
    run = jax.jit(lambda a, b, k: train_steps(learner, decode, a, b, k, jnp.float32(1.0), 300))
    agent, buf, m = run(agent, buf, jax.random.PRNGKey(2))
    assert float(m["support_edge_mass"]) > 0.8  # the mean of the 300 steps, early ones too
    line = edge_mass_warning(7, float(m["support_edge_mass"]), 0.0, 5.0)
    assert line.startswith("warning: epoch 7:") and "network.support" in line
    assert "network.v_min" in line and "network.v_max" in line
    assert edge_mass_warning(7, EDGE_MASS_WARNING / 2, 0.0, 5.0) is None
    fitting = make_learner(_cfg("network.v_min=-5", "network.v_max=0"), (2,))
    agent = init_agent(jax.random.PRNGKey(1), fitting, 5)
    run = jax.jit(lambda a, b, k: train_steps(fitting, decode, a, b, k, jnp.float32(1.0), 300))
    assert float(run(agent, buf, jax.random.PRNGKey(2))[2]["support_edge_mass"]) < 0.01


def test_support_keys_are_validated():
    assert load_config(None).network.support == "auto"
    with pytest.raises(ConfigError, match="network.support"):
        load_config(None, ["network.support=wide"])
    with pytest.raises(ConfigError, match="used only with network.support=explicit"):
        load_config(None, ["network.v_min=-50"])
    cfg = load_config(None, ["network.support=explicit", "network.v_min=-50", "network.v_max=0"])
    assert (cfg.network.v_min, cfg.network.v_max) == (-50.0, 0.0)


def test_trading_support_from_training_bars_only():
    """auto on the trading env: float64 brute-force holding returns; the test and validation
    bars do not move it (no look-ahead); explicit is kept; the result is recorded as
    explicit."""
    cfg = load_config("synthetic", ["network.support=auto", "network.v_min=-10",
                                    "network.v_max=10", "data.synthetic.bars=300",
                                    "data.synthetic.instruments=2", "env.episode_length=20"])
    market = make_synthetic(cfg.data.synthetic)
    tables = build_tables(market, cfg.data.splits, cfg.env.episode_length)
    gamma = cfg.train.gamma
    sums = holding_returns(tables, gamma)
    want = []
    for first, last in tables.segments["train"]:
        x = np.diff(np.log(np.asarray(tables.close[first:last + 1], np.float64)))
        want += [sum(gamma ** k * x[t + k] for k in range(len(x) - t)) for t in range(len(x))]
    np.testing.assert_allclose(sums, want, rtol=1e-9, atol=1e-12)
    lo, hi = trading_range(tables, cfg.env, gamma)
    assert lo < 100 * min(-np.max(sums), np.min(sums)) and hi > 100 * np.max(np.abs(sums))
    for split in ("validation", "test"):  # a wild later market
        for first, last in tables.segments[split]:
            tables.close[first:last + 1] *= np.exp(np.arange(last + 1 - first) * 0.3)
    assert trading_range(tables, cfg.env, gamma) == (lo, hi)
    resolved = resolve_trading(cfg, tables).network
    assert resolved.support == "explicit"
    assert resolved.v_min <= lo < hi <= resolved.v_max < hi + 0.01 * abs(hi)
    explicit = load_config("synthetic")
    assert resolve_trading(explicit, tables) is explicit
