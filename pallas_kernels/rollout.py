"""Fused rollout: every timestep of a block of trading episodes in one Pallas kernel.

This is an execution backend of the collection loop (``training/collect.py``) and of the greedy
validation loop (``training/validate.py``) for the trading env. A ``lax.scan`` over L timesteps
launches the forward, the exploration select and the env step as separate kernels every step,
and at small N each step costs its launch latency, not its arithmetic. Here each
program takes a block of ``BM`` episodes, keeps their state in registers and runs

    for t in range(L):
        obs = features[bar] ++ portfolio_features(state)      (gathered in the kernel)
        greedy = QNetwork forward (forward_rows of q_forward.py, activations on chip)
        action = greedy, or the pre-drawn random action where the branch explores
        state, reward, ... = trading.advance(state, action)   (the env's own step function)
        write the transition (collect: with the greedy actions and the taken actions' logits,
            which the initial priorities reuse); reset finished episodes (collect) or freeze
            them (evaluate)

with one launch for the whole rollout. At 16-row blocks (``HALVES_MAX_ROWS``) the loop runs
each step as two iterations, the forward and then the env step, which shortens Triton's
compile of the kernel at a small cost in run time (both measured in docs/performance.md).
A collection rollout whose blocks queue for the multiprocessors in several waves (a
population's members, :data:`pallas_kernels.tuning.STEPPED_WAVES`) launches the same step once
a timestep instead (``stepped``, under a ``lax.scan``): each launch reads the state its
predecessor wrote and writes step ``t`` of the outputs in place, so no program holds its
block's state across the whole window. The env rules are not restated here: the kernel calls
:func:`foxhunt_jax.env.trading.advance` and :func:`~foxhunt_jax.env.trading.portfolio_features`
with Pallas refs in place of the price tables, so the step has one definition.

Randomness is drawn outside, by the same functions and keys the scan uses (the agent's
``explore_draws``, :func:`foxhunt_jax.env.trading.start_bar`),
so both backends see the same exploration and reset draws; the tests require equal
trajectories.

Shapes: ``N`` episodes, ``L`` timesteps, ``B`` branches, ``P`` = 6 portfolio features; the
per-step outputs are ``[L, C, N]`` so every store is a contiguous row of ``BM`` values.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from foxhunt_jax.env import trading
from pallas_kernels.q_forward import (DTYPES, TakenLogits, apply_draws, forward_rows, launch,
                                      make_plan, offsets_of, operand_names, pack_params,
                                      read_blocks)
from pallas_kernels.tuning import KernelConfig, block_rows_for, for_device

P = trading.PORTFOLIO_DIM
STATE_F = ("equity", "cash", "units", "exposure", "entry_price", "tp_price", "sl_price")
STATE_I = ("bar", "step", "time_in_trade")
# per-step outputs: float channels, then int32 channels followed by the B actions
OUT_F = tuple(f"portfolio{j}" for j in range(P)) + tuple(f"next_portfolio{j}" for j in range(P)) \
    + ("reward", "equity", "turnover")
OUT_I = ("bar", "next_bar", "terminated", "truncated", "traded", "fills", "alive")
MODES = ("collect", "evaluate")
# the largest blocks whose whole-window loop runs a step as two iterations (:func:`_kernel`)
HALVES_MAX_ROWS = 16
_TABLES = ("close", "sigma", "open", "high", "low", "exposures", "take_profit", "stop_loss")
_SCALARS = ("cost_rate", "fixed_cost", "ruin_floor", "reward_scale", "slippage_rate")


def _kernel(plan, cd, layout: str, lookahead: int, mode: str, explore: bool, env_static: dict,
            stepped: bool, halves: bool, *refs):
    n_ops = len(operand_names(plan))
    it = iter(refs)
    step_ref = next(it)  # stepped: the timestep this launch runs; else the window's length
    feat_ref, z_ref, scal_ref = next(it), next(it), next(it)
    tables = {name: next(it) for name in _TABLES}
    st_f_ref, st_i_ref = next(it), next(it)
    port_ref = next(it) if stepped else None
    draws_ref = next(it) if explore else None
    resets_ref = next(it) if mode == "collect" else None
    lengths_ref = next(it) if mode == "evaluate" else None
    ops = dict(zip(operand_names(plan), [next(it) for _ in range(n_ops)]))
    if stepped:  # the outputs' buffers come in too (aliased to the outputs); only step t is written
        for _ in range(3 if mode == "collect" else 2):
            next(it)
    out_f_ref, out_i_ref, end_f_ref, end_i_ref = next(it), next(it), next(it), next(it)
    taken_ref = next(it) if mode == "collect" else None
    end_port_ref = next(it) if stepped else None
    nb = len(plan.branch_sizes)

    scal = {name: scal_ref[i] for i, name in enumerate(_SCALARS)}
    # EnvParams with refs for the tables: advance / portfolio_features only index them
    params = trading.EnvParams(features=None, starts=None, num_starts=None, **tables, **scal,
                               **env_static)
    z = z_ref[...]
    sizes = plan.chunks(plan.obs_dim)
    n_feat = plan.obs_dim - P

    def observe(state, port):
        xs = []
        for o, c in zip(offsets_of(sizes), sizes):
            x = feat_ref[state.bar, pl.ds(o, c)]  # gather [BM, c]; the table is zero past F
            col = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1) + o
            for j in range(P):
                if o <= n_feat + j < o + c:
                    x = x + jnp.where(col == n_feat + j, port[j][:, None], 0.0)
            xs.append(x.astype(cd))
        return xs

    def act(t, state, port):
        """The step's actions and, collecting, the greedy ones (else ``()``) from the state's
        observation."""
        blocks = read_blocks(plan, cd, layout, ops, state.bar.shape[0], lookahead)
        blocks.start()  # the first weight loads wait alongside the observation's gather
        xs = observe(state, port)
        on_action = None
        if mode == "collect":  # the taken actions' logits, for the initial priorities

            def store(d, logits):
                taken_ref[t, d, :, :] = logits
            on_action = TakenLogits(store, (lambda d: draws_ref[t, d, :]) if explore else None)
        greedy = forward_rows(plan, cd, layout, blocks, xs, z, on_action=on_action)
        actions = greedy
        if explore:
            actions = [apply_draws(draws_ref[t, d, :], a) for d, a in enumerate(greedy)]
        return tuple(actions), tuple(greedy) if mode == "collect" else ()

    def env_step(t, state, port, alive, actions, greedy, row):
        """The env step under ``actions``, its records written; the next (state, port, alive).
        ``port``: portfolio_features(state), carried so each step evaluates it once (on the new
        state, for the transition record and the next observation)."""
        new, reward, term, trunc, info = trading.advance(state, actions, params, row)
        next_port = trading.portfolio_features(new, params)
        if mode == "evaluate":
            alive = alive & (t < lengths_ref[...])
        for j in range(P):
            out_f_ref[t, j, :] = port[j]
            out_f_ref[t, P + j, :] = next_port[j]
        out_f_ref[t, 2 * P, :] = reward
        out_f_ref[t, 2 * P + 1, :] = info["equity"]
        out_f_ref[t, 2 * P + 2, :] = info["turnover"]
        ints = (state.bar, new.bar, term, trunc, info["traded"], info["fills"], alive)
        for c, v in enumerate(ints):
            out_i_ref[t, c, :] = v.astype(jnp.int32)
        for d, a in enumerate(actions):
            out_i_ref[t, len(OUT_I) + d, :] = a
        if mode == "collect":  # the greedy actions; auto-reset at a pre-drawn start bar
            for d, a in enumerate(greedy):
                out_i_ref[t, len(OUT_I) + nb + d, :] = a
            done = term | trunc
            fresh = trading.fresh_state(resets_ref[t, :])
            state = jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh, new)
            port = jax.tree.map(lambda a, b: jnp.where(done, a, b),
                                trading.portfolio_features(fresh, params), next_port)
        else:  # finished or past its length: frozen
            state = jax.tree.map(lambda a, b: jnp.where(alive, a, b), new, state)
            port = jax.tree.map(lambda a, b: jnp.where(alive, a, b), next_port, port)
            alive = alive & ~term
        return state, port, alive

    def half_step(i, carry):
        # Step i // 2 in two halves, the forward (even i), then the env step (odd i), so
        # that no value flows from one to the other within an iteration: they meet only through
        # the loop's carry. Triton's coalescing and matmul passes walk, for every memory access
        # and product, the slices of the operations connected to it, which grow with the
        # product of the two parts' sizes when they are one chain (docs/performance.md).
        t = jax.lax.div(i, 2)

        def forward_half(c):
            state, port, alive, _, _, _ = c
            # the step's prices are read here too, so their loads wait beside the forward's
            row = trading.market_row(state.bar, params)
            return (state, port, alive, *act(t, state, port), row)

        def env_half(c):
            state, port, alive, actions, greedy, row = c
            return (*env_step(t, state, port, alive, actions, greedy, row), actions, greedy,
                    row)
        return jax.lax.cond(jax.lax.rem(i, 2) == 0, forward_half, env_half, carry)

    fields = {name: st_f_ref[i, :] for i, name in enumerate(STATE_F)}
    fields.update({name: st_i_ref[i, :] for i, name in enumerate(STATE_I)})
    state0 = trading.EnvState(**fields)
    alive0 = jnp.ones(state0.bar.shape, jnp.bool_)
    first = trading.portfolio_features(state0, params)
    if stepped:  # one step, t0 = step_ref[0]; the portfolio features carried in memory after 0
        t0 = step_ref[0]
        port0 = tuple(jnp.where(t0 == 0, f, port_ref[j, :]) for j, f in enumerate(first))
        state, port, _ = env_step(t0, state0, port0, alive0, *act(t0, state0, port0), None)
        for j in range(P):
            end_port_ref[j, :] = port[j]
    elif halves:
        no_actions = tuple(jnp.zeros(state0.bar.shape, jnp.int32) for _ in range(nb))
        no_greedy = no_actions if mode == "collect" else ()
        no_row = tuple(jnp.zeros(state0.bar.shape, jnp.float32) for _ in trading.MARKET_ROW)
        state, *_ = jax.lax.fori_loop(0, 2 * step_ref[0], half_step,
                                      (state0, first, alive0, no_actions, no_greedy, no_row))
    else:
        def step(t, carry):
            state, port, alive = carry
            return env_step(t, state, port, alive, *act(t, state, port), None)
        state, _, _ = jax.lax.fori_loop(0, step_ref[0], step, (state0, first, alive0))
    for i, name in enumerate(STATE_F):
        end_f_ref[i, :] = getattr(state, name)
    for i, name in enumerate(STATE_I):
        end_i_ref[i, :] = getattr(state, name)


_STEP_SPEC = pl.BlockSpec((1,), lambda i: (0,))  # the kernel's step_ref


def launch_spans(num_steps: int) -> tuple[tuple[int, int], ...]:
    """The steps ``[start, stop)`` of each launch of a collection rollout: the first three
    quarters, then the rest (one launch under 4 steps).

    The second launch continues from the first one's end state with the next steps' draws, so
    the trajectory is the same as one launch's. The split lets work on the first launch's
    results (the curiosity pass over its next observations) run beside the second launch.
    """
    tail = num_steps // 4
    if tail < 1:
        return ((0, num_steps),)
    return ((0, num_steps - tail), (num_steps - tail, num_steps))


def _pad_cols(x: jax.Array, cols: int) -> jax.Array:
    """Pads the last axis to ``cols`` with copies of column 0 (harmless, dropped afterwards)."""
    extra = cols - x.shape[-1]
    if extra == 0:
        return x
    return jnp.concatenate([x, jnp.broadcast_to(x[..., :1], x.shape[:-1] + (extra,))], axis=-1)


def fused_rollout(params: Any, network, support: jax.Array, env_params, state, num_steps: int,
                  *, mode: str = "collect", draws: jax.Array | None = None,
                  reset_bars: jax.Array | None = None, lengths: jax.Array | None = None,
                  config: KernelConfig | None = None, interpret: bool | None = None,
                  stepped: bool = False):
    """``num_steps`` steps of N trading episodes under the network's (epsilon-)greedy policy.

    Args:
      params, network, support: the ``QNetwork``, its parameters and the ``[K]`` atom values.
      env_params: :class:`~foxhunt_jax.env.trading.EnvParams` of the split.
      state: the batched ``EnvState`` (fields ``[N]``) the rollout starts from.
      mode: ``"collect"``: finished episodes restart at ``reset_bars [L, N]`` (int32 start
        bars); ``"evaluate"``: episode n runs ``lengths[n]`` steps (default L) or until ruin,
        then stays frozen (``alive`` False).
      draws: ``[L, N, B]`` int32 explore draws (:func:`~pallas_kernels.q_forward.apply_draws`;
        -1 = greedy), or None for the greedy policy.
      config, interpret: launch shape and mode (default: the tuning table's for the default
        device, :mod:`pallas_kernels.tuning`).
      stepped: (collect mode) one launch a timestep under ``lax.scan`` instead of one for the
        window; the same results bit for bit (:func:`_run_stepped`).
    Returns:
      ``(out, end_state)``: ``out`` maps each name of ``OUT_F`` / ``OUT_I`` to ``[L, N]`` and
      ``"action"`` to ``[L, N, B]`` int32 (raw step results; the callers mask them); in collect
      mode also ``"greedy"`` ``[L, N, B]`` int32 (the greedy actions before exploration) and
      ``"taken_logits"``, per branch ``[L, N, K]`` float32 logits of the action taken (what
      the agent's collection forward returns per step); ``end_state`` is the
      ``EnvState`` after the last step.
    """
    if mode not in MODES:
        raise ValueError(f"fused_rollout: mode must be one of {MODES}, got {mode!r}")
    if (mode == "collect") != (reset_bars is not None):
        raise ValueError("fused_rollout: reset_bars are required in collect mode and only there")
    if config is None:
        config = for_device().rollout_config(network.dtype)
    n = state.bar.shape[0]
    dim = trading.obs_dim(env_params)
    plan = make_plan(network, dim, config.max_chunk)
    cd = DTYPES[network.dtype]
    nb = len(plan.branch_sizes)
    bm = block_rows_for(n, config)
    rows = -(-n // bm) * bm
    L = int(num_steps)

    feat = jnp.asarray(env_params.features, jnp.float32)
    feat = jnp.pad(feat, ((0, 0), (0, plan.padded(dim) - feat.shape[1])))
    z = jnp.pad(jnp.asarray(support, jnp.float32), (0, plan.atoms_pad - plan.atoms))
    scal = jnp.stack([jnp.asarray(getattr(env_params, s), jnp.float32) for s in _SCALARS])
    # an empty barrier table is never indexed (has_take_profit / has_stop_loss are static)
    tables = [getattr(env_params, t) if getattr(env_params, t).shape[0] else
              jnp.zeros((1,), jnp.float32) for t in _TABLES]
    st_f = _pad_cols(jnp.stack([getattr(state, s).astype(jnp.float32) for s in STATE_F]), rows)
    st_i = _pad_cols(jnp.stack([getattr(state, s).astype(jnp.int32) for s in STATE_I]), rows)
    packed = pack_params(params, plan, network.dtype)
    operands = [packed[k] for k in operand_names(plan)]

    full = lambda a: pl.BlockSpec(a.shape, lambda i, _nd=a.ndim: (0,) * _nd)  # noqa: E731
    cols = lambda k: pl.BlockSpec((k, bm), lambda i: (0, i))  # noqa: E731
    # the step axis of the per-step arrays is indexed by element (offset 0), not by block, and
    # the step count is read at run time, so the kernel's text does not depend on L: XLA
    # compiles a program's launches of one kernel text and grid once, and the launches of a
    # window's spans (``launch_spans``) differ only in L
    step_axis = pl.Element(L)
    inputs = [feat, z, scal] + tables + [st_f, st_i]
    specs = [full(feat), full(z), full(scal)] + [full(a) for a in tables]
    specs += [cols(len(STATE_F)), cols(len(STATE_I))]
    if draws is not None:
        inputs.append(_pad_cols(jnp.transpose(draws.astype(jnp.int32), (0, 2, 1)), rows))
        specs.append(pl.BlockSpec((step_axis, nb, bm), lambda i: (0, 0, i)))
    if mode == "collect":
        inputs.append(_pad_cols(reset_bars.astype(jnp.int32), rows))
        specs.append(pl.BlockSpec((step_axis, bm), lambda i: (0, i)))
    else:
        lens = jnp.full((n,), L, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
        inputs.append(_pad_cols(lens, rows))
        specs.append(pl.BlockSpec((bm,), lambda i: (i,)))
    inputs += operands
    specs += [full(a) for a in operands]

    collect = mode == "collect"
    n_i = len(OUT_I) + nb * (2 if collect else 1)  # the actions, then (collect) greedy ones
    out_shape = [jax.ShapeDtypeStruct((L, len(OUT_F), rows), jnp.float32),
                 jax.ShapeDtypeStruct((L, n_i, rows), jnp.int32),
                 jax.ShapeDtypeStruct((len(STATE_F), rows), jnp.float32),
                 jax.ShapeDtypeStruct((len(STATE_I), rows), jnp.int32)]
    out_specs = [pl.BlockSpec((step_axis, len(OUT_F), bm), lambda i: (0, 0, i)),
                 pl.BlockSpec((step_axis, n_i, bm), lambda i: (0, 0, i)),
                 cols(len(STATE_F)), cols(len(STATE_I))]
    if collect:  # each branch's logits of the action taken
        kp = plan.atoms_pad
        out_shape.append(jax.ShapeDtypeStruct((L, nb, rows, kp), jnp.float32))
        out_specs.append(pl.BlockSpec((step_axis, nb, bm, kp), lambda i: (0, 0, i, 0)))

    env_static = {"episode_length": env_params.episode_length,
                  "time_barrier": env_params.time_barrier,
                  "has_take_profit": env_params.has_take_profit,
                  "has_stop_loss": env_params.has_stop_loss,
                  "fill_next_open": env_params.fill_next_open}
    halves = not stepped and bm <= HALVES_MAX_ROWS
    kernel = functools.partial(_kernel, plan, cd, config.layout, config.lookahead, mode,
                               draws is not None, env_static, stepped, halves)
    if stepped:
        if mode != "collect":
            raise ValueError("fused_rollout: stepped launches are for collect mode")
        outs = _run_stepped(kernel, config, bm, rows, inputs, specs, out_specs, out_shape,
                            interpret, L)
    else:
        outs = launch(kernel, "fused_rollout", config, bm, rows // bm, [_STEP_SPEC] + specs,
                      tuple(out_specs), tuple(out_shape), interpret)(
                          jnp.full((1,), L, jnp.int32), *inputs)
    out_f, out_i, end_f, end_i = outs[:4]

    out = {name: out_f[:, c, :n] for c, name in enumerate(OUT_F)}
    out.update({name: out_i[:, c, :n] for c, name in enumerate(OUT_I)})
    for name in ("terminated", "truncated", "traded", "alive"):
        out[name] = out[name].astype(jnp.bool_)
    out["action"] = jnp.transpose(out_i[:, len(OUT_I):len(OUT_I) + nb, :n], (0, 2, 1))
    if collect:
        out["greedy"] = jnp.transpose(out_i[:, len(OUT_I) + nb:, :n], (0, 2, 1))
        out["taken_logits"] = tuple(outs[4][:, d, :n, :plan.atoms] for d in range(nb))
    fields = {s: end_f[i, :n] for i, s in enumerate(STATE_F)}
    fields.update({s: end_i[i, :n] for i, s in enumerate(STATE_I)})
    return out, trading.EnvState(**fields)


def _run_stepped(kernel, config: KernelConfig, bm: int, rows: int, inputs: list, specs: list,
                 out_specs: list, out_shape: list, interpret, num_steps: int) -> list:
    """The collect kernel launched once a timestep under ``lax.scan``: each launch reads the
    state (and the portfolio features) its predecessor wrote and writes step ``t`` of the
    ``[L, ...]`` outputs in place (aliased buffers), so the scan adds no per-step copies.
    Returns the looped launch's outputs (``out_f, out_i, end_f, end_i, taken``)."""
    at_state = 3 + len(_TABLES)  # inputs: feat, z, scal, tables, st_f, st_i, ...
    cols = pl.BlockSpec((P, bm), lambda i: (0, i))
    in_specs = ([_STEP_SPEC] + specs[:at_state + 2] + [cols] + specs[at_state + 2:]
                + [out_specs[0], out_specs[1], out_specs[4]])
    n_in = len(in_specs)
    # inputs: step, ..., st_f (at_state + 1), st_i, port, ..., out_f, out_i, taken (last three)
    aliases = {n_in - 3: 0, n_in - 2: 1, at_state + 1: 2, at_state + 2: 3, n_in - 1: 4,
               at_state + 3: 5}
    call = launch(kernel, "fused_rollout", config, bm, rows // bm, tuple(in_specs),
                  tuple(out_specs) + (cols,),
                  tuple(out_shape) + (jax.ShapeDtypeStruct((P, rows), jnp.float32),),
                  interpret, aliases)
    fixed_head, fixed_tail = inputs[:at_state], inputs[at_state + 2:]

    def one(carry, t):
        st_f, st_i, port, out_f, out_i, taken = carry
        out_f, out_i, st_f, st_i, taken, port = call(t[None], *fixed_head, st_f, st_i, port,
                                                     *fixed_tail, out_f, out_i, taken)
        return (st_f, st_i, port, out_f, out_i, taken), None

    zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
    carry = (inputs[at_state], inputs[at_state + 1], jnp.zeros((P, rows), jnp.float32),
             zeros(out_shape[0]), zeros(out_shape[1]), zeros(out_shape[4]))
    (st_f, st_i, _, out_f, out_i, taken), _ = jax.lax.scan(
        one, carry, jnp.arange(num_steps, dtype=jnp.int32))
    return [out_f, out_i, st_f, st_i, taken]


def portfolio(out: dict, prefix: str = "portfolio") -> jax.Array:
    """The ``[L, N, P]`` portfolio observation (``prefix="next_portfolio"``: after the step)."""
    return jnp.stack([out[f"{prefix}{j}"] for j in range(P)], axis=-1)


__all__ = ["fused_rollout", "launch_spans", "portfolio", "MODES", "OUT_F", "OUT_I"]
