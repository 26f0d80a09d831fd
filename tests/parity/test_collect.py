"""Initial priorities reuse the rollout's forward (training/collect.py) and still equal the
learner's own loss.

``collect`` takes the online logits of each taken action and, where an episode goes on, the
greedy action at the next observation from the rollout, and runs a forward only for the rest
(:func:`foxhunt_jax.training.collect.next_greedy`). Against the reference, the learner's
:func:`~foxhunt_jax.agent.learner.per_sample_loss` with its three forwards over the decoded
replay items, on short episodes (as many truncations inside the window as it can hold), ruin
(terminations), n-step returns and an env that does not say when it truncates.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax import backend as backends
from foxhunt_jax.agent.learner import init_agent, make_learner, per_sample_loss
from foxhunt_jax.agent.loss import n_step_targets
from foxhunt_jax.agent.network import q_forward
from foxhunt_jax.config import load_config
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.env import trading
from foxhunt_jax.training import collect, validate
from foxhunt_jax.training.trainer import TRADING_ADAPTER
from pallas_kernels import tuning

SMALL = ["network.trunk=[32]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
         "curiosity.embed=4", "network.backend=xla"]
XLA = backends.make("xla", tuning.for_device())


@pytest.fixture(scope="module")
def tables():
    return build_tables(load_market(["builtin:us_stocks_daily"]), episode_length=100)


@pytest.mark.parametrize("n_step, limit, overrides", [
    (1, True, []),
    (3, True, ["env.ruin_floor=0.985", "env.cost_bps=20"]),  # ruin ends some episodes early
    (1, False, []),  # an env that does not say when it truncates: every row is gathered
])
def test_initial_priorities_equal_the_learners_loss(tables, n_step, limit, overrides):
    # episodes of 4 steps in windows of 9: truncations at steps 3 and 7 of the first window,
    # as many as its first 8 steps can hold (the gather's size); the second window starts
    # mid-episode
    adapter = TRADING_ADAPTER if limit else dataclasses.replace(TRADING_ADAPTER,
                                                                max_episode_steps=None)
    cfg = load_config("smoke", SMALL + ["env.episode_length=4", f"train.n_step={n_step}"]
                      + overrides)
    params = trading.make_params(tables, cfg.env, "train")
    learner = make_learner(cfg, cfg.env.branch_sizes)
    seed = int(np.random.default_rng().integers(1 << 30))
    agent = init_agent(jax.random.key(seed), learner, trading.obs_dim(params))
    # distinct online and target networks, and greedy actions that differ between rows
    agent = agent.replace(params=jax.tree.map(lambda x: 1.5 * x, agent.params))
    n, steps = 12, 9
    key = jax.random.key(seed + 1)
    rollout = collect.start(adapter, params, key, n)

    @jax.jit  # the fresh agent is an argument, not a constant: the program hits the cache
    def run(agent, r, k):
        _, traj = collect.trajectory(learner, XLA, adapter, params, agent.params, r, k,
                                     jnp.float32(0.3), steps)
        r2, items, prio, _, _ = collect.collect(learner, XLA, adapter, params, agent, r, k,
                                                jnp.float32(0.3), steps)
        return r2, traj, collect.next_greedy(learner, XLA, adapter, params, agent.params,
                                             traj), items, prio

    for window in range(2):
        rollout, traj, greedy, items, prio = run(agent, rollout, jax.random.fold_in(key, window))
        chex.assert_shape(greedy, (steps, n, len(cfg.env.branch_sizes)))
        if window == 0:
            assert int(jnp.sum(traj["truncated"][:-1])) >= n // 2  # inside the window
        # the greedy actions at every next observation, by a forward over all of them; where
        # two actions' expected Q tie (saturated values), the two forwards of different row
        # counts may break the tie differently, so those rows are left out
        next_obs = adapter.decode(jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]),
                                               traj["next_obs"]), params)
        q, full = q_forward(agent.params, next_obs, learner.network, learner.support,
                            with_q=True)
        tie = np.zeros(full.shape[0], bool)
        for q_d in q:
            top = np.sort(np.asarray(q_d, np.float64), axis=1)[:, -2:]
            tie |= top[:, 1] - top[:, 0] <= 1e-5 * np.max(np.abs(top))
        assert tie.mean() < 0.1
        live = ~np.asarray(traj["terminated"]).reshape(-1) & ~tie  # a terminated step's
        np.testing.assert_array_equal(np.asarray(greedy).reshape(full.shape)[live],
                                      np.asarray(full)[live])
        if overrides and window == 1:
            assert np.asarray(traj["terminated"]).any()  # the ruin case did end episodes
        ref = per_sample_loss(learner, agent.params, agent.target_params,
                              adapter.decode(items["obs"], params),
                              adapter.decode(items["next_obs"], params), items["action"],
                              items["reward"], items["discount"])
        # each transition's bootstrap row (n-step), to leave out those that bootstrap at a tie
        _, _, offsets = n_step_targets(traj["reward"], traj["terminated"], traj["truncated"],
                                       cfg.train.gamma, n_step)
        boot = (np.arange(steps)[:, None] + np.asarray(offsets) - 1) * n + np.arange(n)
        keep = ~tie[boot.reshape(-1)]
        chex.assert_shape(prio, (steps * n,))
        np.testing.assert_allclose(np.asarray(prio)[keep], np.asarray(ref)[keep], rtol=2e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("episode_length, lengths", [
    (6, None),  # every window truncates at its last step
    (6, [6, 3, 5, 6, 1, 6, 2, 6]),  # windows of their own lengths
    (4, None),  # the env truncates from step 4 on: every later step too (no reset)
])
def test_validation_loss_equals_the_learners_loss(tables, episode_length, lengths):
    """validate.validation_loss takes the greedy actions at the bootstrap observations from
    the greedy rollout and forwards only at truncated steps: the weighted mean of the learner's
    per-sample loss over the same transitions, with ruin ending some windows early."""
    cfg = load_config("smoke", SMALL + [f"env.episode_length={episode_length}",
                                        "env.ruin_floor=0.99", "env.cost_bps=20",
                                        "train.n_step=2"])
    params = trading.make_params(tables, cfg.env, "validation")
    learner = make_learner(cfg, cfg.env.branch_sizes)
    seed = int(np.random.default_rng().integers(1 << 30))
    agent = init_agent(jax.random.key(seed), learner, trading.obs_dim(params))
    agent = agent.replace(params=jax.tree.map(lambda x: 1.5 * x, agent.params))
    starts = jnp.asarray(validate.window_starts(np.asarray(params.starts), 8))
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    traj = jax.jit(lambda p: validate.greedy_rollout(learner, XLA, p, params, starts, 6,
                                                     jax.random.key(0), lens))(agent.params)
    got = jax.jit(lambda a, tr: validate.validation_loss(learner, XLA, a.params,
                                                         a.target_params, params, tr))(agent,
                                                                                       traj)
    flat = lambda x: np.asarray(x).reshape((-1,) + np.shape(x)[2:])  # noqa: E731
    returns, discounts, offsets = n_step_targets(traj["reward"], traj["terminated"],
                                                 traj["truncated"] | ~traj["alive"],
                                                 cfg.train.gamma, 2)
    rows = np.arange(6)[:, None] + np.asarray(offsets) - 1
    nxt = {k: np.take_along_axis(np.asarray(traj[k]), rows.reshape(rows.shape + (1,) * (
        np.ndim(traj[k]) - 2)), axis=0) for k in ("next_bar", "next_portfolio")}
    obs = trading.decode({"bar": flat(traj["bar"]), "portfolio": flat(traj["portfolio"])},
                         params)
    next_obs = trading.decode({"bar": flat(nxt["next_bar"]),
                               "portfolio": flat(nxt["next_portfolio"])}, params)
    ref = per_sample_loss(learner, agent.params, agent.target_params, obs, next_obs,
                          flat(traj["action"]), flat(returns), flat(discounts))
    alive = flat(traj["alive"]).astype(np.float64)
    assert 0 < alive.mean() < 1 or lengths is None  # short windows are masked
    np.testing.assert_allclose(float(got), float(np.sum(np.asarray(ref) * alive) / alive.sum()),
                               rtol=2e-5)


def test_novelty_spans_route_each_pass_to_the_curiosity_kernel_or_xla(tables):
    """``collect.novelty`` under the pallas backend: a span of at least 1,024 rows runs the
    curiosity kernel, a smaller one XLA's true f32 pass; both give XLA's novelty."""
    pallas = backends.make("pallas", tuning.for_device())  # interpret mode off a CUDA GPU
    cfg = load_config("smoke", SMALL + ["env.episode_length=4", "curiosity.precision=bf16x3"])
    params = trading.make_params(tables, cfg.env, "train")
    learner = make_learner(cfg, cfg.env.branch_sizes)
    seed = int(np.random.default_rng().integers(1 << 30))
    agent = init_agent(jax.random.key(seed), learner, trading.obs_dim(params))
    n, steps = 256, 6
    key = jax.random.key(seed + 1)
    rollout = collect.start(TRADING_ADAPTER, params, key, n)
    _, traj = jax.jit(lambda p, r, k: collect.trajectory(learner, XLA, TRADING_ADAPTER, params,
                                                         p, r, k, jnp.float32(0.3),
                                                         steps))(agent.params, rollout, key)
    spans = collect.rollout_spans(pallas, TRADING_ADAPTER, n, steps)
    obs_dim = trading.obs_dim(params)
    kernels = ["pallas_call" in str(jax.make_jaxpr(lambda o: pallas.novelty(agent.rnd, o))(
        jax.ShapeDtypeStruct(((b - a) * n, obs_dim), jnp.float32))) for a, b in spans]
    assert kernels == [True, False]
    got, want = (jax.jit(lambda rnd, e, _b=b: collect.novelty(_b, TRADING_ADAPTER, params, rnd,
                                                              e, spans))(agent.rnd,
                                                                         traj["next_obs"])
                 for b in (pallas, XLA))
    chex.assert_shape(got, (steps, n))
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) < 1e-4 * scale
    # the XLA span is XLA's own pass, bit for bit
    np.testing.assert_array_equal(np.asarray(got[5:]), np.asarray(want[5:]))


def test_trajectory_observing_the_state_equals_carrying_the_observations(tables):
    """An adapter's ``observe`` (the observation as a function of the state, computed where
    the policy reads it) gives the same trajectory and end rollout, bit for bit, as carrying
    the stepped and reset observations and selecting between them, across resets."""
    cfg = load_config("smoke", SMALL + ["env.episode_length=3", "env.ruin_floor=0.985",
                                        "env.cost_bps=20"])
    params = trading.make_params(tables, cfg.env, "train")
    learner = make_learner(cfg, cfg.env.branch_sizes)
    seed = int(np.random.default_rng().integers(1 << 30))
    agent = init_agent(jax.random.key(seed), learner, trading.obs_dim(params))
    n, steps = 64, 8
    key = jax.random.key(seed + 1)
    carried = dataclasses.replace(TRADING_ADAPTER, observe=None)
    assert TRADING_ADAPTER.observe is not None
    rollout = collect.start(TRADING_ADAPTER, params, key, n)
    got, want = (jax.jit(lambda p, r, k, _a=a: collect.trajectory(
        learner, XLA, _a, params, p, r, k, jnp.float32(0.3), steps))(agent.params, rollout, key)
        for a in (TRADING_ADAPTER, carried))
    chex.assert_trees_all_equal(got, want)
    assert bool(jnp.any(want[1]["truncated"][:-1]))  # episodes restarted inside the window
    np.testing.assert_array_equal(  # the end rollout's observation is its state's
        got[0].obs, jax.vmap(trading.observation, in_axes=(0, None))(got[0].env_state, params))


@pytest.mark.parametrize("steps, n, per_column", [(9, 5, 2), (30, 7, 4), (6, 3, 6), (6, 3, 9)])
def test_first_true_rows_lists_each_column_s_first_trues(steps, n, per_column):
    """:func:`collect.first_true_rows` against a NumPy walk over each column: the j-th True
    of every column (j < per_column) at ``j * N + n``, ``L * N`` where a column holds fewer;
    the rows it lists are ``flatnonzero(mask)`` whenever no column holds more."""
    rng = np.random.default_rng()
    mask = np.zeros((steps, n), bool)
    for col in range(n):  # each column gets 0 .. per_column Trues (some exactly per_column)
        count = rng.integers(0, min(per_column, steps) + 1) if col else min(per_column, steps)
        mask[rng.choice(steps, size=count, replace=False), col] = True
    got = np.asarray(jax.jit(collect.first_true_rows, static_argnums=1)(jnp.asarray(mask),
                                                                        per_column))
    if per_column >= steps:
        want = np.where(mask.reshape(-1), np.arange(steps * n), steps * n)
    else:
        want = np.full((per_column, n), steps * n)
        for col in range(n):
            at = np.flatnonzero(mask[:, col])
            want[:len(at), col] = at * n + col
        want = want.reshape(-1)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32
    listed = got[got < steps * n]
    assert len(np.unique(listed)) == len(listed)
    np.testing.assert_array_equal(np.sort(listed), np.flatnonzero(mask.reshape(-1)))
