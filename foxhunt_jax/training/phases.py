"""The epoch's phases as pure functions of (config, env params, state).

One epoch is :func:`experience` -> :func:`training` -> :func:`validation`;
:func:`validation_experience` is one epoch's Validation and the next epoch's Experience in one
function, with the same results as the two called one after the other. With ``train.overlap``
an epoch is :func:`overlapped` -> :func:`validation` instead: Training beside the next epoch's
collection, which acts with the agent from before that Training. Each function is jitted
as one program by :mod:`foxhunt_jax.training.pipeline`, which queues, pairs and times them;
nothing here waits, times or touches the host. The phases take the env's
:class:`~foxhunt_jax.training.collect.EnvAdapter` (default: the trading env's,
:data:`TRADING_ADAPTER`); a gymnax env's Validation is :func:`episode_validation`.

Shapes: ``S`` shards (``train.shards``), ``N`` episodes in flight (``train.num_episodes``), ``L``
steps an epoch (``env.episode_length``), ``C`` replay capacity, ``B`` action branches, ``W``
validation windows (``train.validation_windows``), ``K`` learner steps an epoch
(``train.train_steps``). The state's rollout and replay carry the shard axis; the agent, key and
epoch are replicated, so results depend on ``S`` and not on the device count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from foxhunt_jax.agent import replay
from foxhunt_jax.agent.learner import (AgentState, Learner, beta_from, epsilon_from, init_agent,
                                       train_steps)
from foxhunt_jax.backend import Backend
from foxhunt_jax.config import Config
from foxhunt_jax.env import trading
from foxhunt_jax.training import fused, validate
from foxhunt_jax.training.collect import EnvAdapter, Rollout, collect_shards, start_shards

# A transition stores the bar index and the 6 portfolio numbers, not the whole observation: the
# feature row is gathered again at sample time (docs/replay.md gives the bytes saved).
TRADING_ADAPTER = EnvAdapter(reset=trading.reset, step_env=trading.step_env,
                             encode=trading.encode, decode=trading.decode,
                             fused=fused.collect_trajectory,
                             max_episode_steps=lambda params: params.episode_length,
                             observe=trading.observation)


@struct.dataclass
class TrainerState:
    """Everything a checkpoint holds besides the config: resuming from it is exact."""

    agent: AgentState  # replicated: networks, optimizer, RND, learner step count
    buffer: replay.ReplayState  # sharded: leaves [S, C/S, ...]
    rollout: Rollout  # sharded: the episodes in flight, leaves [S, N/S, ...]
    key: jax.Array  # raw uint32 PRNG key data, so checkpoints store plain arrays
    epoch: jax.Array  # epochs completed, int32 []


def all_finite(tree) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is free of NaN and Inf: a bool ``[]``."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def observation_width(adapter: EnvAdapter, env_params) -> int:
    """D, the width of the env's observation (from the shapes of ``adapter.reset``)."""
    return jax.eval_shape(adapter.reset, jax.random.PRNGKey(0), env_params)[0].shape[-1]


def initial_agent(learner: Learner, train_env_params, key: jax.Array,
                  adapter: EnvAdapter = TRADING_ADAPTER) -> AgentState:
    """The agent of :func:`initial_state` by itself: online and target networks, optimizer and
    RND state, built from the first of ``split(key, 3)``."""
    return init_agent(jax.random.split(key, 3)[0], learner,
                      observation_width(adapter, train_env_params))


def initial_state(learner: Learner, cfg: Config, train_env_params, key: jax.Array,
                  agent: AgentState | None = None,
                  adapter: EnvAdapter = TRADING_ADAPTER) -> TrainerState:
    """The state before epoch 1: ``S`` shards of ``N/S`` fresh episodes, an empty replay ring
    of ``C/S`` items a shard, epoch 0. ``agent`` (default: :func:`initial_agent` of ``key``)
    may be built beforehand."""
    _, env_key, run_key = jax.random.split(key, 3)
    if agent is None:
        agent = initial_agent(learner, train_env_params, key, adapter)
    rollout = start_shards(adapter, train_env_params, env_key, cfg.train.shards,
                           cfg.train.num_episodes)
    # zeros of one replay encoding (adapter.encode of a reset's observation and state)
    encoded_obs = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
        lambda k: adapter.encode(*adapter.reset(k, train_env_params)), jax.random.PRNGKey(0)))
    example_item = {"obs": encoded_obs, "next_obs": encoded_obs,
                    "action": jnp.zeros((len(learner.network.branch_sizes),), jnp.int32),
                    "reward": jnp.zeros((), jnp.float32), "discount": jnp.zeros((), jnp.float32)}
    buffer = replay.init_shards(example_item, cfg.replay.capacity, cfg.train.shards)
    return TrainerState(agent=agent, buffer=buffer, rollout=rollout, key=run_key,
                        epoch=jnp.zeros((), jnp.int32))


def experience(learner: Learner, backend: Backend, cfg: Config, train_env_params,
               state: TrainerState, schedule: jax.Array, mesh=None,
               adapter: EnvAdapter = TRADING_ADAPTER) -> tuple[TrainerState, dict]:
    """L epsilon-greedy steps of the N episodes in flight, their transitions added to replay.

    ``schedule``: the ``[6]`` array of :func:`~foxhunt_jax.agent.learner.schedule_values`;
    epsilon follows ``state.epoch``. ``mesh``: where the shards live (with more than one device
    each collects its own, :func:`~foxhunt_jax.training.collect.collect_shards`).

    Returns ``(state, stats)``: the state with the episodes advanced, ``L*N/S`` transitions a
    shard in replay (priority: their C51 loss), the RND statistics updated and a new key;
    ``stats`` holds ``[]`` arrays: ``reward`` and ``bonus`` (means a step), ``episodes_done``,
    ``terminated`` and ``epsilon``. The epoch counter does not move.
    """
    epsilon = epsilon_from(schedule, state.epoch)
    key, collect_key = jax.random.split(state.key)
    rollout, items, priorities, rnd, stats = collect_shards(
        learner, backend, adapter, train_env_params, state.agent, state.rollout,
        collect_key, epsilon, cfg.env.episode_length, mesh)
    buffer = replay.add_shards(state.buffer, items, priorities, cfg.replay.alpha,
                               cfg.replay.priority_eps)
    agent = state.agent.replace(rnd=rnd)
    state = state.replace(agent=agent, buffer=buffer, rollout=rollout, key=key)
    return state, dict(stats, epsilon=epsilon)


def training(learner: Learner, cfg: Config, train_env_params, state: TrainerState,
             schedule: jax.Array, adapter: EnvAdapter = TRADING_ADAPTER
             ) -> tuple[TrainerState, dict]:
    """K prioritized learner steps (:func:`~foxhunt_jax.agent.learner.train_steps`), then the
    epoch counter moves on.

    ``schedule``: as in :func:`experience`; beta follows ``state.epoch``. Returns ``(state,
    metrics)``: the updated agent and replay priorities, a new key, ``epoch + 1``; ``metrics``
    holds ``[]`` arrays: the learner's means over the K steps (``loss``, ``grad_norm``,
    ``rnd_loss``, ``support_edge_mass``), ``finite_params`` and ``finite_opt_state`` (bool),
    ``beta`` and ``epoch`` (the new count).
    """
    beta = beta_from(schedule, state.epoch)
    key, sample_key = jax.random.split(state.key)

    def decode(items):
        return (adapter.decode(items["obs"], train_env_params),
                adapter.decode(items["next_obs"], train_env_params))

    agent, buffer, metrics = train_steps(learner, decode, state.agent, state.buffer, sample_key,
                                         beta, cfg.train.train_steps)
    epoch = state.epoch + 1
    metrics = dict(metrics, finite_params=all_finite(agent.params),
                   finite_opt_state=all_finite(agent.opt_state), beta=beta, epoch=epoch)
    return state.replace(agent=agent, buffer=buffer, key=key, epoch=epoch), metrics


def validation(learner: Learner, backend: Backend, cfg: Config, validation_env_params,
               window_starts: jax.Array, agent: AgentState) -> tuple[dict, jax.Array]:
    """Greedy rollouts of the W fixed validation windows (``window_starts`` ``[W]`` bars, L
    steps each) and the C51 loss on their transitions; changes no state.

    Returns ``(paths, loss)``: ``paths`` holds ``[L, W]`` arrays ``equity``, ``exposure``,
    ``traded``, ``fills`` and ``turnover``; ``loss`` is a float32 ``[]``.
    """
    traj = validate.greedy_rollout(learner, backend, agent.params, validation_env_params,
                                   window_starts, cfg.env.episode_length, jax.random.key(0))
    loss = validate.validation_loss(learner, backend, agent.params, agent.target_params,
                                    validation_env_params, traj)
    paths = {k: traj[k] for k in ("equity", "exposure", "traded", "fills", "turnover")}
    return paths, loss


def greedy_episodes(learner: Learner, backend: Backend, env_params, keys: jax.Array,
                    agent_params, adapter: EnvAdapter) -> dict:
    """``W`` greedy episodes of a gymnax env (:func:`~foxhunt_jax.training.collect.
    gymnax_adapter`), reset from ``keys [W]``, each run until it terminates or is truncated
    (at most ``adapter.max_episode_steps`` steps); ``backend.q_forward`` picks the actions.

    Returns ``[W]`` arrays: ``return`` (undiscounted, float32) and ``length`` (steps, int32).
    """
    w = keys.shape[0]
    obs, state = jax.vmap(adapter.reset, in_axes=(0, None))(keys, env_params)
    step_v = jax.vmap(adapter.step_env, in_axes=(0, 0, 0, None))

    def body(carry, k):
        obs, state, alive, total, length = carry
        action = backend.q_forward(agent_params, obs, learner.network, learner.support)[1]
        obs, state, reward, term, trunc, _ = step_v(jax.random.split(k, w), state, action,
                                                   env_params)
        total = total + jnp.where(alive, reward, 0.0)
        length = length + alive.astype(jnp.int32)
        return (obs, state, alive & ~(term | trunc), total, length), None

    init = (obs, state, jnp.ones(w, bool), jnp.zeros(w, jnp.float32), jnp.zeros(w, jnp.int32))
    steps = adapter.max_episode_steps(env_params)
    (*_, total, length), _ = jax.lax.scan(body, init, jax.random.split(keys[0], steps))
    return {"return": total, "length": length}


def episode_validation(learner: Learner, backend: Backend, cfg: Config, env_params,
                       keys: jax.Array, agent: AgentState, adapter: EnvAdapter
                       ) -> tuple[dict, jax.Array]:
    """A gymnax env's Validation, in :func:`validation`'s form: :func:`greedy_episodes` from
    the fixed reset keys ``keys [W]``; changes no state. Returns ``(episodes, loss)`` with
    ``loss`` NaN: no validation loss is computed for a gymnax env (``train.select_by`` is
    ``return``)."""
    del cfg
    episodes = greedy_episodes(learner, backend, env_params, keys, agent.params, adapter)
    return episodes, jnp.float32(jnp.nan)


def validation_experience(learner: Learner, backend: Backend, cfg: Config, validation_env_params,
                          window_starts: jax.Array, train_env_params, state: TrainerState,
                          schedule: jax.Array) -> tuple[dict, jax.Array, TrainerState, dict]:
    """:func:`validation` of ``state.agent`` and the next epoch's :func:`experience` as one
    function: ``(paths, loss, state, stats)``.

    Both read the agent that Training left and Validation changes no state, so the results equal
    the two called one after the other. In one program the two rollouts share no data, so a
    device may run them at once.
    """
    paths, loss = validation(learner, backend, cfg, validation_env_params, window_starts,
                             state.agent)
    return (paths, loss) + experience(learner, backend, cfg, train_env_params, state, schedule)


def overlapped(learner: Learner, backend: Backend, cfg: Config, train_env_params,
               state: TrainerState, schedule: jax.Array, mesh=None,
               adapter: EnvAdapter = TRADING_ADAPTER) -> tuple[TrainerState, dict, dict]:
    """Epoch ``e``'s :func:`training` and epoch ``e+1``'s :func:`experience` as one function
    (``train.overlap``): ``(state, stats, metrics)``.

    ``state``: an overlapped state of ``epoch = e - 1``, whose replay already holds epoch
    ``e``'s collection (docs/training.md, "Overlap"). In order:

    1. :func:`training` of ``state``: Training(e), the epoch counter moves to ``e``;
    2. :func:`experience` of that state with ``state.agent`` in place of the trained agent: epoch
       ``e+1``'s collection acts with the parameters from before Training(e) (one epoch
       stale), with epoch ``e+1``'s epsilon, and its transitions are added to replay after
       Training(e)'s priority updates;
    3. the trained agent, with the curiosity statistics the collection updated (Training
       changes the RND predictor and its optimizer, collection only the running statistics).

    The learner's steps and the rollout share no data until the add, so a device may run them
    at once; the results are fixed by the order above.
    """
    trained, metrics = training(learner, cfg, train_env_params, state, schedule, adapter)
    collected, stats = experience(learner, backend, cfg, train_env_params,
                                  trained.replace(agent=state.agent), schedule, mesh, adapter)
    agent = trained.agent
    if agent.rnd is not None:
        agent = agent.replace(rnd=collected.agent.rnd.replace(
            predictor_params=agent.rnd.predictor_params, opt_state=agent.rnd.opt_state))
    return collected.replace(agent=agent), stats, metrics
