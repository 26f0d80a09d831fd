"""The foxhunt-jax agent on an environment nobody here wrote: gymnax CartPole-v1.

The same QNetwork (one branch of 2 actions), C51 double-Q loss, prioritized replay, collector
and learner step as the trading agent; only the env adapter differs. The whole run is one jitted
``lax.scan`` over iterations (collect -> add to replay -> K learner steps), then 100 greedy
episodes are scored. Ends by printing one line:

    mean_return=<float> env_steps=<int> seconds=<float>

(``seconds``: wall time of the jitted run, compilation included.)

Usage: python scripts/cartpole.py [--iterations N] [--seed S]
"""

from __future__ import annotations

import argparse
import time

import gymnax
import jax
import jax.numpy as jnp

from foxhunt_jax.agent import replay
from foxhunt_jax.agent.learner import init_agent, make_learner, train_steps
from foxhunt_jax.agent.network import greedy_actions
from foxhunt_jax.backend import resolve
from foxhunt_jax.config import load_config
from foxhunt_jax.training.collect import EnvAdapter, collect, start

ENV, ENV_PARAMS = gymnax.make("CartPole-v1")

# Hyper-parameters of the full run (docs/agent.md quotes its result); --iterations shortens it.
# gamma 0.98 (horizon ~50 steps, returns up to 50) with a [0, 50] support of 21 atoms; a fast
# learner (lr 1e-3) with a fast Polyak target (tau 0.1); the replay keeps the last 131,072 of the
# full run's 160,000 transitions, so early failures are not forgotten once the pole stays up.
OVERRIDES = [
    "network.trunk=[128, 128]", "network.head=64", "network.atoms=21",
    "network.support=explicit", "network.v_min=0", "network.v_max=50",
    "replay.capacity=131072", "replay.alpha=0.6", "replay.beta_start=0.4",
    "curiosity.coef=0",
    "train.learning_rate=1e-3", "train.batch_size=128", "train.gamma=0.98", "train.n_step=3",
    "train.target_update=polyak", "train.polyak_tau=0.1", "train.max_grad_norm=10",
    "train.epsilon_start=1.0", "train.epsilon_end=0.01",
]
NUM_ENVS, STEPS_PER_ITER, LEARN_STEPS_PER_ITER, WARMUP_ITERS = 16, 8, 4, 20
ITERATIONS = 1250
EPSILON_DECAY_FRACTION = 0.25  # epsilon reaches epsilon_end after this fraction of the iterations


def _failed(state, params):
    return ((state.x < -params.x_threshold) | (state.x > params.x_threshold)
            | (state.theta < -params.theta_threshold_radians)
            | (state.theta > params.theta_threshold_radians))


def _reset(key, params):
    return ENV.reset_env(key, params)


def _step_env(key, state, action, params):
    # Both flags come from the state: gymnax versions differ on whether step_env's ``done``
    # includes the 500-step limit (1.0 leaves it to ``step``), and that limit must truncate.
    obs, state2, reward, _, info = ENV.step_env(key, state, action[0], params)
    terminated = _failed(state2, params)  # the pole fell or the cart left the track
    truncated = (state2.time >= params.max_steps_in_episode) & ~terminated
    return obs, state2, reward, terminated, truncated, info


ADAPTER = EnvAdapter(reset=_reset, step_env=_step_env, encode=lambda obs, state: obs,
                     decode=lambda enc, params: enc,
                     max_episode_steps=lambda params: int(ENV_PARAMS.max_steps_in_episode))


def greedy_score(learner, params, key, episodes: int = 100) -> jax.Array:
    """Mean undiscounted return of ``episodes`` greedy episodes (each up to 500 steps)."""
    reset_v = jax.vmap(_reset, in_axes=(0, None))
    step_v = jax.vmap(_step_env, in_axes=(0, 0, 0, None))
    obs, state = reset_v(jax.random.split(key, episodes), ENV_PARAMS)

    def body(carry, k):
        obs, state, alive, total = carry
        action = greedy_actions(learner.network.apply(params, obs), learner.support)
        obs, state, r, term, trunc, _ = step_v(jax.random.split(k, episodes), state, action,
                                              ENV_PARAMS)
        total = total + jnp.where(alive, r, 0.0)
        return (obs, state, alive & ~(term | trunc), total), None

    init = (obs, state, jnp.ones(episodes, bool), jnp.zeros(episodes))
    (_, _, _, total), _ = jax.lax.scan(body, init, jax.random.split(key, 500))
    return jnp.mean(total)


def run(iterations: int = ITERATIONS, seed: int = 0) -> dict:
    """Trains for ``iterations`` and scores 100 greedy episodes.

    Returns ``{"mean_return": float, "env_steps": int, "seconds": float}``; the seconds are the
    wall time of the jitted run, compilation included.
    """
    decay = max(int(iterations * EPSILON_DECAY_FRACTION), 1)
    cfg = load_config(None, OVERRIDES + [f"train.seed={seed}", f"train.epochs={iterations}",
                                         f"train.epsilon_decay_epochs={decay}"])
    backend = resolve(cfg.network)
    learner = make_learner(cfg, (2,), replay_search=backend.tuning.replay)
    key = jax.random.PRNGKey(seed)
    k_agent, k_env, k_run, k_eval = jax.random.split(key, 4)
    agent = init_agent(k_agent, learner, 4)
    rollout = start(ADAPTER, ENV_PARAMS, k_env, NUM_ENVS)
    example = {"obs": jnp.zeros(4), "next_obs": jnp.zeros(4), "action": jnp.zeros(1, jnp.int32),
               "reward": jnp.zeros(()), "discount": jnp.zeros(())}
    buffer = replay.init(example, cfg.replay.capacity)
    decode = lambda items: (items["obs"], items["next_obs"])
    t = cfg.train

    def iteration(carry, xs):
        agent, buffer, rollout = carry
        i, k = xs
        k_col, k_learn = jax.random.split(k)
        frac = jnp.clip(i / t.epsilon_decay_epochs, 0.0, 1.0)
        eps = t.epsilon_start + frac * (t.epsilon_end - t.epsilon_start)
        rollout, items, prio, _, _ = collect(learner, backend, ADAPTER, ENV_PARAMS, agent,
                                             rollout, k_col, eps, STEPS_PER_ITER)
        buffer = replay.add(buffer, items, prio, cfg.replay.alpha, cfg.replay.priority_eps)
        r = cfg.replay
        beta = r.beta_start + (i / iterations) * (r.beta_end - r.beta_start)
        learn = lambda ab: train_steps(learner, decode, *ab, k_learn, beta,
                                       LEARN_STEPS_PER_ITER)[:2]
        agent, buffer = jax.lax.cond(i >= WARMUP_ITERS, learn, lambda ab: ab, (agent, buffer))
        return (agent, buffer, rollout), None

    # The keys are arguments, not captured constants, so every seed compiles to the same program
    # (and the persistent compilation cache, when enabled, serves them all).
    @jax.jit
    def train_all(agent, buffer, rollout, key, k_eval):
        xs = (jnp.arange(iterations), jax.random.split(key, iterations))
        (agent, _, _), _ = jax.lax.scan(iteration, (agent, buffer, rollout), xs)
        return agent, greedy_score(learner, agent.params, k_eval)

    t0 = time.perf_counter()  # compilation included: this is the wall time of the whole run
    agent, score = jax.block_until_ready(train_all(agent, buffer, rollout, k_run, k_eval))
    seconds = time.perf_counter() - t0
    return {"mean_return": float(score), "env_steps": iterations * NUM_ENVS * STEPS_PER_ITER,
            "seconds": seconds}


def format_result(result: dict) -> str:
    """The script's one output line from :func:`run`'s result."""
    return (f"mean_return={result['mean_return']:.2f} env_steps={result['env_steps']} "
            f"seconds={result['seconds']:.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=ITERATIONS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.iterations < 1:
        ap.error(f"--iterations must be >= 1, got {a.iterations}")
    print(format_result(run(a.iterations, a.seed)))


if __name__ == "__main__":
    main()
