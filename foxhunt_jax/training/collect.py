"""Experience collection: ``lax.scan`` over L timesteps with N episodes batched.

Per timestep (DESIGN 2): Q-forward [N, D] -> per-branch epsilon-greedy actions [N, B] with
per-step keys -> env step (vmapped) -> auto-reset of finished episodes (:func:`trajectory`).
After the scan, the curiosity bonus of every next observation is computed in one batched pass
(it depends only on the observation and the fixed RND networks, not on the actions, so nothing
in the loop waits for it), n-step returns are formed over the [L, N] trajectory, each
transition's initial priority is its C51 double-Q loss under the current online and target
networks (the learner's own loss, so priorities and training agree), and the L * N transitions
go into the replay buffer. The rollout's forward already gave the online logits of each taken
action and, for most transitions, the greedy action at the bootstrap observation
(:func:`next_greedy`), so the priorities add one forward over the transitions, the target
network's, instead of three. The whole phase is one jitted call with no host round trip.

With ``network.backend=pallas`` an adapter that provides ``fused`` (the trading env:
:mod:`foxhunt_jax.training.fused`) replaces the scan by a Pallas kernel over the timesteps
(two launches, :func:`rollout_spans`, so that the curiosity pass over the first one's steps
runs beside the second), fed with the same per-step random draws, so both backends give the
same trajectory; that is done up to ``fused.MAX_KERNEL_EPISODES`` episodes, above which the
scan (with the fused Q-forward) is the faster form. On that backend the target forward and
the loss of the priorities are one kernel too (:func:`~foxhunt_jax.agent.loss.bootstrap_loss`).

The collector is generic over the environment through :class:`EnvAdapter` (the trading env and
gymnax CartPole both use it). Replay items are ``{"obs": enc, "next_obs": enc, "action",
"reward", "discount"}`` where ``enc`` is the adapter's compact encoding of an observation.
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
from foxhunt_jax.agent.loss import bootstrap_loss, n_step_targets
from foxhunt_jax.agent.network import act, explore_draws, q_forward


@dataclass(frozen=True)
class EnvAdapter:
    """Single-episode env functions over explicit params; the collector vmaps them.

    reset(key, params) -> (obs [D], state)
    step_env(key, state, action [B], params) -> (obs, state, reward, terminated, truncated, info)
        (no auto-reset; obs/state are those after the step, before any reset)
    encode(obs [D], state) -> enc (what the replay buffer stores for an observation)
    decode(enc [M, ...], params) -> obs [M, D]
    fused (optional): a kernel backend of :func:`trajectory`, same arguments and result, used
        when ``network.backend`` is ``"pallas"``
    max_episode_steps (optional): ``(params) -> int``, static: the steps after which an episode
        is truncated, so that the initial priorities know how many truncations a window can
        hold (:func:`next_greedy`; without it, every step may be one)
    """

    reset: Callable
    step_env: Callable
    encode: Callable
    decode: Callable
    fused: Callable | None = None
    max_episode_steps: Callable | None = None

    def __hash__(self):
        return hash((self.reset, self.step_env, self.encode, self.decode, self.fused,
                     self.max_episode_steps))


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


# Initial priorities are computed this many transitions at a time: three network forwards over all
# L * N transitions at once would hold [L*N, width] activations (26 GB per layer at N = 256k).
PRIORITY_CHUNK = 1 << 20


def chunked(fn: Callable, items: Any, chunk: int) -> Any:
    """``fn(items [M, ...]) -> [M, ...]`` (arrays or a pytree of them) evaluated ``chunk`` rows
    at a time (``lax.map``).

    Rows are independent, so the result is ``fn(items)``; ``M <= chunk`` calls ``fn`` once.
    The last chunk is padded with copies of row 0 and the padding dropped.
    """
    m = jax.tree.leaves(items)[0].shape[0]
    if m <= chunk:
        return fn(items)
    k = -(-m // chunk)
    pad = lambda x: jnp.concatenate([x, jnp.broadcast_to(x[:1], (k * chunk - m,) + x.shape[1:])])
    blocks = jax.tree.map(lambda x: pad(x).reshape((k, chunk) + x.shape[1:]), items)
    return jax.tree.map(lambda y: y.reshape((-1,) + y.shape[2:])[:m], jax.lax.map(fn, blocks))


def greedy_after(learner: Learner, params, greedy: jax.Array, need: jax.Array, next_obs,
                 decode: Callable, size: int) -> jax.Array:
    """Greedy actions at each step's next observation from a rollout's own, ``[L, N, B]``.

    ``greedy [L, N, B]``: the greedy actions of the observations the rollout acted on;
    ``need [L, N]`` bool: the steps whose next observation is not the one acted on at t + 1
    (at most ``size`` of them, a static bound); ``next_obs``: their encodings ``[L, N, ...]``
    (a pytree), which ``decode(enc [M, ...]) -> obs [M, D]`` rebuilds. Elsewhere the result is
    ``greedy[t + 1]``; at the ``need`` rows, the online forward of their next observation,
    gathered into one batch of ``size`` rows.
    """
    steps, n, b = greedy.shape
    flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
    want = flat(need)
    idx = jnp.nonzero(want, size=size, fill_value=want.shape[0])[0]  # then past the end: none
    rows = jax.tree.map(lambda x: jnp.take(flat(x), idx, axis=0, mode="clip"), next_obs)

    def forward(e):
        return q_forward(params, decode(e), learner.network, learner.support,
                         learner.net_cfg.backend)[1]

    shifted = flat(jnp.concatenate([greedy[1:], greedy[-1:]]))
    found = chunked(forward, rows, PRIORITY_CHUNK)
    return shifted.at[idx].set(found, mode="drop").reshape(steps, n, b)


def next_greedy(learner: Learner, adapter: EnvAdapter, env_params, params, traj) -> jax.Array:
    """The online network's greedy actions at each step's next observation, ``[L, N, B]``.

    Where an episode goes on, the next observation of step t is the one the rollout acted on
    at t + 1, so its greedy action is ``traj["greedy"][t + 1]`` and needs no forward. A forward
    runs only for the others (:func:`greedy_after`): the last step's next observations and
    those of truncated steps (before their reset). Truncations are at least
    ``adapter.max_episode_steps`` (T) steps apart, so the first L - 1 steps hold at most
    ``ceil((L - 1) / T)`` of them per episode, and the rows are gathered into a batch of that
    static size plus N (the whole window when T is unknown). A terminated step keeps
    ``greedy[t + 1]`` (a reset observation's): its discount is 0, so its target distribution is
    its return's whatever the bootstrap logits.
    """
    steps, n, _ = traj["greedy"].shape
    limit = adapter.max_episode_steps(env_params) if adapter.max_episode_steps else 1
    per_episode = min(steps - 1, -(-(steps - 1) // limit))
    need = traj["truncated"].at[-1].set(True)
    return greedy_after(learner, params, traj["greedy"], need, traj["next_obs"],
                        lambda e: adapter.decode(e, env_params), (per_episode + 1) * n)


def _where(mask, a, b):
    """Per-episode select between two pytrees with leading axis N."""
    return jax.tree.map(lambda x, y: jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, y), a, b)


def collect(learner: Learner, adapter: EnvAdapter, env_params, agent: AgentState,
            rollout: Rollout, key: jax.Array, epsilon, num_steps: int):
    """Runs ``num_steps`` steps of every episode; returns (rollout, items [L*N], priorities, rnd,
    stats).

    ``stats`` holds the mean extrinsic and intrinsic reward per step and the number of finished
    episodes. Window end counts as truncation for the n-step targets (bootstrap from the next
    observation), which is exact: the episode simply continues in the next call. ``rnd`` is the
    curiosity state with this call's novelty folded into its running statistics.
    """
    rollout, items, priorities, novelty, stats = _collect(learner, adapter, env_params, agent,
                                                          rollout, key, epsilon, num_steps)
    rnd = agent.rnd
    if rnd is not None:
        rnd = curiosity.update_stats(rnd, novelty)
    return rollout, items, priorities, rnd, stats


def start_shards(adapter: EnvAdapter, env_params, key: jax.Array, shards: int,
                 num_episodes: int) -> Rollout:
    """``shards`` groups of ``num_episodes / shards`` episodes: leaves ``[S, N/S, ...]``.

    Shard ``s`` starts from ``fold_in(key, s)`` (:func:`foxhunt_jax.parallel.shard_keys`).
    """
    from foxhunt_jax.parallel import shard_keys

    per = num_episodes // shards
    return jax.vmap(lambda k: start(adapter, env_params, k, per))(shard_keys(key, shards))


def collect_shards(learner: Learner, adapter: EnvAdapter, env_params, agent: AgentState,
                   rollouts: Rollout, key: jax.Array, epsilon, num_steps: int, mesh=None):
    """:func:`collect` on every shard of a sharded rollout ``[S, N/S, ...]``.

    Shard ``s`` draws from ``fold_in(key, s)``; all shards act with the same (replicated) agent.
    Returns (rollouts, items ``[S, L*N/S, ...]``, priorities ``[S, L*N/S]``, rnd, stats): the
    curiosity statistics take in the novelty of every shard at once, and ``stats`` are those of
    the whole ``[L, N]`` batch (means over shards of equal size, counts summed).

    ``mesh``: the device mesh the shards are placed on; with more than one device each device
    collects its own shards (:func:`foxhunt_jax.parallel.per_device`), the same numbers.
    """
    from foxhunt_jax.parallel import per_device, shard_keys

    s = rollouts.obs.shape[0]
    run = jax.vmap(lambda r, k, a, p, e: _collect(learner, adapter, p, a, r, k, e, num_steps),
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


def _fused(learner: Learner, adapter: EnvAdapter, num_episodes: int) -> bool:
    """Whether :func:`trajectory` runs the adapter's kernel rollout instead of the scan."""
    from foxhunt_jax.training.fused import use_rollout_kernel

    return adapter.fused is not None and use_rollout_kernel(learner, num_episodes)


def rollout_spans(learner: Learner, adapter: EnvAdapter, num_episodes: int,
                  num_steps: int) -> tuple[tuple[int, int], ...]:
    """The steps of each kernel launch of :func:`trajectory`: those of
    :func:`foxhunt_jax.training.fused.rollout_spans` where the rollout is a kernel, else the
    whole window (a scan)."""
    from foxhunt_jax.training import fused

    if _fused(learner, adapter, num_episodes):
        return fused.rollout_spans(num_steps)
    return ((0, num_steps),)


def trajectory(learner: Learner, adapter: EnvAdapter, env_params, agent_params, rollout: Rollout,
               key: jax.Array, epsilon, num_steps: int):
    """``num_steps`` epsilon-greedy steps of every episode, with auto-reset.

    Returns ``(rollout, traj)``; ``traj`` holds ``[L, N, ...]`` arrays: ``obs`` and ``next_obs``
    (the adapter's encodings of the observation acted on and of the one after the step, before
    any reset), ``action [L, N, B]``, ``reward`` (extrinsic), ``terminated``, ``truncated``,
    and what the initial priorities reuse of each step's forward (:func:`~foxhunt_jax.agent.
    network.act`): ``greedy [L, N, B]`` and ``taken_logits``, per branch ``[L, N, K]``.
    """
    keys = step_keys(key, num_steps)
    n = rollout.obs.shape[0]
    if _fused(learner, adapter, n):
        return adapter.fused(learner, env_params, agent_params, rollout, keys, epsilon, num_steps)
    net, support = learner.network, learner.support
    step_v = jax.vmap(adapter.step_env, in_axes=(0, 0, 0, None))
    reset_v = jax.vmap(adapter.reset, in_axes=(0, None))
    encode_v = jax.vmap(adapter.encode)

    def body(carry: Rollout, k):
        k_act, k_step, k_reset = k
        draws = explore_draws(k_act, n, net.branch_sizes, epsilon)
        greedy, action, taken = act(agent_params, carry.obs, draws, net, support,
                                    learner.net_cfg.backend)
        obs2, state2, reward, term, trunc, _ = step_v(jax.random.split(k_step, n), carry.env_state,
                                                     action, env_params)
        out = {"obs": encode_v(carry.obs, carry.env_state), "next_obs": encode_v(obs2, state2),
               "action": action, "reward": reward, "terminated": term, "truncated": trunc,
               "greedy": greedy, "taken_logits": taken}
        obs_r, state_r = reset_v(jax.random.split(k_reset, n), env_params)
        done = term | trunc
        return Rollout(env_state=_where(done, state_r, state2), obs=jnp.where(done[:, None], obs_r, obs2)), out

    return jax.lax.scan(body, rollout, keys)


def novelty(adapter: EnvAdapter, env_params, rnd, enc, spans=None,
            backend: str = "xla") -> jax.Array:
    """Raw RND prediction error of encoded observations ``enc [L, N, ...]`` -> ``[L, N]``,
    computed ``PRIORITY_CHUNK`` rows at a time, and separately for each span of steps
    ``spans`` (``[start, stop)`` pairs covering ``[0, L)``; default one): with the spans of a
    rollout's kernel launches (:func:`foxhunt_jax.training.fused.rollout_spans`) the pass over
    a launch's steps depends on that launch alone. ``backend``: the Q-network's
    (:func:`foxhunt_jax.agent.curiosity.prediction_error`)."""
    lead = jax.tree.leaves(enc)[0].shape[:2]
    err = lambda e: curiosity.prediction_error(rnd, adapter.decode(e, env_params),  # noqa: E731
                                               backend)
    parts = []
    for start, stop in spans or ((0, lead[0]),):
        flat = jax.tree.map(lambda x: x[start:stop].reshape((-1,) + x.shape[2:]), enc)
        parts.append(chunked(err, flat, PRIORITY_CHUNK).reshape((stop - start, lead[1])))
    return jnp.concatenate(parts, axis=0)


def trajectory_novelty(learner: Learner, adapter: EnvAdapter, env_params, rnd,
                       next_obs) -> jax.Array:
    """The raw novelty of a :func:`trajectory`'s next observations ``[L, N, ...]`` -> ``[L, N]``
    as the collector computes it: :func:`novelty` per kernel launch (:func:`rollout_spans`),
    on the Q-network's backend."""
    steps, n = jax.tree.leaves(next_obs)[0].shape[:2]
    return novelty(adapter, env_params, rnd, next_obs,
                   rollout_spans(learner, adapter, n, steps), learner.net_cfg.backend)


def _collect(learner: Learner, adapter: EnvAdapter, env_params, agent: AgentState,
             rollout: Rollout, key: jax.Array, epsilon, num_steps: int):
    """:func:`collect` with the raw novelty ``[L*N]`` returned instead of the updated RND state."""
    rollout, traj = trajectory(learner, adapter, env_params, agent.params, rollout, key, epsilon,
                               num_steps)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    extrinsic = traj["reward"]
    raw = bonus = jnp.zeros_like(extrinsic)
    if agent.rnd is not None:  # novelty of each next observation, scaled by stats before this call
        raw = trajectory_novelty(learner, adapter, env_params, agent.rnd, traj["next_obs"])
        bonus = curiosity.scale_bonus(agent.rnd, raw)
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
    greedy = next_greedy(learner, adapter, env_params, agent.params, traj)
    boot = jnp.take_along_axis(greedy, rows[..., None], axis=0)

    def loss_of(it):
        return bootstrap_loss(agent.target_params, adapter.decode(it["next_obs"], env_params),
                              it["greedy"], it["taken"], it["reward"], it["discount"],
                              learner.network, learner.support, learner.net_cfg.backend)

    parts = {"next_obs": items["next_obs"], "reward": items["reward"],
             "discount": items["discount"], "greedy": flat(boot),
             "taken": tuple(flat(x) for x in traj["taken_logits"])}
    priorities = chunked(loss_of, parts, PRIORITY_CHUNK)
    stats = {"reward": jnp.mean(extrinsic), "bonus": jnp.mean(bonus),
             "episodes_done": jnp.sum(traj["terminated"] | traj["truncated"]),
             "terminated": jnp.sum(traj["terminated"])}
    return rollout, items, priorities, flat(raw), stats
