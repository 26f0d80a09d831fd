"""Experience collection: ``lax.scan`` over L timesteps with N episodes batched.

Per timestep: Q-forward [N, D] -> per-branch epsilon-greedy actions [N, B] with per-step keys
-> env step (vmapped) -> auto-reset of finished episodes (:func:`trajectory`). After the scan,
the curiosity bonus of every next observation is computed in one batched pass (it depends only
on the observation and the fixed RND networks, not on the actions, so nothing in the loop waits
for it), n-step returns are formed over the [L, N] trajectory, each transition's initial
priority is its C51 double-Q loss under the current online and target networks (the learner's
own loss, so priorities and training agree), and the L * N transitions go into the replay
buffer. The rollout's forward already gave the online logits of each taken action and, for most
transitions, the greedy action at the bootstrap observation (:func:`next_greedy`), so the
priorities add one forward over the transitions, the target network's, instead of three. The
whole phase is one jitted call with no host round trip.

Every forward, the loss of the priorities and the novelty run on the
:class:`~foxhunt_jax.backend.Backend` the caller hands in. Where the backend has a rollout
kernel and the adapter provides ``fused`` (the trading env: :mod:`foxhunt_jax.training.fused`),
the scan is replaced by that kernel (in the launches of :func:`rollout_spans`, so that the
curiosity pass over the first one's steps runs beside the second), fed with the same per-step
random draws, so both give the same trajectory.

The collector is generic over the environment through :class:`EnvAdapter` (the trading env's,
``phases.TRADING_ADAPTER``, and any gymnax env's, :func:`gymnax_adapter`). Replay items are
``{"obs": enc, "next_obs": enc, "action", "reward", "discount"}`` where ``enc`` is the
adapter's encoding of an observation (the trading env's is compact; a gymnax env's is the
observation itself).
:func:`collect_shards` runs the collector on ``S`` shards of episodes at once
(:mod:`foxhunt_jax.parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from foxhunt_jax.agent import curiosity
from foxhunt_jax.agent.learner import AgentState, Learner
from foxhunt_jax.agent.loss import n_step_targets
from foxhunt_jax.agent.network import explore_draws
from foxhunt_jax.backend import Backend
from foxhunt_jax.env.gymnax_task import GymnaxTask
from foxhunt_jax.parallel import per_device, shard_keys
from pallas_kernels.rollout import launch_spans


@dataclass(frozen=True)
class EnvAdapter:
    """Single-episode env functions over explicit params; the collector vmaps them.

    reset(key, params) -> (obs [D], state)
    step_env(key, state, action [B], params) -> (obs, state, reward, terminated, truncated, info)
        (no auto-reset; obs/state are those after the step, before any reset)
    encode(obs [D], state) -> enc (what the replay buffer stores for an observation)
    decode(enc [M, ...], params) -> obs [M, D]
    fused (optional): a kernel form of :func:`trajectory`, ``fused(learner, backend,
        env_params, agent_params, rollout, keys [L, 3], epsilon, num_steps) -> (rollout,
        traj)`` with :func:`step_keys`' keys and :func:`trajectory`'s result, used where the
        backend runs rollout kernels (:meth:`~foxhunt_jax.backend.Backend.runs_rollout_kernel`)
    max_episode_steps (optional): ``(params) -> int``, static: the steps after which an episode
        is truncated, so that the initial priorities know how many truncations a window can
        hold (:func:`next_greedy`; without it, every step may be one)
    observe (optional): ``observe(state, params) -> obs [D]``, where an observation is a
        function of the state alone (the one ``reset`` and ``step_env`` return). :func:`trajectory`
        then computes each step's observation from the state where the policy reads it, once,
        instead of carrying the stepped and the reset observations and selecting between them;
        the same numbers.
    """

    reset: Callable
    step_env: Callable
    encode: Callable
    decode: Callable
    fused: Callable | None = None
    max_episode_steps: Callable | None = None
    observe: Callable | None = None

    def __hash__(self):
        return hash((self.reset, self.step_env, self.encode, self.decode, self.fused,
                     self.max_episode_steps, self.observe))


def _whole(obs: jax.Array, state) -> jax.Array:
    """A gymnax env's replay encoding: the observation itself."""
    del state
    return obs


def _unchanged(enc: jax.Array, params) -> jax.Array:
    del params
    return enc


def gymnax_adapter(task: GymnaxTask) -> EnvAdapter:
    """The adapter of a gymnax task (:mod:`foxhunt_jax.env.gymnax_task`): observations are
    stored whole in replay (no compact encoding), episodes are truncated at the task's step
    limit."""
    return EnvAdapter(reset=task.reset, step_env=task.step_env, encode=_whole, decode=_unchanged,
                      max_episode_steps=task.step_limit)


@jax.tree_util.register_dataclass
@dataclass
class Rollout:
    """The carried state of N parallel episodes between collection calls."""

    env_state: Any
    obs: jax.Array  # [N, D]


def start(adapter: EnvAdapter, env_params, key: jax.Array, num_episodes: int) -> Rollout:
    obs, state = jax.vmap(adapter.reset, in_axes=(0, None))(
        jax.random.split(key, num_episodes), env_params)
    return Rollout(env_state=state, obs=obs)


_CHUNK_ALIGN = 128  # rows: chunks stay whole blocks of the kernels' launch shapes


def chunked(fn: Callable, items: Any, most: int) -> Any:
    """``fn(items [M, ...]) -> [M, ...]`` (arrays or a pytree of them) evaluated at most
    ``most`` rows at a time (``lax.map``), in chunks of one size: the fewest that hold ``M``
    rows, each rounded up to a multiple of 128 rows (while that stays within ``most``).

    Rows are independent, so the result is ``fn(items)``; ``M <= most`` calls ``fn`` once.
    The last chunk is padded with copies of row 0 and the padding dropped.
    """
    m = jax.tree.leaves(items)[0].shape[0]
    if m <= most:
        return fn(items)
    ceil_div = lambda a, b: -(-a // b)  # noqa: E731
    chunk = min(most, ceil_div(ceil_div(m, ceil_div(m, most)), _CHUNK_ALIGN) * _CHUNK_ALIGN)
    k = ceil_div(m, chunk)
    pad = lambda x: jnp.concatenate([x, jnp.broadcast_to(x[:1], (k * chunk - m,) + x.shape[1:])])
    blocks = jax.tree.map(lambda x: pad(x).reshape((k, chunk) + x.shape[1:]), items)
    return jax.tree.map(lambda y: y.reshape((-1,) + y.shape[2:])[:m], jax.lax.map(fn, blocks))


def first_true_rows(mask: jax.Array, per_column: int) -> jax.Array:
    """Flat indices ``t * N + n`` of the first ``per_column`` True entries of each column of
    ``mask [L, N]`` bool: ``[min(per_column, L) * N]`` int32, the j-th True of every column
    before the (j+1)-th, and ``L * N`` (past the end) where a column holds fewer.

    The j-th True of a column lies at the number of its steps with at most j Trues up to and
    including them, so this is a count over ``L`` per (j, n), not a scatter (``jnp.nonzero``
    with a static size bins a running count with a scatter-add, whose adds collide on a GPU).
    From ``per_column >= L`` every True is taken, in place.
    """
    steps, n = mask.shape
    if per_column >= steps:
        return jnp.where(mask.reshape(-1), jnp.arange(steps * n, dtype=jnp.int32), steps * n)
    count = jnp.cumsum(mask, axis=0, dtype=jnp.int32)  # [L, N]: Trues up to and including t
    j = jnp.arange(per_column, dtype=jnp.int32)[:, None, None]
    at = jnp.sum(count[None] <= j, axis=1, dtype=jnp.int32)  # [per_column, N], L where none
    rows = at * n + jnp.arange(n, dtype=jnp.int32)
    return jnp.where(at < steps, rows, steps * n).reshape(-1)


def greedy_after(learner: Learner, backend: Backend, params, greedy: jax.Array, need: jax.Array,
                 next_obs, decode: Callable, per_column: int) -> jax.Array:
    """Greedy actions at each step's next observation from a rollout's own, ``[L, N, B]``.

    ``greedy [L, N, B]``: the greedy actions of the observations the rollout acted on;
    ``need [L, N]`` bool: the steps whose next observation is not the one acted on at t + 1
    (at most ``per_column`` of them in each of the N columns, a static bound); ``next_obs``:
    their encodings ``[L, N, ...]`` (a pytree), which ``decode(enc [M, ...]) -> obs [M, D]``
    rebuilds. Elsewhere the result is ``greedy[t + 1]``; at the ``need`` rows, the online
    forward of their next observation, gathered (:func:`first_true_rows`) into one batch of
    ``min(per_column, L) * N`` rows (``backend.q_forward``).
    """
    steps, n, b = greedy.shape
    flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
    idx = first_true_rows(need, per_column)  # past the end: clipped here, dropped below
    rows = jax.tree.map(lambda x: jnp.take(flat(x), idx, axis=0, mode="clip"), next_obs)

    def forward(e):
        return backend.q_forward(params, decode(e), learner.network, learner.support)[1]

    shifted = flat(jnp.concatenate([greedy[1:], greedy[-1:]]))
    found = chunked(forward, rows, backend.tuning.row_chunk)
    return shifted.at[idx].set(found, mode="drop").reshape(steps, n, b)


def next_greedy(learner: Learner, backend: Backend, adapter: EnvAdapter, env_params, params,
                traj) -> jax.Array:
    """The online network's greedy actions at each step's next observation, ``[L, N, B]``.

    Where an episode goes on, the next observation of step t is the one the rollout acted on
    at t + 1, so its greedy action is ``traj["greedy"][t + 1]`` and needs no forward. A forward
    runs only for the others (:func:`greedy_after`): the last step's next observations and
    those of truncated steps (before their reset). Truncations are at least
    ``adapter.max_episode_steps`` (T) steps apart, so the first L - 1 steps hold at most
    ``ceil((L - 1) / T)`` of them per episode, and the rows are gathered into a batch of that
    static size plus one, times N (the whole window when T is unknown). A terminated step keeps
    ``greedy[t + 1]`` (a reset observation's): its discount is 0, so its target distribution is
    its return's whatever the bootstrap logits.
    """
    steps = traj["greedy"].shape[0]
    limit = adapter.max_episode_steps(env_params) if adapter.max_episode_steps else 1
    per_episode = min(steps - 1, -(-(steps - 1) // limit))
    need = traj["truncated"].at[-1].set(True)
    return greedy_after(learner, backend, params, traj["greedy"], need, traj["next_obs"],
                        lambda e: adapter.decode(e, env_params), per_episode + 1)


def _where(mask, a, b):
    """Per-episode select between two pytrees with leading axis N."""
    return jax.tree.map(lambda x, y: jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, y), a, b)


def collect(learner: Learner, backend: Backend, adapter: EnvAdapter, env_params,
            agent: AgentState, rollout: Rollout, key: jax.Array, epsilon, num_steps: int):
    """Runs ``num_steps`` steps of every episode on ``backend``; returns (rollout, items [L*N],
    priorities, rnd, stats).

    ``stats`` holds the mean extrinsic and intrinsic reward per step and the number of finished
    episodes. Window end counts as truncation for the n-step targets (bootstrap from the next
    observation), which is exact: the episode simply continues in the next call. ``rnd`` is the
    curiosity state with this call's novelty folded into its running statistics.
    """
    rollout, items, priorities, novelty, stats = _collect(learner, backend, adapter, env_params,
                                                          agent, rollout, key, epsilon,
                                                          num_steps)
    rnd = agent.rnd
    if rnd is not None:
        rnd = curiosity.update_stats(rnd, novelty)
    return rollout, items, priorities, rnd, stats


def start_shards(adapter: EnvAdapter, env_params, key: jax.Array, shards: int,
                 num_episodes: int) -> Rollout:
    """``shards`` groups of ``num_episodes / shards`` episodes: leaves ``[S, N/S, ...]``.

    Shard ``s`` starts from ``fold_in(key, s)`` (:func:`foxhunt_jax.parallel.shard_keys`).
    """
    per = num_episodes // shards
    return jax.vmap(lambda k: start(adapter, env_params, k, per))(shard_keys(key, shards))


def collect_shards(learner: Learner, backend: Backend, adapter: EnvAdapter, env_params,
                   agent: AgentState, rollouts: Rollout, key: jax.Array, epsilon, num_steps: int,
                   mesh=None):
    """:func:`collect` on every shard of a sharded rollout ``[S, N/S, ...]``.

    Shard ``s`` draws from ``fold_in(key, s)``; all shards act with the same (replicated) agent.
    Returns (rollouts, items ``[S, L*N/S, ...]``, priorities ``[S, L*N/S]``, rnd, stats): the
    curiosity statistics take in the novelty of every shard at once, and ``stats`` are those of
    the whole ``[L, N]`` batch (means over shards of equal size, counts summed).

    ``mesh``: the device mesh the shards are placed on; with more than one device each device
    collects its own shards (:func:`foxhunt_jax.parallel.per_device`), the same numbers.
    """
    s = rollouts.obs.shape[0]
    run = jax.vmap(lambda r, k, a, p, e: _collect(learner, backend, adapter, p, a, r, k, e,
                                                  num_steps),
                   in_axes=(0, 0, None, None, None))
    if mesh is not None and mesh.size > 1:
        run = per_device(run, mesh, sharded=2, replicated=3)
    rollouts, items, priorities, novelty, stats = run(rollouts, shard_keys(key, s), agent,
                                                      env_params, epsilon)
    rnd = agent.rnd
    if rnd is not None:
        rnd = curiosity.update_stats(rnd, novelty.reshape(-1))
    stats = {"reward": jnp.mean(stats["reward"]), "bonus": jnp.mean(stats["bonus"]),
             "episodes_done": jnp.sum(stats["episodes_done"]),
             "terminated": jnp.sum(stats["terminated"])}
    return rollouts, items, priorities, rnd, stats


def step_keys(key: jax.Array, num_steps: int) -> jax.Array:
    """``[L, 3]`` keys: step t explores with ``[t, 0]``, steps the env with ``[t, 1]`` and draws
    its resets from ``[t, 2]`` (split over the N episodes)."""
    return jax.vmap(lambda k: jax.random.split(k, 3))(jax.random.split(key, num_steps))


def _kernel_rollout(backend: Backend, adapter: EnvAdapter, num_episodes: int) -> bool:
    """Whether :func:`trajectory` runs the adapter's kernel rollout instead of the scan."""
    return adapter.fused is not None and backend.runs_rollout_kernel(num_episodes)


def rollout_spans(backend: Backend, adapter: EnvAdapter, num_episodes: int,
                  num_steps: int) -> tuple[tuple[int, int], ...]:
    """The steps ``[start, stop)`` of each launch of :func:`trajectory`: the rollout kernel's
    launches (:func:`pallas_kernels.rollout.launch_spans`) where it runs one, else the whole
    window (one scan)."""
    if _kernel_rollout(backend, adapter, num_episodes):
        return launch_spans(num_steps)
    return ((0, num_steps),)


def trajectory(learner: Learner, backend: Backend, adapter: EnvAdapter, env_params, agent_params,
               rollout: Rollout, key: jax.Array, epsilon, num_steps: int):
    """``num_steps`` epsilon-greedy steps of every episode, with auto-reset, on ``backend``.

    Returns ``(rollout, traj)``; ``traj`` holds ``[L, N, ...]`` arrays: ``obs`` and ``next_obs``
    (the adapter's encodings of the observation acted on and of the one after the step, before
    any reset), ``action [L, N, B]``, ``reward`` (extrinsic), ``terminated``, ``truncated``,
    and what the initial priorities reuse of each step's forward (:func:`~foxhunt_jax.agent.
    network.act`): ``greedy [L, N, B]`` and ``taken_logits``, per branch ``[L, N, K]``.
    """
    keys = step_keys(key, num_steps)
    n = rollout.obs.shape[0]
    if _kernel_rollout(backend, adapter, n):
        return adapter.fused(learner, backend, env_params, agent_params, rollout, keys, epsilon,
                             num_steps)
    net, support = learner.network, learner.support
    step_v = jax.vmap(adapter.step_env, in_axes=(0, 0, 0, None))
    reset_v = jax.vmap(adapter.reset, in_axes=(0, None))
    encode_v = jax.vmap(adapter.encode)
    observe_v = adapter.observe and jax.vmap(adapter.observe, in_axes=(0, None))

    def body(carry: Rollout, k):
        k_act, k_step, k_reset = k
        # from the state: the observation's gather then fuses into the policy's input
        obs = observe_v(carry.env_state, env_params) if observe_v else carry.obs
        draws = explore_draws(k_act, n, net.branch_sizes, epsilon)
        greedy, action, taken = backend.act(agent_params, obs, draws, net, support)
        obs2, state2, reward, term, trunc, _ = step_v(jax.random.split(k_step, n), carry.env_state,
                                                     action, env_params)
        out = {"obs": encode_v(obs, carry.env_state), "next_obs": encode_v(obs2, state2),
               "action": action, "reward": reward, "terminated": term, "truncated": trunc,
               "greedy": greedy, "taken_logits": taken}
        obs_r, state_r = reset_v(jax.random.split(k_reset, n), env_params)
        done = term | trunc
        state = _where(done, state_r, state2)
        # with observe, the carried observation is left as it is and set once at the end
        obs = carry.obs if observe_v else jnp.where(done[:, None], obs_r, obs2)
        return Rollout(env_state=state, obs=obs), out

    rollout, traj = jax.lax.scan(body, rollout, keys)
    if observe_v:
        rollout = Rollout(env_state=rollout.env_state,
                          obs=observe_v(rollout.env_state, env_params))
    return rollout, traj


def novelty(backend: Backend, adapter: EnvAdapter, env_params, rnd, enc,
            spans=None) -> jax.Array:
    """Raw RND prediction error (``backend.novelty``) of encoded observations ``enc [L, N, ...]``
    -> ``[L, N]``, computed ``backend.tuning.row_chunk`` rows at a time (:func:`chunked`), and
    separately for each span of steps ``spans`` (``[start, stop)`` pairs covering ``[0, L)``;
    default one): with a rollout's :func:`rollout_spans` the pass over a launch's steps depends
    on that launch alone."""
    lead = jax.tree.leaves(enc)[0].shape[:2]
    err = lambda e: backend.novelty(rnd, adapter.decode(e, env_params))  # noqa: E731
    parts = []
    for start, stop in spans or ((0, lead[0]),):
        flat = jax.tree.map(lambda x: x[start:stop].reshape((-1,) + x.shape[2:]), enc)
        parts.append(chunked(err, flat, backend.tuning.row_chunk).reshape(
            (stop - start, lead[1])))
    return jnp.concatenate(parts, axis=0)


def trajectory_novelty(backend: Backend, adapter: EnvAdapter, env_params, rnd,
                       next_obs) -> jax.Array:
    """The raw novelty of a :func:`trajectory`'s next observations ``[L, N, ...]`` -> ``[L, N]``
    as the collector computes it: :func:`novelty` per launch (:func:`rollout_spans`)."""
    steps, n = jax.tree.leaves(next_obs)[0].shape[:2]
    return novelty(backend, adapter, env_params, rnd, next_obs,
                   rollout_spans(backend, adapter, n, steps))


def _collect(learner: Learner, backend: Backend, adapter: EnvAdapter, env_params,
             agent: AgentState, rollout: Rollout, key: jax.Array, epsilon, num_steps: int):
    """:func:`collect` with the raw novelty ``[L*N]`` returned instead of the updated RND state."""
    rollout, traj = trajectory(learner, backend, adapter, env_params, agent.params, rollout, key,
                               epsilon, num_steps)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    extrinsic = traj["reward"]
    raw = bonus = jnp.zeros_like(extrinsic)
    if agent.rnd is not None:  # novelty of each next observation, scaled by stats before this call
        raw = trajectory_novelty(backend, adapter, env_params, agent.rnd, traj["next_obs"])
        bonus = curiosity.scale_bonus(agent.rnd, raw, learner.curiosity_cfg.coef)
    t = learner.train_cfg
    returns, discounts, offsets = n_step_targets(extrinsic + bonus, traj["terminated"],
                                                 traj["truncated"], t.gamma, t.n_step)
    # bootstrap observation of transition t: next_obs of step t + k - 1, per episode
    rows = jnp.arange(num_steps)[:, None] + offsets - 1
    next_enc = jax.tree.map(lambda x: jnp.take_along_axis(
        x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=0), traj["next_obs"])
    items = {"obs": jax.tree.map(flat, traj["obs"]), "next_obs": jax.tree.map(flat, next_enc),
             "action": flat(traj["action"]), "reward": flat(returns), "discount": flat(discounts)}

    # the learner's per-sample loss (per_sample_loss), with the rollout's own forward for the
    # online logits at s and, where it has them, for the greedy actions at the bootstrap
    # observation: only the target network's forward runs over every transition
    greedy = next_greedy(learner, backend, adapter, env_params, agent.params, traj)
    boot = jnp.take_along_axis(greedy, rows[..., None], axis=0)

    def loss_of(it):
        return backend.bootstrap_loss(agent.target_params,
                                      adapter.decode(it["next_obs"], env_params), it["greedy"],
                                      it["taken"], it["reward"], it["discount"], learner.network,
                                      learner.support)

    parts = {"next_obs": items["next_obs"], "reward": items["reward"],
             "discount": items["discount"], "greedy": flat(boot),
             "taken": tuple(flat(x) for x in traj["taken_logits"])}
    priorities = chunked(loss_of, parts, backend.tuning.row_chunk)
    stats = {"reward": jnp.mean(extrinsic), "bonus": jnp.mean(bonus),
             "episodes_done": jnp.sum(traj["terminated"] | traj["truncated"]),
             "terminated": jnp.sum(traj["terminated"])}
    return rollout, items, priorities, flat(raw), stats
