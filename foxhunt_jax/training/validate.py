"""Greedy validation and full-split evaluation of the trading agent.

* Per-epoch validation: a fixed set of windows of L bars (starts evenly spaced over the valid
  starts of the validation split, so every instrument with room for a window gets its share;
  the same windows every epoch) rolled out greedily in parallel, plus the C51 loss on the
  transitions of those rollouts.
* Full evaluation: every instrument walked greedily from the start of a split to its end, in
  parallel across instruments (shorter instruments are masked once they end).

Both return equity paths; :mod:`foxhunt_jax.training.metrics` turns them into trading metrics.
Buy-and-hold buys one unit of equity at the first close (paying the proportional cost) and
marks it at every later close; the flat policy stays in cash; the random policies draw every
branch uniformly (the agent's exploration draw), many of them in one program
(:func:`random_walks`).

A policy here is ``policy(key, obs [W, D], state) -> actions [W, B] int32`` where ``state`` is
the batched :class:`~foxhunt_jax.env.trading.EnvState` the observation was made from. The
greedy and random policies ignore ``state``; the oracle of the synthetic market reads
``state.bar`` to look up the raw last log return (the normalized ``ret_1`` in the observation
has the train mean subtracted, so its sign is not the sign of the return).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.agent.learner import Learner
from foxhunt_jax.agent.network import explore_draws
from foxhunt_jax.agent.loss import n_step_targets
from foxhunt_jax.backend import Backend
from foxhunt_jax.data.synthetic import SYNTHETIC_SOURCE, oracle_exposure
from foxhunt_jax.env import trading
from foxhunt_jax.training.collect import greedy_after
from foxhunt_jax.training.fused import evaluate_trajectory


def window_starts(starts: np.ndarray, count: int) -> np.ndarray:
    """``count`` starts evenly spaced over the sorted valid starts [S] (fewer if S < count)."""
    starts = np.sort(np.asarray(starts))
    idx = np.unique(np.linspace(0, len(starts) - 1, num=min(count, len(starts))).round().astype(int))
    return starts[idx].astype(np.int32)


def policy_rollout(env_params, starts: jax.Array, num_steps: int, policy, key: jax.Array,
                   lengths: jax.Array | None = None):
    """Rolls out episodes from fixed ``starts`` [W] for ``num_steps`` without auto-reset.

    ``policy(key, obs [W, D], state) -> actions [W, B]`` (``state``: the batched EnvState the
    observation belongs to). An episode stops after ``lengths[w]`` steps
    (default ``num_steps``) or when it terminates (ruin); after that it is masked out (equity
    NaN, reward 0, ``alive`` False). Returns a dict of [L, W] arrays: the compact encodings for
    the loss, rewards, terminated, truncated, equity, exposure, traded, fills, turnover, alive.
    """
    obs, state = jax.vmap(trading.reset_at, in_axes=(0, None))(starts, env_params)
    w = starts.shape[0]
    step_v = jax.vmap(trading.step_env, in_axes=(0, 0, 0, None))

    lengths = jnp.full((w,), num_steps, jnp.int32) if lengths is None else jnp.asarray(lengths)
    p = trading.PORTFOLIO_DIM

    def body(carry, xs):
        obs, state, alive = carry
        k, t = xs
        alive = alive & (t < lengths)
        k_pol, k_env = jax.random.split(k)
        action = policy(k_pol, obs, state)
        obs2, state2, reward, term, trunc, info = step_v(jax.random.split(k_env, w), state, action,
                                                        env_params)
        out = _record(env_params, t, lengths, alive, state.bar, obs[:, -p:], state2.bar,
                      obs2[:, -p:], action, reward, term, trunc, info)
        keep = lambda new, old: jnp.where(alive.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
        state2 = jax.tree.map(keep, state2, state)
        obs2 = keep(obs2, obs)
        return (obs2, state2, alive & ~term), out

    alive = jnp.ones((w,), bool)
    xs = (jax.random.split(key, num_steps), jnp.arange(num_steps))
    _, traj = jax.lax.scan(body, (obs, state, alive), xs)
    return traj


def _record(env_params, t, lengths, alive, bar, portfolio, next_bar, next_portfolio, action,
            reward, terminated, truncated, info) -> dict:
    """One step's record of :func:`policy_rollout`, masked by ``alive`` (any batch shape: [W]
    inside the scan, [L, W] for the fused kernel's raw results); ``info`` holds the step's
    ``equity``, ``traded``, ``fills`` and ``turnover`` (the env's info)."""
    return {"bar": bar, "portfolio": portfolio, "next_bar": next_bar,
            "next_portfolio": next_portfolio, "action": action,
            "reward": jnp.where(alive, reward, 0.0), "terminated": terminated & alive,
            "truncated": (truncated | (t + 1 >= lengths)) & alive,
            "equity": jnp.where(alive, info["equity"], jnp.nan),
            # the position taken into the bar is the chosen exposure (a trade moves to it, or it
            # is kept); a barrier or ruin exit during the bar is counted in fills and turnover
            "exposure": jnp.where(alive, env_params.exposures[action[..., 0]], 0.0),
            "traded": info["traded"] & alive, "fills": jnp.where(alive, info["fills"], 0),
            "turnover": jnp.where(alive, info["turnover"], 0.0), "alive": alive}


def greedy_policy(learner: Learner, backend: Backend, params):
    """The agent's greedy actions (highest expected Q per branch, ``backend.q_forward``);
    ignores key and state."""
    def policy(key, obs, state):
        del key, state
        return backend.q_forward(params, obs, learner.network, learner.support)[1]
    return policy


def greedy_rollout(learner: Learner, backend: Backend, params, env_params, starts: jax.Array,
                   num_steps: int, key: jax.Array, lengths: jax.Array | None = None):
    """:func:`policy_rollout` of the agent's :func:`greedy_policy`; where ``backend`` runs the
    rollout of that many windows as a kernel, the whole rollout is one
    (:func:`foxhunt_jax.training.fused.evaluate_trajectory`, tested equal)."""
    if not backend.runs_rollout_kernel(starts.shape[0]):
        return policy_rollout(env_params, starts, num_steps,
                              greedy_policy(learner, backend, params), key, lengths)

    w = starts.shape[0]
    lengths = jnp.full((w,), num_steps, jnp.int32) if lengths is None else jnp.asarray(lengths)
    raw = evaluate_trajectory(learner, backend, params, env_params, starts, num_steps, lengths)
    return _record(env_params, raw["step"], lengths, raw["alive"], raw["bar"], raw["portfolio"],
                   raw["next_bar"], raw["next_portfolio"], raw["action"], raw["reward"],
                   raw["terminated"], raw["truncated"], raw)


def random_policy(branch_sizes):
    """Every branch uniform over its actions, independently: the random draw of the agent's
    epsilon-greedy exploration (:func:`~foxhunt_jax.agent.network.explore_draws` at epsilon 1);
    ignores state."""
    def policy(key, obs, state):
        del state
        return explore_draws(key, obs.shape[0], branch_sizes, 1.0)
    return policy


def random_walks(env_params, starts: jax.Array, num_steps: int, key: jax.Array,
                 lengths: jax.Array, branch_sizes, policies: int) -> dict:
    """``policies`` random policies (:func:`random_policy`, policy ``p`` drawing from
    ``split(key, policies)[p]``), each walking every window of :func:`policy_rollout`; one
    traced program (vmap over the policies). Returns ``[P, W, L]`` arrays ``equity``,
    ``exposure``, ``traded``, ``fills``, ``turnover`` and ``action [P, W, L, B]``."""
    def walk(k):
        traj = policy_rollout(env_params, starts, num_steps, random_policy(branch_sizes), k,
                              lengths)
        return {name: jnp.swapaxes(traj[name], 0, 1)
                for name in ("equity", "exposure", "traded", "fills", "turnover", "action")}
    return jax.vmap(walk)(jax.random.split(key, policies))


def oracle_policy(last_log_return, env_cfg):
    """The policy that exploits the planted AR(1) signal of ``builtin:synthetic``.

    Goes long (the largest exposure, +1 by default) after an up bar and short (the smallest,
    -1) after a down bar, i.e. :func:`foxhunt_jax.data.synthetic.oracle_exposure` of the last
    return; flat (the exposure nearest 0) after an unchanged close. Barrier branches take their
    widest multiple so the barriers interfere as little as the env allows.

    The last return is known at the decision bar's close, as the agent's observation is, so the
    oracle obeys the env's fill timing: under ``next_open`` fills it captures the next bar's
    return from its open on (the synthetic opens sit at the previous close up to a tiny noise,
    so it forgoes almost nothing); it never trades on a return it could not have seen.

    Args:
      last_log_return: [T] raw one-bar log returns of the whole table
        (``MarketTables.last_log_return``), indexed by ``state.bar``; pass it as an argument of
        the jitted function that builds the policy so it is not baked in as a constant.
      env_cfg: the ``EnvConfig`` whose action values the indices refer to.
    Returns:
      ``policy(key, obs [W, D], state) -> actions [W, B] int32``.
    """
    x = np.asarray(env_cfg.exposures, np.float64)
    long_i, short_i, flat_i = (int(np.argmax(x)), int(np.argmin(x)), int(np.argmin(np.abs(x))))
    barrier_cols = [int(np.argmax(v)) for v in (env_cfg.take_profit, env_cfg.stop_loss) if v]
    lr = jnp.asarray(last_log_return, jnp.float32)  # host or device array, or a tracer

    def policy(key, obs, state):
        del key, obs
        side = oracle_exposure(lr[state.bar])  # [W] in {-1, 0, +1}
        idx = jnp.where(side > 0, long_i, jnp.where(side < 0, short_i, flat_i)).astype(jnp.int32)
        cols = [idx] + [jnp.full_like(idx, c) for c in barrier_cols]
        return jnp.stack(cols, axis=-1)
    return policy


def validation_loss(learner: Learner, backend: Backend, params, target_params, env_params,
                    traj) -> jax.Array:
    """Mean C51 loss over the held-out transitions of a validation rollout, on ``backend``.

    The learner's loss (:func:`~foxhunt_jax.agent.learner.per_sample_loss`), except that the
    online network's greedy action at a bootstrap observation is the rollout's own where the
    window went on (a greedy rollout acts on that observation at the next step); a forward runs
    only at truncated steps' next observations. Without a reset a window truncates at its end,
    and at every step from the env's ``episode_length`` on, so each has at most
    ``max(1, L - episode_length + 1)`` of them: a gather of static size. A terminated step's
    greedy action does not enter its loss (its discount is 0).
    """
    t = learner.train_cfg
    steps = traj["reward"].shape[0]
    returns, discounts, offsets = n_step_targets(traj["reward"], traj["terminated"],
                                                 traj["truncated"] | ~traj["alive"], t.gamma, t.n_step)
    rows = jnp.arange(steps)[:, None] + offsets - 1
    take = lambda x: jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=0)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    net, z = learner.network, learner.support
    # the greedy action at each step's next observation: the next step's action, or a forward
    per_window = min(steps, max(1, steps - env_params.episode_length + 1))
    greedy = greedy_after(learner, backend, params, traj["action"],
                          traj["truncated"] & traj["alive"],
                          {"bar": traj["next_bar"], "portfolio": traj["next_portfolio"]},
                          lambda e: trading.decode(e, env_params), per_window)
    obs = trading.decode({"bar": flat(traj["bar"]), "portfolio": flat(traj["portfolio"])},
                         env_params)
    next_obs = trading.decode({"bar": flat(take(traj["next_bar"])),
                               "portfolio": flat(take(traj["next_portfolio"]))}, env_params)
    losses = backend.bootstrap_loss(target_params, next_obs, flat(take(greedy)),
                                    backend.taken_logits(params, obs, flat(traj["action"]), net),
                                    flat(returns), flat(discounts), net, z)
    weight = flat(traj["alive"]).astype(jnp.float32)
    return jnp.sum(losses * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def equity_paths(traj) -> dict:
    """[W, L+1] equity starting at 1; [W, L] exposure, traded flags (the chosen trades), trades
    (every fill: chosen trades and barrier or ruin exits) and turnover, as host NumPy. Leading
    axes (a population's ``[P, L, W]`` paths) stay in front: ``[P, W, L+1]`` and so on."""
    walks = lambda x, dtype=None: np.swapaxes(np.asarray(x, dtype), -1, -2)  # noqa: E731
    eq = walks(traj["equity"], np.float64)
    eq = np.concatenate([np.ones(eq.shape[:-1] + (1,)), eq], axis=-1)
    return {"equity": eq, "exposure": walks(traj["exposure"], np.float64),
            "traded": walks(traj["traded"]), "trades": walks(traj["fills"]),
            "turnover": walks(traj["turnover"], np.float64)}


def walk_paths(walks: dict) -> dict:
    """:func:`random_walks`' arrays as host NumPy paths (:func:`equity_paths`' layout with a
    leading ``[P]``): ``equity [P, W, L+1]`` starting at 1, ``exposure``, ``traded``, ``trades``
    and ``turnover [P, W, L]``, ``action [P, W, L, B]``."""
    eq = np.asarray(walks["equity"], np.float64)
    eq = np.concatenate([np.ones(eq.shape[:-1] + (1,)), eq], axis=-1)
    return {"equity": eq, "exposure": np.asarray(walks["exposure"], np.float64),
            "traded": np.asarray(walks["traded"]), "trades": np.asarray(walks["fills"]),
            "turnover": np.asarray(walks["turnover"], np.float64),
            "action": np.asarray(walks["action"])}


def flat_paths(lengths: np.ndarray) -> dict:
    """Staying flat (in cash): equity 1 [W, max_len+1] (NaN after each window ends), no
    exposure, no trades."""
    w, m = len(lengths), int(np.max(lengths))
    eq = np.where(np.arange(m + 1)[None, :] <= np.asarray(lengths)[:, None], 1.0, np.nan)
    return {"equity": eq, "exposure": np.zeros((w, m)), "traded": np.zeros((w, m), bool),
            "trades": np.zeros((w, m), np.int64), "turnover": np.zeros((w, m))}


def walk_dates(timestamps: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> list:
    """The date of every equity mark of each walk: ``[n + 1]`` datetime64 from ``starts[w]``
    (a walk's equity after step ``j`` is marked at the close of bar ``start + j + 1``)."""
    return [np.asarray(timestamps[s:s + n + 1]) for s, n in zip(starts, lengths)]


def buy_and_hold_paths(tables, env_cfg, starts: np.ndarray, lengths: np.ndarray) -> dict:
    """Buy-and-hold equity [W, max_len+1] (NaN after each window ends), exposure, traded flags,
    trades and turnover (:func:`equity_paths`' layout): one buy, filled by the env's rule
    (``env.fill``: the first bar's close, or the next bar's open; ``env.slippage_bps`` against
    it, ``env.cost_bps`` on top), then held and marked at each close."""
    cost, slip = env_cfg.cost_bps / 1e4, env_cfg.slippage_bps / 1e4
    w, m = len(starts), int(np.max(lengths))
    eq = np.full((w, m + 1), np.nan)
    expo = np.zeros((w, m))
    traded = np.zeros((w, m), bool)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        px = np.asarray(tables.close[s:s + n + 1], np.float64)
        fill = float(tables.open[s + 1]) if env_cfg.fill == "next_open" else px[0]
        units = 1.0 / (fill * (1.0 + slip) * (1.0 + cost))
        eq[i, :n + 1] = units * px
        eq[i, 0] = 1.0
        expo[i, :n] = 1.0
        traded[i, 0] = True
    return {"equity": eq, "exposure": expo, "traded": traded, "trades": traded.astype(np.int64),
            "turnover": traded.astype(np.float64)}


def is_synthetic(market) -> bool:
    """True when every instrument of ``market`` comes from ``builtin:synthetic`` (so the oracle
    knows the signal of all of them)."""
    return bool(market.instruments) and all(ins.source == SYNTHETIC_SOURCE
                                            for ins in market.instruments)


# splits whose full walks run the same number of steps (:func:`walk_length`)
SHARED_WALK_SPLITS = ("validation", "test")


def _segment_lengths(tables, split: str) -> np.ndarray:
    seg = tables.segments[split]
    return (seg[:, 1] - seg[:, 0]).astype(np.int32)


def _walk_group(split: str) -> tuple[str, ...]:
    """The splits whose walks ``split``'s walk is shaped with (:data:`SHARED_WALK_SPLITS`)."""
    return SHARED_WALK_SPLITS if split in SHARED_WALK_SPLITS else (split,)


def walk_length(tables, split: str) -> int:
    """The steps of a full walk of ``split`` (:func:`evaluation_params`): the most bars an
    instrument has in it. The validation and test splits both take the longer of theirs, so
    their walks run the same compiled programs; a walk's steps after an instrument's last bar
    leave its paths as they are (it is frozen), and the step keys are a prefix of a longer
    walk's (``jax_threefry_partitionable``), so the paths equal a walk of the split's own
    length."""
    return max(int(_segment_lengths(tables, s).max(initial=0)) for s in _walk_group(split))


def evaluation_params(tables, env_cfg, split: str, min_rows: int = 0):
    """``(env_params, starts [W], lengths [W])`` for walking each instrument of ``split`` from its
    first bar to its last: ``env_params.episode_length`` is :func:`walk_length` (the steps to
    run), and ``env_params.starts`` holds the walks' first bars (a walk never draws a start),
    padded to the tables' rows (at least ``min_rows``: ``data.min_table_rows``) as every
    split's starts are."""
    seg, lengths = tables.segments[split], _segment_lengths(tables, split)
    keep = lengths >= 1
    starts = seg[keep, 0].astype(np.int32)
    long_cfg = dataclasses.replace(env_cfg, episode_length=walk_length(tables, split))
    return (trading.make_params(tables, long_cfg, split, starts, min_rows), starts,
            lengths[keep])


def walk_rows(tables, split: str) -> int:
    """How many walks a full walk of ``split`` runs at once: the instruments with a bar in it;
    the validation and test splits both take the larger count (:func:`walk_length`'s reason),
    the extra rows walking nothing (:func:`shared_walks`)."""
    return max(int((_segment_lengths(tables, s) >= 1).sum()) for s in _walk_group(split))


def shared_walks(starts: np.ndarray, lengths: np.ndarray, rows: int):
    """``(starts, lengths)`` ``[rows]``: the split's walks, then walks of length 0 (from the
    first start) up to ``rows``; a walk of length 0 never steps, and no other walk's draws
    depend on it (the draws of row ``w`` are those of a narrower walk's row ``w``)."""
    extra = rows - len(starts)
    return (np.pad(starts, (0, extra), mode="edge").astype(np.int32),
            np.pad(lengths, (0, extra)).astype(np.int32))


def own_walks(tree, walks: int, steps: int, walk_axis: int, time_axis: int) -> dict:
    """Every array of ``tree`` (a shared walk's results) as host NumPy cut to the first
    ``walks`` along ``walk_axis`` and the first ``steps`` along ``time_axis``: what a walk of the
    split's own instruments and length returns."""
    cut = [slice(None)] * (max(walk_axis, time_axis) + 1)
    cut[walk_axis], cut[time_axis] = slice(0, walks), slice(0, steps)
    return jax.tree.map(lambda x: np.asarray(x)[tuple(cut)], tree)
