"""Initial priorities reuse the rollout's forward (training/collect.py) and still equal the
learner's own loss.

``collect`` takes the online logits of each taken action and, where an episode goes on, the
greedy action at the next observation from the rollout, and runs a forward only for the rest
(:func:`foxhunt_jax.training.collect.next_greedy`). Against the reference, the learner's
:func:`~foxhunt_jax.agent.learner.per_sample_loss` with its three forwards over the decoded
replay items, on short episodes (truncations inside the window), ruin (terminations), n-step
returns and a gather capacity small enough to take several rounds.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent.learner import init_agent, make_learner, per_sample_loss
from foxhunt_jax.agent.network import q_forward
from foxhunt_jax.config import load_config
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.env import trading
from foxhunt_jax.training import collect
from foxhunt_jax.training.trainer import TRADING_ADAPTER

SMALL = ["network.trunk=[32]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
         "curiosity.embed=4", "network.backend=xla"]


@pytest.fixture(scope="module")
def tables():
    return build_tables(load_market(["builtin:us_stocks_daily"]), episode_length=100)


@pytest.mark.parametrize("n_step, per_episode, overrides", [
    (1, 2, []),
    (3, 1, ["env.ruin_floor=0.985", "env.cost_bps=20"]),  # ruin ends some episodes early
])
def test_initial_priorities_equal_the_learners_loss(tables, monkeypatch, n_step, per_episode,
                                                    overrides):
    # episodes of 4 steps in a window of 10: truncations at steps 3 and 7, then the last step,
    # 3N next observations to forward, 2 or 3 rounds of the gather
    monkeypatch.setattr(collect, "NEXT_FORWARD_PER_EPISODE", per_episode)
    cfg = load_config("smoke", SMALL + ["env.episode_length=4", f"train.n_step={n_step}"]
                      + overrides)
    params = trading.make_params(tables, cfg.env, "train")
    learner = make_learner(cfg, cfg.env.branch_sizes)
    seed = int(np.random.default_rng().integers(1 << 30))
    agent = init_agent(jax.random.key(seed), learner, trading.obs_dim(params))
    # distinct online and target networks, and greedy actions that differ between rows
    agent = agent.replace(params=jax.tree.map(lambda x: 3.0 * x, agent.params))
    n, steps = 12, 10
    key = jax.random.key(seed + 1)
    rollout = collect.start(TRADING_ADAPTER, params, key, n)

    def run(r, k):
        _, traj = collect.trajectory(learner, TRADING_ADAPTER, params, agent.params, r, k,
                                     jnp.float32(0.3), steps)
        _, items, prio, _, _ = collect.collect(learner, TRADING_ADAPTER, params, agent, r, k,
                                               jnp.float32(0.3), steps)
        return traj, collect.next_greedy(learner, TRADING_ADAPTER, params, agent.params,
                                         traj), items, prio

    traj, greedy, items, prio = jax.jit(run)(rollout, key)
    chex.assert_shape(greedy, (steps, n, len(cfg.env.branch_sizes)))
    assert int(jnp.sum(traj["truncated"][:-1])) >= n  # truncations inside the window
    # the greedy actions at every next observation, by a forward over all of them
    next_obs = TRADING_ADAPTER.decode(jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]),
                                                   traj["next_obs"]), params)
    _, full = q_forward(agent.params, next_obs, learner.network, learner.support)
    live = ~np.asarray(traj["terminated"]).reshape(-1)  # a terminated step's does not count
    np.testing.assert_array_equal(np.asarray(greedy).reshape(full.shape)[live],
                                  np.asarray(full)[live])
    if overrides:
        assert not live.all()  # the ruin case did terminate episodes
    ref = per_sample_loss(learner, agent.params, agent.target_params,
                          TRADING_ADAPTER.decode(items["obs"], params),
                          TRADING_ADAPTER.decode(items["next_obs"], params), items["action"],
                          items["reward"], items["discount"])
    chex.assert_shape(prio, (steps * n,))
    np.testing.assert_allclose(prio, ref, rtol=2e-5, atol=1e-6)
