"""The foxhunt-jax agent on environments nobody here wrote: gymnax CartPole-v1 (the default)
and MountainCar-v0.

The same QNetwork (one branch of the env's actions), C51 double-Q loss, prioritized replay,
collector and learner step as the trading agent; only the env adapter differs. The C51 support
is ``network.support: auto``: the per-step rewards of a short random-policy rollout give
``[v_min, v_max]`` (:func:`observed_support`). The whole run is one jitted ``lax.scan`` over
iterations (collect -> add to replay -> K learner steps), then 100 greedy episodes are scored.
Ends by printing one line:

    mean_return=<float> env_steps=<int> seconds=<float> support=[<v_min>, <v_max>] edge_mass=<float>

(``seconds``: wall time of the jitted run, compilation included; ``edge_mass``: the learner's
``support_edge_mass`` over the last tenth of the iterations; above 5% a warning line comes
first.)

Usage: python scripts/cartpole.py [--env CartPole-v1|MountainCar-v0] [--iterations N] [--seed S]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import gymnax
import jax
import jax.numpy as jnp

from foxhunt_jax.agent import replay
from foxhunt_jax.agent.learner import init_agent, make_learner, train_steps
from foxhunt_jax.agent.network import greedy_actions
from foxhunt_jax.agent.value_range import discounted_range, edge_mass_warning, with_range
from foxhunt_jax.backend import resolve
from foxhunt_jax.config import load_config
from foxhunt_jax.training.collect import EnvAdapter, collect, start

ENV, ENV_PARAMS = gymnax.make("CartPole-v1")

# Hyper-parameters of the full run (docs/agent.md quotes its result); --iterations shortens it.
# gamma 0.98 (horizon ~50 steps: CartPole's returns reach 50, which auto's support [0, 50]
# holds exactly) with 21 atoms; a fast
# learner (lr 1e-3) with a fast Polyak target (tau 0.1); the replay keeps the last 131,072 of the
# full run's 160,000 transitions, so early failures are not forgotten once the pole stays up.
OVERRIDES = [
    "network.trunk=[128, 128]", "network.head=64", "network.atoms=21",
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


def _at_goal(state, params):
    return (state.position >= params.goal_position) & (state.velocity >= params.goal_velocity)


@dataclass(frozen=True)
class Task:
    """A gymnax env and the rule that tells termination (no bootstrap) from the time limit."""

    env: object
    params: object
    terminated: Callable  # (state after the step, params) -> bool []
    obs_dim: int
    actions: int

    @property
    def max_steps(self) -> int:
        return int(self.params.max_steps_in_episode)

    def reset(self, key, params):
        return self.env.reset_env(key, params)

    def step_env(self, key, state, action, params):
        # Both flags come from the state: gymnax 1.0's step_env leaves the time limit to its
        # ``step`` wrapper, and that limit must truncate.
        obs, state2, reward, _, info = self.env.step_env(key, state, action[0], params)
        terminated = self.terminated(state2, params)
        truncated = (state2.time >= params.max_steps_in_episode) & ~terminated
        return obs, state2, jnp.asarray(reward, jnp.float32), terminated, truncated, info

    @property
    def adapter(self) -> EnvAdapter:
        return EnvAdapter(reset=self.reset, step_env=self.step_env,
                          encode=lambda obs, state: obs, decode=lambda enc, params: enc,
                          max_episode_steps=lambda params: self.max_steps)


def _task(name: str, terminated: Callable, obs_dim: int, actions: int) -> Task:
    env, params = (ENV, ENV_PARAMS) if name == "CartPole-v1" else gymnax.make(name)
    return Task(env, params, terminated, obs_dim, actions)


TASKS = {"CartPole-v1": _task("CartPole-v1", _failed, 4, 2),
         "MountainCar-v0": _task("MountainCar-v0", _at_goal, 2, 3)}
CARTPOLE = TASKS["CartPole-v1"]
_reset, _step_env, ADAPTER = CARTPOLE.reset, CARTPOLE.step_env, CARTPOLE.adapter
RANDOM_ROLLOUT_ENVS, RANDOM_ROLLOUT_STEPS = 16, 1000


def observed_rewards(task: Task, key, envs: int = RANDOM_ROLLOUT_ENVS,
                     steps: int = RANDOM_ROLLOUT_STEPS) -> jax.Array:
    """``[steps, envs]`` per-step rewards of a uniformly random policy, episodes restarting
    when they end."""
    reset_v = jax.vmap(task.reset, in_axes=(0, None))
    step_v = jax.vmap(task.step_env, in_axes=(0, 0, 0, None))
    k_reset, k_run = jax.random.split(key)
    obs, state = reset_v(jax.random.split(k_reset, envs), task.params)

    def body(state, k):
        k_act, k_step, k_new = jax.random.split(k, 3)
        action = jax.random.randint(k_act, (envs, 1), 0, task.actions, jnp.int32)
        _, state2, reward, term, trunc, _ = step_v(jax.random.split(k_step, envs), state, action,
                                                   task.params)
        _, fresh = reset_v(jax.random.split(k_new, envs), task.params)
        done = term | trunc
        state2 = jax.tree.map(lambda a, b: jnp.where(done.reshape((-1,) + (1,) * (a.ndim - 1)),
                                                     a, b), fresh, state2)
        return state2, reward

    return jax.lax.scan(body, state, jax.random.split(k_run, steps))[1]


def observed_support(task: Task, gamma: float, key) -> tuple[float, float]:
    """``network.support: auto`` for a gymnax task: :func:`~foxhunt_jax.agent.value_range.
    discounted_range` of the smallest and largest reward of :func:`observed_rewards` over an
    unbounded horizon (truncation at the step limit bootstraps). A reward the random policy
    never meets (a goal it never reaches) is not in the range."""
    rewards = jax.device_get(jax.jit(lambda k: observed_rewards(task, k))(key))
    return discounted_range(float(rewards.min()), float(rewards.max()), gamma)


def greedy_score(learner, params, key, episodes: int = 100, task: Task = CARTPOLE) -> jax.Array:
    """Mean undiscounted return of ``episodes`` greedy episodes (each up to the step limit)."""
    reset_v = jax.vmap(task.reset, in_axes=(0, None))
    step_v = jax.vmap(task.step_env, in_axes=(0, 0, 0, None))
    obs, state = reset_v(jax.random.split(key, episodes), task.params)

    def body(carry, k):
        obs, state, alive, total = carry
        action = greedy_actions(learner.network.apply(params, obs), learner.support)
        obs, state, r, term, trunc, _ = step_v(jax.random.split(k, episodes), state, action,
                                              task.params)
        total = total + jnp.where(alive, r, 0.0)
        return (obs, state, alive & ~(term | trunc), total), None

    init = (obs, state, jnp.ones(episodes, bool), jnp.zeros(episodes))
    (_, _, _, total), _ = jax.lax.scan(body, init, jax.random.split(key, task.max_steps))
    return jnp.mean(total)


def run(iterations: int = ITERATIONS, seed: int = 0, env: str = "CartPole-v1",
        overrides: tuple[str, ...] = ()) -> dict:
    """Trains on ``env`` for ``iterations`` and scores 100 greedy episodes.

    ``overrides``: config settings after the script's own (``network.support=explicit`` with
    ``network.v_min``/``network.v_max`` replaces the derived support). Returns
    ``{"mean_return", "env_steps", "seconds", "support": (v_min, v_max), "edge_mass"}``; the
    seconds are the wall time of the jitted run, compilation included; ``edge_mass`` is the
    learner's ``support_edge_mass`` averaged over the last tenth of the iterations.
    """
    task = TASKS[env]
    decay = max(int(iterations * EPSILON_DECAY_FRACTION), 1)
    cfg = load_config(None, OVERRIDES + [f"train.seed={seed}", f"train.epochs={iterations}",
                                         f"train.epsilon_decay_epochs={decay}", *overrides])
    key = jax.random.PRNGKey(seed)
    k_agent, k_env, k_run, k_eval = jax.random.split(key, 4)
    if cfg.network.support == "auto":
        cfg = with_range(cfg, *observed_support(task, cfg.train.gamma,
                                                jax.random.fold_in(key, 1)))
    backend = resolve(cfg.network)
    learner = make_learner(cfg, (task.actions,), replay_search=backend.tuning.replay)
    agent = init_agent(k_agent, learner, task.obs_dim)
    adapter = task.adapter
    rollout = start(adapter, task.params, k_env, NUM_ENVS)
    example = {"obs": jnp.zeros(task.obs_dim), "next_obs": jnp.zeros(task.obs_dim),
               "action": jnp.zeros(1, jnp.int32), "reward": jnp.zeros(()),
               "discount": jnp.zeros(())}
    buffer = replay.init(example, cfg.replay.capacity)
    decode = lambda items: (items["obs"], items["next_obs"])
    t = cfg.train

    def iteration(carry, xs):
        agent, buffer, rollout = carry
        i, k = xs
        k_col, k_learn = jax.random.split(k)
        frac = jnp.clip(i / t.epsilon_decay_epochs, 0.0, 1.0)
        eps = t.epsilon_start + frac * (t.epsilon_end - t.epsilon_start)
        rollout, items, prio, _, _ = collect(learner, backend, adapter, task.params, agent,
                                             rollout, k_col, eps, STEPS_PER_ITER)
        buffer = replay.add(buffer, items, prio, cfg.replay.alpha, cfg.replay.priority_eps)
        r = cfg.replay
        beta = r.beta_start + (i / iterations) * (r.beta_end - r.beta_start)

        def learn(ab):
            agent, buffer, metrics = train_steps(learner, decode, *ab, k_learn, beta,
                                                 LEARN_STEPS_PER_ITER)
            return agent, buffer, metrics["support_edge_mass"]

        agent, buffer, edge = jax.lax.cond(i >= WARMUP_ITERS, learn,
                                           lambda ab: (*ab, jnp.float32(jnp.nan)),
                                           (agent, buffer))
        return (agent, buffer, rollout), edge

    # The keys are arguments, not captured constants, so every seed compiles to the same program
    # (and the persistent compilation cache, when enabled, serves them all).
    @jax.jit
    def train_all(agent, buffer, rollout, key, k_eval):
        xs = (jnp.arange(iterations), jax.random.split(key, iterations))
        (agent, _, _), edge = jax.lax.scan(iteration, (agent, buffer, rollout), xs)
        return agent, greedy_score(learner, agent.params, k_eval, task=task), edge

    t0 = time.perf_counter()  # compilation included: this is the wall time of the whole run
    agent, score, edge = jax.block_until_ready(train_all(agent, buffer, rollout, k_run, k_eval))
    seconds = time.perf_counter() - t0
    last = jax.device_get(edge)[-max(iterations // 10, 1):]
    return {"mean_return": float(score), "env_steps": iterations * NUM_ENVS * STEPS_PER_ITER,
            "seconds": seconds, "support": (cfg.network.v_min, cfg.network.v_max),
            "edge_mass": float(last.mean()) if iterations > WARMUP_ITERS else float("nan")}


def format_result(result: dict) -> str:
    """The script's one output line from :func:`run`'s result."""
    v_min, v_max = result["support"]
    return (f"mean_return={result['mean_return']:.2f} env_steps={result['env_steps']} "
            f"seconds={result['seconds']:.1f} support=[{v_min:g}, {v_max:g}] "
            f"edge_mass={result['edge_mass']:.4f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=sorted(TASKS), default="CartPole-v1")
    ap.add_argument("--iterations", type=int, default=ITERATIONS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.iterations < 1:
        ap.error(f"--iterations must be >= 1, got {a.iterations}")
    result = run(a.iterations, a.seed, a.env)
    warning = edge_mass_warning(a.iterations, result["edge_mass"], *result["support"])
    if warning:
        print(warning.replace("epoch", "iteration", 1))
    print(format_result(result))


if __name__ == "__main__":
    main()
