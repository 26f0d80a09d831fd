"""Side-by-side GPU measurements behind BENCHMARKS.md's "what limits it" notes.

``foxhunt-jax bench`` times the library as configured. This script times the alternatives a
default was chosen from, each in the same process so ratios are fair:

- ``rollout``: launch shapes (rows per program, warps, GEMM block width, weight blocks read
  ahead) of the fused rollout kernel at the seed workload's sizes (collect N = 1024 and
  evaluate N = 64, L = 100) and at N = 2^20;
- ``rolloutpair``: the seed epoch's collection and validation rollouts as two kernel launches of
  one program, with command buffers scheduled as a DAG (the library's) and serialized, and each
  alone;
- ``rollouttail``: the collection rollout in one launch and in two, the Experience phase's
  post-rollout work (priority forwards, curiosity pass) over half the steps' rows alone, and
  that work after the second launch against beside it;
- ``replayadd``: the Experience phase's replay add (the library's scatter under ``vmap``, the
  scatter without it, a select over the whole ring) at the seed's sizes;
- ``replaydraw``: a prioritized draw of 64 and 4,096 from 2^20 and 2^22 slots: the library's;
  the slot inside a block in one pass over the block at every size; the block by a binary
  search above 2^22 draw-block pairs; both (session 17's draw); sub-blocks of 16 slots; each
  alone (one call a draw) and 20 draws in one program, with how often each variant's slot
  differs from the library's;
- ``rndshape``: collection at N = 2^20 (pallas/bf16, with the curiosity pass) under each launch
  shape of the curiosity kernel (``--rnd-shapes``, ``rowsxwarps``, each timed twice in turn);
- ``forward``: the same launch shapes of the Q-forward kernel: greedy actions at N = 2^20, the
  logits at the seed's 102,400 priority rows and at 2^20, and the logits kernel with the greedy
  tail it used to compute;
- ``fwdloop``: one Q-forward's latency at the learner's 64 rows (50 dependent forwards in one
  program), XLA against the fused kernels, and the loss's three forwards side by side;
- ``loopform``: the collection loop as one rollout kernel against a ``lax.scan`` of per-step
  kernels (fused Q-forward, and plain XLA), by N, curiosity off;
- ``rnd``: the curiosity pass over 2^22 observations with each GEMM precision, and its error
  against float64 NumPy for a fresh and a nearly trained predictor;
- ``learner``: the seed's 50 learner steps (the library's pipelined ``train_steps`` with each
  unroll factor of ``--unrolls``) and variants (the loop not pipelined, the taken action's
  logits by a gather, f32 GEMM algorithms, optimizer per tensor, curiosity off, the RND update
  on a CUDA stream of its own, one online forward over s and s', the head output layers and
  the dueling step as one GEMM, the forwards at s' in the fused kernels, the block of a draw
  by a binary search, the clip's norm over the gradient tree, XLA compile options from
  ``--learner-options``), with the number of kernel-launching instructions in each compiled
  program, the longest chain of dependent kernels in its loop body (:func:`critical_path`), and
  how far each variant's parameters end up from the first's. ``--learner-in-trainer N`` also
  times each variant in the trainer's own training program (the numbers to decide by: this
  section's own program, timed one synchronized call at a time, ranked flat parameter vectors
  the other way round, BENCHMARKS.md session 13); ``--learner-trace N`` weighs the loop body's
  chains by traced kernel time (with command buffers off);
- ``compilecache``: the trainer's compile of the seed config, sequential and in three threads,
  cold and from the executable cache (cProfile of the cached one);
- ``compileopts``: the cold compile per program (trace and lower, then XLA) and the seed epoch
  it gives, under each set of XLA flags (``--compile-flag-sets``), each in a fresh process;
- ``compilesweep``: a second config's compile (another ``network.v_max``) after a first filled the
  cache folder, under each setting of JAX's XLA-side caches (``--xla-cache-settings``);
- ``compileprofile``: where a cold compile of the three programs spends its time: the
  profiler's host events summed by name, and XLA's scoped timers from its log;
- ``rndcompile``: the cold compile of the curiosity pass and of a predictor update per GEMM
  precision, each in a fresh process, with the pass's time and error;
- ``kernelcompile``: the cold compile of each rollout kernel alone (collect and evaluate mode, a
  program holding little else), each in a fresh process, to set against the phase programs';
- ``profile``: the GPU kernels of the trainer's epochs under ``jax.profiler``: per phase the
  kernels, their summed and overlapped (busy) time against the phase's wall time, the largest
  kernels, and for the training phase the busy time per learner step; before the trace, in
  untraced epochs, when each phase's call returns and when its results are ready (raw kernel
  and host events of one epoch go to ``--profile-events``).
- ``overlap``: one epoch's Validation and the next Experience as one program (the trainer's
  paired program) against the two programs one after the other, with command buffers scheduled
  as a DAG and serialized;
- ``launch``: a program's launch cost by its number of arguments (a donated pytree of ``n``
  small arrays): how long the call takes to return, and how long until its results are ready.

Usage (GPU)::

    PYTHONPATH=. python3 scripts/explore_gpu.py --json benchmarks/h200_explore3.json

``--quick`` shrinks every size for a CPU check of the code paths (Pallas in interpret mode).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax

from foxhunt_jax.bench import _build_trainer, _variant_cfg, git_commit, spread, time_calls
from foxhunt_jax.jitcache import compiler_options

SECTIONS = ("rollout", "rolloutpair", "rollouttail", "replayadd", "replaydraw", "rndshape",
            "forward", "fwdloop", "loopform", "rnd", "learner", "compilecache", "compileopts",
            "compilesweep", "kernelcompile", "compileprofile", "rndcompile", "profile", "launch",
            "overlap")


def _trainer(args, backend: str, dtype: str, extra: tuple = ()):
    """The trainer of the run's config for one variant (``extra``: more overrides); the market
    is loaded once per run."""
    from foxhunt_jax.data.loader import load_market

    ns = SimpleNamespace(config=args.config, overrides=args.overrides)
    cfg = _variant_cfg(ns, backend, dtype, list(extra))
    if args._market is None:
        args._market = load_market(cfg.data.source, sort=cfg.data.sort,
                                   synthetic=cfg.data.synthetic)
    return _build_trainer(cfg, args._market)


def _setup(args, backend: str, dtype: str, n: int):
    """Trainer pieces for the seed config at N episodes: learner, env params, agent, rollout."""
    from foxhunt_jax.agent.learner import init_agent
    from foxhunt_jax.training import collect
    from foxhunt_jax.training.trainer import TRADING_ADAPTER

    tr = _trainer(args, backend, dtype, (f"train.num_episodes={n}",))
    cfg, learner = tr.cfg, tr.learner
    env_p = tr.env_params["train"]
    agent = jax.jit(lambda k: init_agent(k, learner, tr.obs_dim))(jax.random.key(args.seed))
    rollout = jax.jit(lambda p, k: collect.start(TRADING_ADAPTER, p, k, n))(
        env_p, jax.random.key(args.seed + 1))
    return SimpleNamespace(cfg=cfg, tr=tr, learner=learner, env_p=env_p, agent=agent,
                           rollout=rollout)


def _timed(fn, reps: int) -> dict:
    ms = time_calls(fn, reps, warmup=1)
    return {"ms": statistics.median(ms), "spread": spread(ms)}


def _collect_draws(args, s, steps: int, n: int):
    """The exploration and reset draws a collection call of ``steps`` steps of ``n`` episodes
    makes (epsilon 0.1), from the run's seed; outside the timed kernels."""
    from foxhunt_jax.training.collect import step_keys
    from foxhunt_jax.training.fused import rollout_draws

    return jax.jit(lambda p, k: rollout_draws(
        s.learner.network.branch_sizes, p, step_keys(k, steps), n, jnp.float32(0.1)))(
            s.env_p, jax.random.key(args.seed + 2))


def _time_forms(args, out: dict, forms: dict, params, **row) -> None:
    """Compiles each ``{name: (fn, compile options)}`` of ``forms`` over ``params`` and times
    it (medians of ``args.reps`` calls) into ``out["rows"]``, with ``row``'s fields; forms past
    the deadline go to ``out["skipped"]``."""
    out["rows"] = []
    for name, (fn, opts) in forms.items():
        if time.perf_counter() > args._deadline:
            out.setdefault("skipped", []).append(name)
            continue
        t0 = time.perf_counter()
        f = jax.jit(fn, compiler_options=opts or None).lower(params).compile()
        jax.block_until_ready(f(params))
        res = {"form": name, "options": opts, **row, "first_call_s": time.perf_counter() - t0,
               **_timed(lambda: f(params), args.reps)}
        print(f"  {name}: {res['ms']:.3f} ms (compile and first call {res['first_call_s']:.1f} "
              "s)", flush=True)
        out["rows"].append(res)


def section_rollout(args, out: dict) -> None:
    """The rollout kernel under several launch shapes, same inputs, same process."""
    from pallas_kernels.rollout import fused_rollout

    L = args.length
    cases = [("collect", args.small_n, args.small_shapes), ("evaluate", args.val_n,
                                                            args.small_shapes)]
    if not args.quick:  # in a quick check this would repeat the first case's code path
        cases.append(("collect", args.large_n, args.large_shapes))
    out["rows"] = []
    for mode, n, shapes in cases:
        s = _setup(args, "pallas", "bfloat16", n)
        net = s.learner.network
        draws, resets = _collect_draws(args, s, L, n)
        state = s.rollout.env_state
        reps = 3 if n >= (1 << 18) else args.reps
        runs = [(shape, fused_rollout, "") for shape in shapes]
        for i, path in enumerate(filter(None, (args.compare_rollout or "").split(","))):
            # the same first shape with other versions of the kernel
            runs.insert(1 + i, (shapes[0], _load(path).fused_rollout, path))
        for shape, kernel, source in runs:
            rows, warps, chunk, ahead = shape
            if time.perf_counter() > args._deadline:
                out.setdefault("skipped", []).append(f"{mode} N={n} {shape}")
                continue
            kc = _kernel_config(shape)
            row = {"mode": mode, "n": n, "length": L, "block_rows": rows, "num_warps": warps,
                   "max_chunk": chunk, "lookahead": ahead,
                   "kernel_source": source or "pallas_kernels/rollout.py"}
            try:
                if mode == "collect":
                    f = jax.jit(lambda p, st, d, r, _kc=kc, _k=kernel: _k(
                        p, net, s.learner.support, s.env_p, st, L, mode="collect", draws=d,
                        reset_bars=r, config=_kc))
                    call = lambda: f(s.agent.params, state, draws, resets)  # noqa: E731
                else:
                    f = jax.jit(lambda p, st, _kc=kc, _k=kernel: _k(
                        p, net, s.learner.support, s.env_p, st, L, mode="evaluate", config=_kc))
                    call = lambda: f(s.agent.params, state)  # noqa: E731
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                row["first_call_s"] = time.perf_counter() - t0
                row.update(_timed(call, reps))
                row["us_per_step"] = row["ms"] * 1e3 / L
                row["env_steps_per_s"] = n * L / (row["ms"] * 1e-3)
                print(f"  rollout {mode} N={n} rows={rows} warps={warps} chunk={chunk} "
                      f"ahead={ahead} {source}: {row['ms']:.3f} ms "
                      f"({row['us_per_step']:.1f} us/step, first call {row['first_call_s']:.1f} s)",
                      flush=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  rollout {mode} N={n} {shape}: FAILED {row['error']}", flush=True)
            out["rows"].append(row)
        del s, draws, resets, state


def section_rolloutpair(args, out: dict) -> None:
    """The seed epoch's two rollouts (collection at N = 1,024 on the train split, evaluation of
    the 64 validation windows) as two kernel launches of one program, with the library's XLA
    options (command buffers scheduled as a DAG: the launches run at once) and with command
    buffers serialized, and each alone; same inputs, same process."""
    from foxhunt_jax.env import trading
    from foxhunt_jax.jitcache import SCHEDULING_OPTION
    from foxhunt_jax.training import validate
    from pallas_kernels.rollout import fused_rollout

    L = args.length
    s = _setup(args, "pallas", "bfloat16", args.small_n)
    net, z = s.learner.network, s.learner.support
    val_p = s.tr.env_params["validation"]
    draws, resets = _collect_draws(args, s, L, args.small_n)
    starts = jnp.asarray(validate.window_starts(np.asarray(val_p.starts), args.val_n))
    _, val_state = jax.jit(jax.vmap(trading.reset_at, in_axes=(0, None)))(starts, val_p)
    first = dict(network=net, support=z, env_params=s.env_p, state=s.rollout.env_state,
                 num_steps=L, draws=draws, reset_bars=resets)
    second = dict(network=net, support=z, env_params=val_p, state=val_state, num_steps=L,
                  mode="evaluate")
    both = lambda p: (fused_rollout(p, **first), fused_rollout(p, **second))  # noqa: E731
    library = compiler_options()
    forms = {"collect alone": (lambda p: fused_rollout(p, **first), library),
             "evaluate alone": (lambda p: fused_rollout(p, **second), library),
             "both, two launches": (both, library),
             "both, two launches, command buffers serialized":
                 (both, {**library, SCHEDULING_OPTION: "SERIALIZE"})}
    _time_forms(args, out, forms, s.agent.params)


def section_rollouttail(args, out: dict) -> None:
    """Can the Experience phase's work after its rollout (the three no-gradient forwards of the
    initial priorities and the curiosity pass) run beside the rollout kernel, which holds 64 of
    the GPU's multiprocessors at the seed's N = 1,024? The collection rollout in one launch of
    L steps and in two of L/2, the tail's work over the rows of L/2 steps alone, and both in one
    program: the tail of the first half's rows after the first half, beside the second half
    (what a rollout in chunks would do), against after both halves. Same inputs, medians."""
    from foxhunt_jax.agent import curiosity
    from foxhunt_jax.agent.network import q_forward, taken_logits
    from pallas_kernels.rollout import fused_rollout

    L, half = args.length, args.length // 2
    s = _setup(args, "pallas", "bfloat16", args.small_n)
    net, z, rnd = s.learner.network, s.learner.support, s.agent.rnd
    draws, resets = _collect_draws(args, s, L, args.small_n)
    rows = half * args.small_n
    k1, k2, k3 = jax.random.split(jax.random.key(args.seed + 3), 3)
    obs = jax.random.normal(k1, (rows, s.tr.obs_dim), jnp.float32)
    next_obs = jax.random.normal(k2, (rows, s.tr.obs_dim), jnp.float32)
    acts = jnp.stack([jax.random.randint(k, (rows,), 0, n) for k, n in
                      zip(jax.random.split(k3, len(net.branch_sizes)), net.branch_sizes)], 1)

    def roll(p, state, lo, hi):
        return fused_rollout(p, net, z, s.env_p, state, hi - lo, draws=draws[lo:hi],
                             reset_bars=resets[lo:hi])

    def tail(p, after):  # `after`: a value the work must wait for (0.0, added to its input)
        o, o2 = obs + after, next_obs + after
        _, best = q_forward(p, o2, net, z, "pallas")
        return (taken_logits(p, o, acts, net, "pallas"), taken_logits(p, o2, best, net, "pallas"),
                curiosity.prediction_error(rnd, o2))

    def wait_on(traj):
        return 0.0 * traj[0]["reward"][-1, 0]

    def chunked(p, tail_after_first: bool):
        t1, end1 = roll(p, s.rollout.env_state, 0, half)
        t2, end2 = roll(p, end1, half, L)
        return t1, t2, tail(p, wait_on((t1,) if tail_after_first else (t2,)))

    forms = {"rollout, one launch of L steps": lambda p: roll(p, s.rollout.env_state, 0, L),
             "rollout, two launches of L/2": lambda p: chunked(p, True)[:2],
             "tail work of L/2 steps' rows alone": lambda p: tail(p, 0.0),
             "two launches, the tail after the second": lambda p: chunked(p, False),
             "two launches, the tail after the first (beside the second)":
                 lambda p: chunked(p, True)}
    library = compiler_options()
    _time_forms(args, out, {k: (fn, library) for k, fn in forms.items()}, s.agent.params,
                tail_rows=rows)


def section_replaydraw(args, out: dict) -> None:
    """Variants of the prioritized draw (``replay.sample``) by capacity and batch."""
    from foxhunt_jax.agent import replay

    caps = (1 << 12, 1 << 14) if args.quick else (1 << 20, 1 << 22)
    batches = (16, 256) if args.quick else (64, 4096)
    loop = 4 if args.quick else 20
    example = {"bar": jnp.zeros((2,), jnp.int32), "x": jnp.zeros((16,), jnp.float32)}
    variants = {  # module constants of replay patched while each variant is traced
        "library": {},
        "whole_blocks": {"_WHOLE_BLOCKS_MAX": 1 << 40},
        "binary_search_over_2^22": {"_COUNT_MAX": 1 << 22},
        "session17": {"_WHOLE_BLOCKS_MAX": 1 << 40, "_COUNT_MAX": 1 << 22},
        "sub_block_16": {"_SUB_BLOCK": 16},
    }
    out["rows"] = []
    for cap in caps:
        state = replay.init(example, cap)
        raw = jax.random.gamma(jax.random.key(cap), 0.5, (cap,)) ** 0.6
        state = state.replace(priorities=raw.at[-cap // 64:].set(0.0),
                              size=jnp.asarray(cap, jnp.int32))
        keys = jax.random.split(jax.random.key(args.seed), 64)
        for m in batches:
            ref = None
            for name, patch in variants.items():
                with contextlib.ExitStack() as stack:
                    for attr, value in patch.items():
                        stack.enter_context(mock.patch.object(replay, attr, value))
                    one = jax.jit(lambda st, k, m=m: replay.sample(st, k, m, 0.4)).lower(
                        state, keys[0]).compile()

                    def many(st, k, m=m):
                        def body(i, acc):
                            items, idx, w = replay.sample(st, jax.random.fold_in(k, i), m, 0.4)
                            return acc + jnp.sum(idx) + jnp.sum(items["x"]) + jnp.sum(w)
                        return jax.lax.fori_loop(0, loop, body, jnp.zeros((), jnp.float32))
                    many = jax.jit(many).lower(state, keys[0]).compile()
                idx = np.concatenate([np.asarray(one(state, k)[1]) for k in keys[:8]])
                ref = idx if ref is None else ref
                it = itertools.cycle(list(keys))
                row = {"capacity": cap, "batch": m, "variant": name,
                       "differs_from_library": float(np.mean(idx != ref)),
                       "empty_slot_drawn": bool(np.any(np.asarray(state.priorities)[idx] == 0)),
                       "call": _timed(lambda: one(state, next(it)), args.reps),
                       "per_draw_in_loop": _timed(lambda: many(state, next(it)), args.reps)}
                loop_ms = row["per_draw_in_loop"]  # a call of `loop` draws -> per draw
                row["per_draw_in_loop"] = {"ms": loop_ms["ms"] / loop, "spread": {
                    k: (v if k == "n" else v / loop) for k, v in loop_ms["spread"].items()}}
                out["rows"].append(row)
                print(f"  C={cap} M={m} {name}: call {row['call']['ms']:.3f} ms, in a loop "
                      f"{row['per_draw_in_loop']['ms'] * 1e3:.1f} us/draw, differs "
                      f"{row['differs_from_library']:.1e}, empty {row['empty_slot_drawn']}",
                      flush=True)


def section_rndshape(args, out: dict) -> None:
    """Collection at ``args.large_n`` episodes with each curiosity-kernel launch shape: the
    shapes in turn, twice over, each its own program (``rnd.DEFAULT_CONFIG`` patched while it
    is traced)."""
    from foxhunt_jax.bench import make_rollout
    from foxhunt_jax.training.trainer import TRADING_ADAPTER
    from pallas_kernels import rnd
    from pallas_kernels.q_forward import KernelConfig

    n = args.large_n
    s = _setup(args, "pallas", "bfloat16", n)
    eps = jnp.float32(0.1)
    runs = {}
    for rows, warps in args.rnd_shapes:
        config = KernelConfig(block_rows=rows, num_warps=warps, min_warps=warps)
        with mock.patch.object(rnd, "DEFAULT_CONFIG", config):
            runs[f"{rows}x{warps}"] = jax.jit(make_rollout(
                s.learner, TRADING_ADAPTER, s.env_p, args.length)).lower(
                s.agent, s.rollout, jax.random.key(0), eps).compile()
    out["rows"] = []
    keys = itertools.cycle(jax.random.split(jax.random.key(args.seed + 2), 8))
    for turn in range(2):
        for name, run in runs.items():
            reps = 3 if n > 4096 else 5
            row = {"shape": name, "turn": turn, "n": n,
                   **_timed(lambda: run(s.agent, s.rollout, next(keys), eps), reps)}
            row["env_steps_per_s"] = n * args.length / (row["ms"] * 1e-3)
            out["rows"].append(row)
            print(f"  collect N={n} rnd {name} (turn {turn}): {row['ms']:.2f} ms, "
                  f"{row['env_steps_per_s'] / 1e9:.3f}e9 env-steps/s", flush=True)


def section_forward(args, out: dict) -> None:
    """The Q-forward kernel's launch shapes (``--forward-shapes``): greedy actions at N = 2^20,
    and the logits (``fused_logits``; and the same kernel also computing the greedy tail, as
    before it stopped at the logits) at the seed's 102,400 priority rows and at 2^20."""
    from pallas_kernels import q_forward as qf

    tr = _trainer(args, "pallas", "bfloat16")  # the run's config: its network and observations
    net, z, dim = tr.learner.network, tr.learner.support, tr.obs_dim
    params = jax.jit(net.init)(jax.random.key(args.seed), jnp.zeros((1, dim)))
    kinds = {
        "actions": lambda p, o, kc: qf.fused_q_forward(p, o, net, z, with_q=False, config=kc)[1],
        "logits": lambda p, o, kc: qf.fused_logits(p, o, net, config=kc),
        "logits_and_actions": lambda p, o, kc: qf._run(p, o, net, z, False, True, kc, None)[1],
    }
    cases = [("actions", args.large_n), ("logits", args.prio_rows),
             ("logits_and_actions", args.prio_rows), ("logits", args.large_n)]
    out["rows"] = []
    for kind, n in cases:
        obs = jax.random.normal(jax.random.key(args.seed + 1), (n, dim), jnp.float32)
        for shape in args.forward_shapes:
            if time.perf_counter() > args._deadline:
                out.setdefault("skipped", []).append(f"{kind} N={n} {shape}")
                continue
            row = {"kind": kind, "n": n, "block_rows": shape[0], "num_warps": shape[1],
                   "max_chunk": shape[2], "lookahead": shape[3]}
            try:
                f = jax.jit(lambda p, o, _kc=_kernel_config(shape), _k=kinds[kind]: _k(p, o, _kc))
                t0 = time.perf_counter()
                jax.block_until_ready(f(params, obs))
                row["first_call_s"] = time.perf_counter() - t0
                row.update(_timed(lambda: f(params, obs), args.reps))
                print(f"  forward {kind} N={n} {shape}: {row['ms']:.3f} ms "
                      f"(first call {row['first_call_s']:.1f} s)", flush=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  forward {kind} N={n} {shape}: FAILED {row['error']}", flush=True)
            out["rows"].append(row)


def section_fwdloop(args, out: dict) -> None:
    """Latency of one Q-forward at the learner's batch (64 rows): a ``lax.scan`` of 50 forwards,
    each one's observations waiting on the one before (plus a tiny multiple of its output's
    mean), so a forward's time is the program's over 50. XLA (Flax) against the fused kernels
    (logits, the chosen actions' logits, greedy actions; ``--forward-shapes`` launch shapes),
    and the three forwards a C51 double-Q loss needs (online at s, online greedy at s', target
    at s') side by side in one iteration."""
    from foxhunt_jax.agent.network import q_forward, taken_logits
    from pallas_kernels import q_forward as qf

    tr = _trainer(args, "pallas", "bfloat16")
    net, z, dim = tr.learner.network, tr.learner.support, tr.obs_dim
    m, iters = args.batch_rows, 50
    params = jax.jit(net.init)(jax.random.key(args.seed), jnp.zeros((1, dim)))
    target = jax.tree.map(lambda x: x * 1.01, params)
    obs0 = jax.random.normal(jax.random.key(args.seed + 1), (m, dim), jnp.float32)
    acts = jnp.zeros((m, len(net.branch_sizes)), jnp.int32)

    def mean_of(tree):
        leaves = jax.tree.leaves(tree)
        return sum(jnp.mean(x.astype(jnp.float32)) for x in leaves) / len(leaves)

    def looped(one):  # params -> program of `iters` dependent forwards
        def prog(p):
            def body(o, _):
                return o + 1e-12 * mean_of(one(p, o)), None
            return jax.lax.scan(body, obs0, None, length=iters)[0]
        return prog

    def three(backend):  # the loss's three forwards in one iteration
        def one(p, o):
            _, best = q_forward(p, o, net, z, backend)
            return (taken_logits(p, o, acts, net, backend),
                    taken_logits(target, o, best, net, backend))
        return one

    def three_full_target(p, o):  # the target's logits of every action beside the greedy
        _, best = q_forward(p, o, net, z, "pallas")
        return (taken_logits(p, o, acts, net, "pallas"), qf.fused_logits(target, o, net), best)

    forms = {"xla_logits": (looped(lambda p, o: net.apply(p, o)), None),
             "xla_taken": (looped(lambda p, o: taken_logits(p, o, acts, net)), None),
             "xla_three": (looped(three("xla")), None),
             "pallas_three": (looped(three("pallas")), None),
             "pallas_three_full_target": (looped(three_full_target), None),
             "pallas_greedy": (looped(lambda p, o: q_forward(p, o, net, z, "pallas")[1]), None)}
    for shape in (None,) + tuple(args.forward_shapes):
        kc = None if shape is None else _kernel_config(shape)
        tag = "default" if shape is None else "x".join(str(v) for v in shape[:3] if v) + (
            f"p{shape[3]}" if shape[3] else "")
        forms[f"pallas_logits_{tag}"] = (looped(
            lambda p, o, _kc=kc: qf.fused_logits(p, o, net, config=_kc)), None)
        forms[f"pallas_taken_{tag}"] = (looped(
            lambda p, o, _kc=kc: qf.fused_logits(p, o, net, actions=acts, config=_kc)), None)
    _time_forms(args, out, forms, params, rows=m, iters=iters)
    for row in out["rows"]:
        row["us_per_forward"] = row["ms"] * 1e3 / iters
        print(f"  {row['form']}: {row['us_per_forward']:.1f} us an iteration", flush=True)


def _in_trainer(tr, learner, state, swaps: list, calls: int, steps: int,
                options: dict | None = None) -> dict:
    """A learner variant timed in the trainer's own training program (its shardings, donated
    state, the env's tables as arguments), compiled with the library's options and
    ``options`` over them: ``calls`` calls queued back to back, each taking the state the one
    before returned, so the host's dispatch of one call overlaps the GPU's work on the one
    before; three such runs, the median. The explore program above is timed one synchronized
    call at a time, dispatch included."""
    trv = dataclasses.replace(tr, learner=learner, _phases=None)
    state = jax.device_put(state, trv.shardings(state))
    with contextlib.ExitStack() as swapped:
        for module, name, value in swaps:
            swapped.enter_context(mock.patch.object(module, name, value))
        fn, fargs = trv.phase_programs(state)["training"]
        # jax merges these with the options the program was jitted with
        compiled = fn.lower(*fargs).compile(compiler_options=options or None)
    p, sched = fargs[0], fargs[2]
    st = jax.tree.map(jnp.copy, state)
    st, _ = compiled(p, st, sched)  # warm-up
    jax.block_until_ready(st)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            st, m = compiled(p, st, sched)
        jax.block_until_ready((st, m))
        runs.append((time.perf_counter() - t0) * 1e3 / calls)
    ms = statistics.median(runs)
    return {"trainer_ms": ms, "trainer_runs_ms": runs, "trainer_us_per_step": ms * 1e3 / steps}


def _pallas_next_loss(full_target: bool):
    """per_sample_loss with the two forwards at s' (no gradient) in the fused kernels: the
    online greedy actions, and the target's logits of those actions (``full_target``: of every
    action, computed beside the greedy kernel and selected after it)."""
    from foxhunt_jax.agent.loss import c51_loss
    from foxhunt_jax.agent.network import q_forward, select_action, taken_logits
    from pallas_kernels.q_forward import fused_logits

    def loss(learner, params, target_params, obs, next_obs, action, returns, discount,
             backend="xla"):
        net, z = learner.network, learner.support
        _, best = q_forward(jax.lax.stop_gradient(params), next_obs, net, z, "pallas")
        if full_target:
            tl = fused_logits(target_params, next_obs, net)
            target = tuple(select_action(l, best[:, d]) for d, l in enumerate(tl))
        else:
            target = taken_logits(target_params, next_obs, best, net, "pallas")
        return c51_loss(taken_logits(params, obs, action, net, backend), target, returns,
                        discount, z)
    return loss


def section_loopform(args, out: dict) -> None:
    """collect.trajectory three ways, curiosity off: rollout kernel, scan of fused forwards,
    scan of XLA forwards (all bfloat16)."""
    from foxhunt_jax.training import collect
    from foxhunt_jax.training.trainer import TRADING_ADAPTER

    L = args.length
    no_kernel = dataclasses.replace(TRADING_ADAPTER, fused=None)
    forms = (("rollout_kernel", "pallas", TRADING_ADAPTER), ("scan_fused_forward", "pallas",
                                                              no_kernel),
             ("scan_xla", "xla", TRADING_ADAPTER))
    out["rows"] = []
    forms = [f for f in forms if f[0] in args.loop_forms.split(",")]
    for n in args.loop_n:
        for name, backend, adapter in forms:
            if time.perf_counter() > args._deadline:
                out.setdefault("skipped", []).append(f"{name} N={n}")
                continue
            row = {"form": name, "n": n, "length": L}
            try:
                s = _setup(args, backend, "bfloat16", n)
                f = jax.jit(lambda a, r, k, _s=s, _ad=adapter: collect.trajectory(
                    _s.learner, _ad, _s.env_p, a.params, r, k, jnp.float32(0.1), L))
                keys = iter(jax.random.split(jax.random.key(args.seed + 3), 64))
                reps = 3 if n >= (1 << 18) else args.reps
                row.update(_timed(lambda: f(s.agent, s.rollout, next(keys)), reps))
                row["env_steps_per_s"] = n * L / (row["ms"] * 1e-3)
                print(f"  loopform {name} N={n}: {row['ms']:.2f} ms "
                      f"({row['env_steps_per_s'] / 1e9:.3f}e9 env-steps/s)", flush=True)
                del s, f
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  loopform {name} N={n}: FAILED {row['error']}", flush=True)
            out["rows"].append(row)


def _rnd_forward(params, x, precision, dtype):
    """The RND MLP (curiosity.RNDNetwork's math) with a chosen GEMM precision / input dtype."""
    p = params["params"]
    for name in ("hidden_0", "hidden_1", "out"):
        w, b = p[name]["kernel"], p[name]["bias"]
        y = jnp.dot(x.astype(dtype), w.astype(dtype), precision=precision,
                    preferred_element_type=jnp.float32) + b
        x = jnp.maximum(y, 0.0) if name != "out" else y
    return x


def _rnd_forward64(params, x):
    p = params["params"]
    for name in ("hidden_0", "hidden_1", "out"):
        y = x @ np.asarray(p[name]["kernel"], np.float64) + np.asarray(p[name]["bias"], np.float64)
        x = np.maximum(y, 0.0) if name != "out" else y
    return x


def _rnd_precisions() -> dict:
    """The curiosity pass's candidate GEMM precisions: name -> (precision, input dtype)."""
    variants = {"f32_highest": (jax.lax.Precision.HIGHEST, jnp.float32),
                "f32_default": (jax.lax.Precision.DEFAULT, jnp.float32),
                "bf16": (None, jnp.bfloat16)}
    preset = getattr(jax.lax, "DotAlgorithmPreset", None)
    if preset is not None and jax.default_backend() == "gpu":
        variants["bf16x3"] = (preset.BF16_BF16_F32_X3, jnp.float32)
        variants["bf16x6"] = (preset.BF16_BF16_F32_X6, jnp.float32)
        variants["tf32x3"] = (preset.TF32_TF32_F32_X3, jnp.float32)
        variants["f32_preset"] = (preset.F32_F32_F32, jnp.float32)
    return variants


def section_rnd(args, out: dict) -> None:
    """Raw novelty of 2^22 observations per GEMM precision: time and error against float64."""
    from foxhunt_jax.agent import curiosity
    from foxhunt_jax.config import CuriosityConfig

    cfg = CuriosityConfig()
    dim, m = args.obs_dim, args.rnd_rows
    rnd = curiosity.init(jax.random.key(args.seed), dim, cfg)
    x = jax.random.normal(jax.random.key(args.seed + 4), (m, dim), jnp.float32)
    # a nearly trained predictor: the target plus 1% noise, so errors are small, as late in a run
    near = jax.tree.map(lambda t, k: t * (1 + 0.01 * jax.random.normal(k, t.shape)),
                        rnd.target_params, {"params": {n: {"kernel": jax.random.key(i),
                                                           "bias": jax.random.key(i + 9)}
                                                       for i, n in enumerate(
                                                           ("hidden_0", "hidden_1", "out"))}})
    variants = _rnd_precisions()
    if args.rnd_variants:
        variants = {k: v for k, v in variants.items() if k in args.rnd_variants.split(",")}
    xs = np.asarray(x[:4096], np.float64)
    out["rows"] = []
    for name, (prec, dt) in variants.items():
        row = {"variant": name, "rows": m, "obs_dim": dim}
        try:
            def err(pred, tgt, xx, _p=prec, _d=dt):
                return jnp.sum(jnp.square(_rnd_forward(pred, xx, _p, _d)
                                          - _rnd_forward(tgt, xx, _p, _d)), axis=-1)
            f = jax.jit(err)
            row.update(_timed(lambda: f(rnd.predictor_params, rnd.target_params, x), args.reps))
            for label, pred in (("fresh", rnd.predictor_params), ("near", near)):
                ref = np.sum(np.square(_rnd_forward64(pred, xs)
                                       - _rnd_forward64(rnd.target_params, xs)), axis=-1)
                got = np.asarray(f(pred, rnd.target_params, x[:4096]), np.float64)
                row[f"max_rel_err_{label}"] = float(np.max(np.abs(got - ref) / ref))
            print(f"  rnd {name}: {row['ms']:.3f} ms for {m} rows, rel err fresh "
                  f"{row['max_rel_err_fresh']:.2e}, near {row['max_rel_err_near']:.2e}",
                  flush=True)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  rnd {name}: FAILED {row['error']}", flush=True)
        out["rows"].append(row)


_LAUNCH = re.compile(r"\b(fusion|custom-call|copy-start|all-reduce)\(")


def kernel_count(compiled_text: str) -> int:
    """Kernel-launching instructions (fusions, library calls) in an optimized HLO module."""
    return sum(1 for line in compiled_text.splitlines() if _LAUNCH.search(line))


_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][a-z\-]*)\((.*)$")
_CALLEE = re.compile(r"\b(?:to_apply|body|calls|branch_computations|true_computation|"
                     r"false_computation)=(\{[^}]*\}|%[\w.\-]+)")


def _computations(text: str) -> dict:
    """``{name: [(instruction, opcode, operands, callees)]}`` of an HLO module's text."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = comps.setdefault(m.group(1), [])
            continue
        m = _INSTR.match(line) if cur is not None else None
        if m:
            name, op, rest = m.groups()
            callees = [c for g in _CALLEE.findall(rest) for c in re.findall(r"%([\w.\-]+)", g)]
            cur.append((name, op, re.findall(r"%([\w.\-]+)", rest), callees))
    return comps


def critical_path(text: str, weights: dict | None = None) -> dict:
    """The loop body of a compiled program with the most kernel-launching instructions: its
    kernels and the longest chain of them that depend one on another (a command-buffer
    ``call`` counts its callee's chain, a ``while`` its body's, once). A learner step cannot
    take fewer than that many kernels one after another.

    ``weights`` (``{kernel name: us}``, names as the profiler shows them: the instruction's
    with ``.`` as ``_``): also the chain with the most kernel time (``loop_body_timed_*``)."""
    comps = _computations(text)
    bodies = {c for ins in comps.values() for _, op, _, callees in ins if op == "while"
              for c in callees[:1]}
    counted = _longest_chains(comps, lambda name: 1.0, bodies)
    rows = sorted(((counted[b][1], counted[b][0], b) for b in bodies if b in counted),
                  reverse=True)
    if not rows:
        return {}
    kernels, chain, name = rows[0]
    out = {"loop_body": name, "loop_body_kernels": int(kernels), "loop_body_chain": int(chain),
           "loop_body_chain_kernels": counted[name][2]}
    if weights is not None:
        us_of = _instruction_us(text, weights)
        timed = _longest_chains(comps, lambda k: us_of.get(k, 0.0), [name])
        us, _, kernels_on = timed[name]
        out.update(loop_body_timed_chain_us=us, loop_body_timed_chain=[
            [k, round(us_of.get(k, 0.0), 2)] for k in kernels_on])
    return out


_DEDUP = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?deduplicated_name="([\w.\-]+)"')


def _instruction_us(text: str, kernel_us: dict) -> dict:
    """``{instruction: us}`` from the traced ``{kernel name: us}``. XLA launches one kernel for
    the instructions it found identical (one ``deduplicated_name``), and the trace names that
    kernel after one of them, not always the one the group is named after; the group's time is
    shared out evenly among its instructions."""
    group = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            d = _DEDUP.match(line)
            group[m.group(1)] = d.group(2) if d else m.group(1)
    by_trace_name = {name.replace(".", "_"): g for name, g in group.items()}
    size, us = {}, {}
    for g in group.values():
        size[g] = size.get(g, 0) + 1
    for k, v in kernel_us.items():
        g = by_trace_name.get(k)
        if g is not None:
            us[g] = us.get(g, 0.0) + v
    return {name: us[g] / size[g] for name, g in group.items() if g in us}


def _longest_chains(comps: dict, weight, roots) -> dict:
    """``{computation: (longest chain's weight, kernels, the chain's kernels)}`` for ``roots``
    and the computations they call: each kernel counts ``weight(name)``, a ``call``/``while``/
    ``conditional`` its callees' longest chain."""
    memo = {}

    def depth(comp: str) -> tuple[float, int, list]:
        if comp in memo:
            return memo[comp]
        memo[comp] = (0.0, 0, [])
        instrs = comps.get(comp, [])
        defined, longest, total, best = {i[0] for i in instrs}, {}, 0, 0.0
        via, end = {}, None
        for name, op, operands, callees in instrs:
            if op in ("fusion", "custom-call", "copy-start", "all-reduce", "sort"):
                own, n, sub_chain = weight(name), 1, [name]
            elif op in ("call", "while", "conditional"):
                sub = [depth(c) for c in callees if c in comps]
                top = max(sub, key=lambda x: x[0], default=(0.0, 0, []))
                own, n, sub_chain = top[0], sum(k for _, k, _ in sub), top[2]
            else:
                own, n, sub_chain = 0.0, 0, []
            total += n
            prev = max((o for o in operands if o in defined and o in longest),
                       key=longest.get, default=None)
            longest[name] = own + (longest[prev] if prev else 0.0)
            via[name] = (prev, sub_chain if n else [])
            if end is None or longest[name] > best:
                best, end = longest[name], name
        chain = []
        while end is not None:  # the chain's kernels, last to first
            chain = via[end][1] + chain
            end = via[end][0]
        memo[comp] = (best, total, chain)
        return memo[comp]

    for c in roots:
        depth(c)
    return memo


def _step_kernel_us(trace_dir: str, steps: int) -> dict:
    """``{kernel name: us per learner step}`` from the traces under ``trace_dir`` (``steps``
    learner steps traced in all)."""
    per = {}
    for path in Path(trace_dir).rglob("*.xplane.pb"):
        _, kernels, _, _ = _gpu_events(str(path))
        for start, end, _, name in kernels:
            per[name] = per.get(name, 0.0) + (end - start) / 1e3
    return {k: v / steps for k, v in per.items()}


def _concat_online_loss(learner, params, target_params, obs, next_obs, action, returns,
                        discount):
    """per_sample_loss with the two online forwards as one over ``[2M, D]`` rows."""
    from foxhunt_jax.agent.loss import c51_double_q_loss

    m = obs.shape[0]
    both = learner.network.apply(params, jnp.concatenate([obs, next_obs]))
    target_next = learner.network.apply(target_params, next_obs)
    return c51_double_q_loss(tuple(x[:m] for x in both), tuple(x[m:] for x in both),
                             target_next, action, returns, discount, learner.support)


def _block_head_network(network):
    """The network with its four head output layers and the dueling combination as ONE GEMM.

    The same parameter tree and the same function as ``QNetwork``: the dueling step is linear,
    so ``V + A_d - mean_a A_d`` equals ``[h_v, h_0, .., h_{B-1}] @ W + b`` with ``W`` holding
    the value layer tiled over every branch's actions and each advantage layer with its mean
    over actions subtracted (block-diagonal). A candidate for fewer kernels a learner step.
    """
    import flax.linen as nn

    from foxhunt_jax.agent import network as network_mod

    class _LayerParams(nn.Module):
        features: int
        in_features: int

        @nn.compact
        def __call__(self):
            k = self.param("kernel", nn.initializers.lecun_normal(),
                           (self.in_features, self.features), jnp.float32)
            b = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
            return k, b

    class BlockHeadQNetwork(network_mod.QNetwork):
        @nn.compact
        def __call__(self, obs):
            cd = network_mod._COMPUTE_DTYPES[self.dtype]
            h = jnp.asarray(obs, jnp.float32)
            for i, width in enumerate(self.trunk):
                h = nn.relu(network_mod.Dense(width, cd, name=f"trunk_{i}")(h))
            hidden = [nn.relu(network_mod.Dense(self.head, cd, name="value_hidden")(h))]
            hidden += [nn.relu(network_mod.Dense(self.head, cd, name=f"adv{d}_hidden")(h))
                       for d in range(len(self.branch_sizes))]
            k, hd = self.atoms, self.head
            wv, bv = _LayerParams(k, hd, name="value_out")()
            total = sum(self.branch_sizes) * k
            value_rows, adv_rows, biases, col = [], [], [], 0
            for d, n_d in enumerate(self.branch_sizes):
                wa, ba = _LayerParams(n_d * k, hd, name=f"adv{d}_out")()
                wa = wa.reshape(hd, n_d, k)
                wa = (wa - jnp.mean(wa, axis=1, keepdims=True)).reshape(hd, n_d * k)
                ba = ba.reshape(n_d, k)
                biases.append((bv[None, :] + ba - jnp.mean(ba, axis=0, keepdims=True)).reshape(-1))
                value_rows.append(jnp.tile(wv, (1, n_d)))
                adv_rows.append(jnp.pad(wa, ((0, 0), (col, total - col - n_d * k))))
                col += n_d * k
            w = jnp.concatenate([jnp.concatenate(value_rows, axis=1)] + adv_rows, axis=0)
            x = jnp.concatenate(hidden, axis=-1)
            rows = int(np.prod(x.shape[:-1]))
            prec = network_mod.f32_precision(rows) if cd == jnp.float32 else None
            y = jnp.dot(x.astype(cd), w.astype(cd), precision=prec,
                        preferred_element_type=jnp.float32) + jnp.concatenate(biases)
            out, col = [], 0
            for n_d in self.branch_sizes:
                out.append(y[..., col:col + n_d * k].reshape(y.shape[:-1] + (n_d, k)))
                col += n_d * k
            return tuple(out)

    return BlockHeadQNetwork(branch_sizes=network.branch_sizes, trunk=network.trunk,
                             head=network.head, atoms=network.atoms, dtype=network.dtype)


def _gather_select(logits_d, action):
    """``network.select_action`` as it was before session 9: a gather (its gradient a
    scatter-add)."""
    return jnp.take_along_axis(logits_d, action[:, None, None], axis=1)[:, 0, :]


def _options(variant: str) -> dict:
    """XLA compile options of a learner variant ``xla:name=value,name=value``, else none."""
    if not variant.startswith("xla:"):
        return {}
    out = {}
    for item in variant[4:].split(","):
        k, v = item.split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    return out


def _side_stream(fn, stream: int = 1):
    """``fn`` as a call on CUDA stream ``stream`` of its own (XLA's stream annotation); the
    ``compute_on`` form of jax 0.11 and 0.10 (``compute_on2``)."""
    from jax.experimental import compute_on as co

    annotate = getattr(co, "compute_on2", co.compute_on)
    return annotate(jax.jit(fn), compute_type=f"gpu_stream:{stream}",
                    out_memory_spaces=jax.memory.Space.Device)


def section_learner(args, out: dict) -> None:
    """The seed's K learner steps (the library's loop, unrolled by each factor of ``--unrolls``)
    and variants; kernels per program."""
    from foxhunt_jax.agent import curiosity as curiosity_mod
    from foxhunt_jax.agent import learner as learner_mod
    from foxhunt_jax.agent import network as network_mod
    from foxhunt_jax.agent import replay as replay_mod
    from foxhunt_jax.agent.learner import learner_step, train_steps
    from foxhunt_jax.env import trading
    from foxhunt_jax.training.trainer import experience_phase

    out["rows"] = []
    for dtype in args.learner_dtypes.split(","):
        s = _setup(args, "xla", dtype, args.small_n)
        tr = s.tr
        state = tr.init_state()
        # epsilon 0.5 in every epoch (schedule_values' layout: epsilon start, end, span, beta's)
        sched = jnp.asarray([0.5, 0.5, 1.0, 0.4, 0.4, 1.0], jnp.float32)
        exp = jax.jit(lambda p, st: experience_phase(s.learner, s.cfg, p, st, sched))
        for _ in range(2):  # a buffer with 2 epochs of transitions
            state, _ = exp(s.env_p, state)
        decode = lambda it: (trading.decode(it["obs"], s.env_p),  # noqa: E731
                             trading.decode(it["next_obs"], s.env_p))
        k = s.cfg.train.train_steps
        runs = [(u, "base") for u in args.unrolls]
        runs += [(1, v) for v in args.learner_variants.split(",") if v and v != "base"]
        runs += [(1, "xla:" + o) for o in args.learner_options.split(";") if o]
        base_params = None
        for unroll, variant in runs:
            if time.perf_counter() > args._deadline:
                out.setdefault("skipped", []).append(f"{dtype} unroll={unroll} {variant}")
                continue
            row = {"dtype": dtype, "train_steps": k, "batch": s.cfg.train.batch_size,
                   "unroll": unroll, "variant": variant}
            learner, agent = s.learner, state.agent
            # (module, attribute, value) swapped in for this variant's trace only (the library
            # is unchanged until a variant wins, measured)
            swaps = []
            if variant == "tree_adam":  # the optimizer chain per tensor (before optax.flatten)
                t = s.cfg.train
                learner = dataclasses.replace(learner, optimizer=optax.chain(
                    optax.clip_by_global_norm(t.max_grad_norm),
                    optax.adam(t.learning_rate, eps=t.adam_eps)))
                agent = agent.replace(opt_state=learner.optimizer.init(agent.params))
            elif variant == "no_rnd":  # curiosity off: no RND predictor update in the step
                agent = agent.replace(rnd=None)
            elif variant == "concat_online":  # online(s) and online(s') as one forward
                swaps.append((learner_mod, "per_sample_loss", _concat_online_loss))
            elif variant == "binary_search":  # the block of a draw by an unrolled binary
                swaps.append((replay_mod, "_count_at_or_below",  # search, as before session 13
                              functools.partial(replay_mod._count_at_or_below, count_max=0)))
            elif variant == "norm_tree":  # the clip's norm over the gradient tree, before
                t = s.cfg.train  # the concatenation optax.flatten makes for Adam
                learner = dataclasses.replace(learner, optimizer=optax.chain(
                    optax.clip_by_global_norm(t.max_grad_norm),
                    optax.flatten(optax.adam(t.learning_rate, eps=t.adam_eps))))
                agent = agent.replace(opt_state=learner.optimizer.init(agent.params))
            elif variant in ("pallas_next", "pallas_next_full"):  # s' forwards fused
                swaps.append((learner_mod, "per_sample_loss",
                              _pallas_next_loss(variant == "pallas_next_full")))
            elif variant == "block_head":  # head outputs + dueling as one GEMM
                learner = dataclasses.replace(learner, network=_block_head_network(
                    learner.network))
            elif variant == "gather_select":  # the taken action's logits by a gather, as
                swaps.append((network_mod, "select_action", _gather_select))  # before session 9
            elif variant == "all_bf16x6":  # f32 GEMMs of any size in bf16 x6 (RND update)
                swaps.append((network_mod, "F32_PRECISION_MIN_ROWS", 0))
            elif variant == "rnd_side_stream":  # the RND predictor's update on a CUDA
                # stream of its own (it shares no data with the Q-network's update)
                swaps.append((curiosity_mod, "update",
                              lambda r, o, _u=curiosity_mod.update: _side_stream(_u)(r, o)))
            elif variant == "f32_as_bf16":  # a diagnostic, not a candidate (inaccurate): every
                # f32 GEMM as one bf16 product, so the RND update's are cheap
                swaps += [(network_mod, "F32_PRECISION_MIN_ROWS", 0),
                          (network_mod, "F32_PRECISION", jax.lax.DotAlgorithmPreset.BF16_BF16_F32)]
            try:
                def steps(agent, buf, key, _u=unroll, _l=learner, _v=variant):
                    if _v != "sequential":  # the library's (pipelined) loop
                        a, b, m = train_steps(_l, decode, agent, buf, key, jnp.float32(0.5), k,
                                              unroll=_u)
                        return a, b, m["loss"]

                    def body(c, kk):  # learner_step after learner_step, as before session 9
                        a, b = c
                        a, b, m = learner_step(_l, decode, a, b, kk, jnp.float32(0.5))
                        return (a, b), m["loss"]
                    (a, b), ls = jax.lax.scan(body, (agent, buf), jax.random.split(key, k),
                                              unroll=_u)
                    return a, b, jnp.mean(ls)
                t0 = time.perf_counter()
                with contextlib.ExitStack() as swapped:
                    for module, name, value in swaps:
                        swapped.enter_context(mock.patch.object(module, name, value))
                    # the library's options (jitcache.compiler_options), a variant's over them
                    opts = {**compiler_options(), **_options(variant)}
                    compiled = jax.jit(steps, compiler_options=opts or None).lower(
                        agent, state.buffer, jax.random.key(1)).compile()
                row["compile_s"] = time.perf_counter() - t0
                text = compiled.as_text()
                row["kernels_in_program"] = kernel_count(text)
                row["async_calls"] = text.count("call-start(")
                if args.hlo_dir:
                    Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                    (Path(args.hlo_dir) / f"learner_{dtype}_{variant}_u{unroll}.hlo.txt"
                     ).write_text(text)
                keys = iter(jax.random.split(jax.random.key(args.seed + 5), 256))
                row.update(_timed(lambda: compiled(agent, state.buffer, next(keys)),
                                  args.reps))
                row["us_per_step"] = row["ms"] * 1e3 / k
                if args.learner_in_trainer:
                    row.update(_in_trainer(tr, learner, state.replace(agent=agent), swaps,
                                           args.learner_in_trainer, k, _options(variant)))
                w = None
                if args.learner_trace:  # kernel times (visible with command buffers off)
                    tdir = tempfile.mkdtemp(prefix="learner-trace-")
                    with jax.profiler.trace(tdir):
                        for _ in range(args.learner_trace):
                            jax.block_until_ready(compiled(agent, state.buffer, next(keys)))
                    w = _step_kernel_us(tdir, args.learner_trace * k)
                    shutil.rmtree(tdir, ignore_errors=True)
                row.update(critical_path(text, w))
                if w is not None:
                    row["kernel_us_per_step"] = sum(w.values())
                    row["kernels_traced_per_step"] = {n: round(v, 3) for n, v in sorted(
                        w.items(), key=lambda x: -x[1])}
                    print(f"    kernel time {row['kernel_us_per_step']:.1f} us a step; the "
                          f"longest chain by time {row['loop_body_timed_chain_us']:.1f} us: "
                          + ", ".join(f"{n} {u}" for n, u in row["loop_body_timed_chain"]),
                          flush=True)
                # same inputs and key as the first variant: how far its parameters end up
                params = compiled(agent, state.buffer, jax.random.key(2))[0]
                params = jax.device_get(params.params)
                if base_params is None:
                    base_params = params
                else:
                    # raveled in the pytree's leaf order, as ravel_pytree does
                    flat = lambda tree: np.concatenate(  # noqa: E731
                        [np.ravel(x) for x in jax.tree.leaves(tree)])
                    row["max_abs_param_diff_vs_base"] = float(
                        np.max(np.abs(flat(params) - flat(base_params))))
                if "trainer_us_per_step" in row:
                    print(f"    in the trainer's training program: "
                          f"{row['trainer_us_per_step']:.1f} us/step", flush=True)
                print(f"  learner {dtype} unroll={unroll} {variant}: {row['ms']:.2f} ms "
                      f"({row['us_per_step']:.1f} us/step), {row['kernels_in_program']} kernels "
                      f"in the program ({row.get('loop_body_kernels')} in the loop body, a chain of "
                      f"{row.get('loop_body_chain')}), compile {row['compile_s']:.1f} s, "
                      f"params differ from "
                      f"the first by {row.get('max_abs_param_diff_vs_base', 0):.3g}", flush=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  learner {dtype} unroll={unroll}: FAILED {row['error']}", flush=True)
            out["rows"].append(row)
        del s, tr, state


# The start of every child process of the compile sections: JAX's caches as asked, then the
# trainer of the config and its initial state. ``sys.argv[1]`` is a JSON object (``_child``):
# ``config``, ``overrides``, ``cache`` (a folder for enable_compilation_cache, or null: no
# caches), ``xla_caches`` (a jax_persistent_cache_enable_xla_caches value, or null) and what
# the body reads.
_CHILD_PRELUDE = """
import json, statistics, sys, time
t0 = time.perf_counter()
opts = json.loads(sys.argv[1])
if opts["cache"]:
    from foxhunt_jax.jitcache import enable_compilation_cache
    enable_compilation_cache(opts["cache"])
import jax
if opts["xla_caches"]:
    jax.config.update("jax_persistent_cache_enable_xla_caches", opts["xla_caches"])
from foxhunt_jax.config import load_config
from foxhunt_jax.training.trainer import Trainer
jax.devices()
startup = time.perf_counter() - t0
tr = Trainer.build(load_config(opts["config"], opts["overrides"]))
t0 = time.perf_counter()
state = tr.init_state()
init_s = time.perf_counter() - t0
"""


def _child_variant(args) -> tuple[str, str]:
    """(backend, dtype) the compile sections measure: the GPU default, or xla/f32 on the CPU."""
    return ("xla", "float32") if args.quick else ("pallas", "bfloat16")


def _child(body: str, args, left: float, *, cache: str | None = None,
           xla_caches: str | None = None, overrides: tuple = (), env: dict | None = None,
           **opts) -> dict:
    """Runs ``_CHILD_PRELUDE + body`` in a fresh Python process (environment: the bench's
    child environment plus ``env``) for :func:`_child_variant`; returns the JSON object it
    prints last, or raises RuntimeError with the end of its stderr when it fails."""
    import subprocess

    from foxhunt_jax.bench import _child_env

    backend, dtype = _child_variant(args)
    opts.update(config=args.config, cache=cache, xla_caches=xla_caches,
                overrides=[f"network.dtype={dtype}", f"network.backend={backend}", *overrides])
    r = subprocess.run([sys.executable, "-c", _CHILD_PRELUDE + body, json.dumps(opts)],
                       capture_output=True, text=True, env=_child_env(**(env or {})),
                       timeout=left)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-1200:])
    return json.loads(r.stdout.strip().splitlines()[-1])


_LOAD_PROFILE = """
import cProfile, io, pstats
prof = cProfile.Profile()
prof.enable()
t0 = time.perf_counter()
tr.compile(state, threads=opts["mode"] == "parallel")
wall = time.perf_counter() - t0
prof.disable()
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
print(json.dumps({"compile_s": wall, "loaded": tr.executables_loaded, "startup_s": startup,
                  "init_ms": tr.init_ms, "profile": out.getvalue()[-6000:]}))
"""


def section_compilecache(args, out: dict) -> None:
    """The trainer's compile, sequential against three threads: each fills a fresh cache (cold
    compile) in one process and loads from it in a second (under cProfile)."""
    import tempfile

    for mode in ("sequential", "parallel"):
        with tempfile.TemporaryDirectory(prefix="foxhunt-explore-cache-") as cache:
            for step in ("fill", "load"):
                left = args._deadline - time.perf_counter()
                if left < 20:
                    out.setdefault("skipped", []).append(f"{mode} {step}")
                    continue
                try:
                    res = _child(_LOAD_PROFILE, args, left, cache=cache, mode=mode)
                except Exception as e:  # noqa: BLE001 - a failed child is a result, not a stop
                    out[f"{mode}_{step}"] = {"error": str(e)}
                    print(f"  {mode} {step}: FAILED {str(e)[-500:]}", flush=True)
                    continue
                out[f"{mode}_{step}"] = res
                print(f"  {'/'.join(_child_variant(args))} {mode} {step}: compile "
                      f"{res['compile_s']:.2f} s, loaded {res['loaded']}/3, init "
                      f"{res['init_ms'] / 1e3:.2f} s", flush=True)
                if step == "load":
                    print("\n".join(res["profile"].splitlines()[:18]), flush=True)


_COMPILE_BREAKDOWN = """
sys.path.insert(0, opts["scripts"])
from explore_gpu import kernel_count
rows, phases = {}, {}
for name, (fn, args) in tr.phase_programs(state).items():
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    phases[name] = lowered.compile()
    rows[name] = {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
                  "kernels": kernel_count(phases[name].as_text())}
tr._phases = phases
phase_names = ("experience", "training", "validation")
ms = {k: [] for k in phase_names + ("total",)}
for e in range(opts["epochs"] + 3):
    state, rec = tr.run_epoch(state)
    if e >= 3:
        for k in phase_names:
            ms[k].append(rec["phase_ms"][k])
        ms["total"].append(sum(rec["phase_ms"][k] for k in phase_names))
print(json.dumps({"startup_s": startup, "init_s": init_s, "programs": rows,
                  "epoch_ms": {k: statistics.median(v) for k, v in ms.items()},
                  "loss": rec["loss"], "finite": rec["finite_params"]}))
"""


def section_compileopts(args, out: dict) -> None:
    """Cold compile of the trainer's three programs (no caches), per program (trace and lower,
    then XLA), and the seed epoch those programs run, under each set of XLA flags, each in a
    fresh process: what the compile spends its time on, and what each option costs at run time."""
    import os

    out["rows"] = []
    for flags in args.compile_flag_sets.split(";"):
        flags = flags.strip()
        left = args._deadline - time.perf_counter()
        if left < 30:
            out.setdefault("skipped", []).append(flags)
            continue
        row = {"xla_flags": flags}
        t0 = time.perf_counter()
        try:
            row.update(_child(_COMPILE_BREAKDOWN, args, left, epochs=2 if args.quick else 20,
                              scripts=str(Path(__file__).resolve().parent),
                              env={"FOXHUNT_JAX_CACHE": "off", "XLA_FLAGS": (
                                  os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}))
            p = row["programs"]
            print(f"  [{flags or 'default'}] " + ", ".join(
                f"{k} lower {v['lower_s']:.1f} + compile {v['compile_s']:.1f} s "
                f"({v['kernels']} kernels)" for k, v in p.items())
                + f"; epoch {row['epoch_ms']['total']:.2f} ms (exp "
                f"{row['epoch_ms']['experience']:.2f}, train {row['epoch_ms']['training']:.2f}, "
                f"val {row['epoch_ms']['validation']:.2f})", flush=True)
        except Exception as e:  # noqa: BLE001 - a failing flag set is a result, not a stop
            row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
            print(f"  [{flags}] FAILED {row['error']}", flush=True)
        row["process_s"] = time.perf_counter() - t0
        out["rows"].append(row)


_SWEEP = """
t0 = time.perf_counter()
tr.compile(state)
wall = time.perf_counter() - t0
state, rec = tr.run_epoch(state)
print(json.dumps({"compile_s": wall, "loaded": tr.executables_loaded, "loss": rec["loss"]}))
"""


def section_compilesweep(args, out: dict) -> None:
    """A hyper-parameter sweep's compile: one process compiles the seed config into an empty
    cache folder, a second compiles it with another ``network.v_max`` (new programs, all three,
    for XLA and for the executable cache) from the same folder, under each setting of JAX's
    ``jax_persistent_cache_enable_xla_caches`` (XLA's autotuning cache, its kernel cache)."""
    import tempfile

    out["rows"] = []
    for setting in args.xla_cache_settings.split(","):
        row = {"xla_caches": setting}
        with tempfile.TemporaryDirectory(prefix="foxhunt-sweep-cache-") as cache:
            # v_max changes the C51 support, a constant in all three programs
            for step, change in (("first", "network.v_max=10.0"), ("second", "network.v_max=12.0")):
                left = args._deadline - time.perf_counter()
                if left < 30:
                    out.setdefault("skipped", []).append(f"{setting} {step}")
                    continue
                try:
                    row[step] = _child(_SWEEP, args, left, cache=cache,
                                       overrides=("network.support=explicit", change),
                                       xla_caches=None if setting == "default" else setting)
                except Exception as e:  # noqa: BLE001 - a failed child is a result, not a stop
                    row[step] = {"error": str(e)}
                    print(f"  {setting} {step}: FAILED {str(e)[-600:]}", flush=True)
            row["cache_mb"] = sum(f.stat().st_size for f in Path(cache).rglob("*")
                                  if f.is_file()) / 2**20
        out["rows"].append(row)
        fmt = lambda r: f"{r['compile_s']:.1f} s" if "compile_s" in r else "failed"  # noqa: E731
        print(f"  xla caches {setting}: first config {fmt(row.get('first', {}))}, "
              f"another v_max {fmt(row.get('second', {}))}", flush=True)


_KERNEL_COMPILE = """
import jax.numpy as jnp
from foxhunt_jax.jitcache import jit
from foxhunt_jax.training import collect, fused
lr, p = tr.learner, tr.env_params["train"]
if opts["mode"] == "collect":
    keys = collect.step_keys(jax.random.key(0), tr.cfg.env.episode_length)
    fn = lambda a, r, k: fused.collect_trajectory(lr, p, a, r, k, jnp.float32(0.1),
                                                  tr.cfg.env.episode_length)
    args = (state.agent.params, jax.tree.map(lambda x: x[0], state.rollout), keys)
else:
    va = tr.env_params["validation"]
    fn = lambda a, s: fused.evaluate_trajectory(lr, a, va, s, tr.cfg.env.episode_length)
    args = (state.agent.params, tr._val_starts_device())
t0 = time.perf_counter()
lowered = jit(fn).lower(*args)
t1 = time.perf_counter()
compiled = lowered.compile()
t2 = time.perf_counter()
jax.block_until_ready(compiled(*args))
print(json.dumps({"lower_s": t1 - t0, "compile_s": t2 - t1, "startup_s": startup}))
"""


_COMPILE_PROFILE = """
import glob, os, re, tempfile
log = tempfile.NamedTemporaryFile(prefix="foxhunt-vlog-", suffix=".txt", delete=False).name
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(fd, 2)  # XLA's timers log to stderr: keep them for the report
trace = tempfile.mkdtemp(prefix="foxhunt-compile-trace-")
rows = {}
popts = jax.profiler.ProfileOptions()
popts.python_tracer_level = 0  # XLA's and PJRT's own events, not every Python frame
with jax.profiler.trace(trace, profiler_options=popts):
    for name, (fn, args) in tr.phase_programs(state).items():
        t0 = time.perf_counter()
        lowered = fn.lower(*args)
        t1 = time.perf_counter()
        lowered.compile()
        rows[name] = {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}
pd = jax.profiler.ProfileData.from_file(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[0])
agg = {}
for plane in pd.planes:
    if not plane.name.startswith("/host"):
        continue
    for line in plane.lines:
        for e in line.events:
            if e.duration_ns < opts["min_event_ms"] * 1e6:
                continue
            key = re.sub(r"[0-9]+", "#", e.name)[:120]
            a = agg.setdefault(key, {"count": 0, "total_s": 0.0, "max_s": 0.0, "threads": []})
            a["count"] += 1
            a["total_s"] += e.duration_ns / 1e9
            a["max_s"] = max(a["max_s"], e.duration_ns / 1e9)
            if line.name not in a["threads"]:
                a["threads"].append(line.name)
top = sorted(agg.items(), key=lambda kv: -kv[1]["total_s"])[:opts["top"]]
timers = [ln.strip()[-240:] for ln in open(log, errors="replace")
          if " time: " in ln or " took " in ln]
print(json.dumps({"startup_s": startup, "programs": rows,
                  "events": [{"name": k, **v, "threads": len(v["threads"])} for k, v in top],
                  "timers": timers[:opts["top"] * 4]}))
"""


def section_compileprofile(args, out: dict) -> None:
    """Where a cold compile (no caches, fresh process) of the trainer's three programs spends
    its time: the host events of ``jax.profiler`` during the sequential lower and compile of
    each program, summed by name (nested events overlap, so totals do not add up), and XLA's
    scoped timers (``TF_CPP_VMODULE``) from its log."""
    left = args._deadline - time.perf_counter()
    try:
        res = _child(_COMPILE_PROFILE, args, left, min_event_ms=1.0, top=60,
                     env={"FOXHUNT_JAX_CACHE": "off", "TF_CPP_MIN_LOG_LEVEL": "0",
                          "TF_CPP_VMODULE": args.compile_vmodule})
    except Exception as e:  # noqa: BLE001 - a failed child is a result, not a stop
        out["error"] = str(e)
        print(f"  FAILED {str(e)[-600:]}", flush=True)
        return
    out.update(res)
    print("  " + ", ".join(f"{k} lower {v['lower_s']:.1f} + compile {v['compile_s']:.1f} s"
                           for k, v in res["programs"].items()), flush=True)
    for ev in res["events"][:40]:
        print(f"  {ev['total_s']:8.2f} s total {ev['max_s']:7.2f} s max x{ev['count']:<5d} "
              f"{ev['threads']:2d} thr  {ev['name'][:90]}", flush=True)
    for ln in res["timers"][:60]:
        print(f"  | {ln[-160:]}", flush=True)


_RND_COMPILE = """
import numpy as np
import jax.numpy as jnp
sys.path.insert(0, opts["scripts"])
from explore_gpu import _rnd_forward, _rnd_forward64, _rnd_precisions
from foxhunt_jax.agent import curiosity
from foxhunt_jax.config import CuriosityConfig
rnd = curiosity.init(jax.random.key(0), opts["dim"], CuriosityConfig())
prec, dt = _rnd_precisions()[opts["variant"]]
def err(pred, tgt, obs, scale):
    x = obs * scale  # a producer XLA can fuse into the first GEMM, as in the phase programs
    return jnp.sum(jnp.square(_rnd_forward(pred, x, prec, dt) - _rnd_forward(tgt, x, prec, dt)),
                   axis=-1)
def step(pred, tgt, obs, scale):
    loss, g = jax.value_and_grad(lambda p: jnp.mean(err(p, tgt, obs, scale)))(pred)
    return jax.tree.map(lambda a, b: a - 1e-4 * b, pred, g), loss
obs = jax.random.normal(jax.random.key(1), (opts["rows"], opts["dim"]), jnp.float32)
batch = obs[:opts["batch"]]
one = jnp.float32(1.0)
res = {"startup_s": startup}
for name, fn, a in (("pass", err, obs), ("update", step, batch)):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(rnd.predictor_params, rnd.target_params, a, one).compile()
    res[f"{name}_compile_s"] = time.perf_counter() - t0
    ms = []
    for i in range(opts["reps"] + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(rnd.predictor_params, rnd.target_params, a, one))
        ms.append((time.perf_counter() - t0) * 1e3)
    res[f"{name}_ms"] = statistics.median(ms[1:])
xs = np.asarray(obs[:4096], np.float64)
ref = np.sum(np.square(_rnd_forward64(rnd.predictor_params, xs)
                       - _rnd_forward64(rnd.target_params, xs)), axis=-1)
got = np.asarray(jax.jit(err)(rnd.predictor_params, rnd.target_params, obs[:4096], one))
res["max_rel_err_fresh"] = float(np.max(np.abs(got - ref) / ref))
print(json.dumps(res))
"""


def section_rndcompile(args, out: dict) -> None:
    """The cold compile (no caches, a fresh process each) of the curiosity pass at the seed's
    102,400 experience rows and of a predictor update at batch 64, per GEMM precision, with
    the pass's time and its error against float64: which precision's GEMM autotuning makes the
    experience program's compile slow."""
    names = (args.rnd_variants.split(",") if args.rnd_variants
             else [k for k in _rnd_precisions() if k != "f32_default"])
    out["rows"] = []
    for name in names:
        left = args._deadline - time.perf_counter()
        if left < 20:
            out.setdefault("skipped", []).append(name)
            continue
        row = {"variant": name}
        try:
            row.update(_child(_RND_COMPILE, args, left, variant=name, dim=args.obs_dim,
                              rows=args.prio_rows, batch=64, reps=args.reps,
                              scripts=str(Path(__file__).resolve().parent),
                              env={"FOXHUNT_JAX_CACHE": "off"}))
            print(f"  rnd {name}: pass compile {row['pass_compile_s']:.2f} s, "
                  f"{row['pass_ms']:.3f} ms; update compile {row['update_compile_s']:.2f} s, "
                  f"{row['update_ms']:.3f} ms; rel err {row['max_rel_err_fresh']:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed child is a result, not a stop
            row["error"] = str(e)[-600:]
            print(f"  rnd {name}: FAILED {row['error']}", flush=True)
        out["rows"].append(row)


def section_launch(args, out: dict) -> None:
    """What a program's launch costs the host, by the number of arguments: a jitted program
    adding 1 to every leaf of a pytree of ``n`` small float32 arrays (donated, as the phase
    programs' state is), timed from the call to its return and to its results being ready."""
    out["rows"] = []
    for n in args.launch_leaves:
        tree = [jnp.zeros((256,), jnp.float32) + i for i in range(n)]
        f = jax.jit(lambda t: [x + 1.0 for x in t], donate_argnums=0)
        tree = jax.block_until_ready(f(tree))
        returned, ready = [], []
        for _ in range(args.reps * 5):
            t0 = time.perf_counter()
            tree = f(tree)
            t1 = time.perf_counter()
            jax.block_until_ready(tree)
            returned.append((t1 - t0) * 1e3)
            ready.append((time.perf_counter() - t0) * 1e3)
        row = {"leaves": n, "returned_ms": statistics.median(returned),
               "ready_ms": statistics.median(ready), "returned": spread(returned)}
        out["rows"].append(row)
        print(f"  launch {n} leaves: call returns after {row['returned_ms'] * 1e3:.0f} us, "
              f"ready after {row['ready_ms'] * 1e3:.0f} us", flush=True)


def section_kernelcompile(args, out: dict) -> None:
    """The cold compile (no caches) of each rollout kernel in a program of its own, collect mode
    (experience) and evaluate mode (validation), each in a fresh process: how much of the phase
    programs' compile is the Pallas kernels' Triton compile."""
    if args.quick:
        out["skipped"] = "the rollout kernel needs network.backend=pallas (a GPU)"
        return
    for mode in ("collect", "evaluate"):
        left = args._deadline - time.perf_counter()
        if left < 30:
            out.setdefault("skipped", []).append(mode)
            continue
        try:
            out[mode] = _child(_KERNEL_COMPILE, args, left, mode=mode,
                               env={"FOXHUNT_JAX_CACHE": "off"})
            print(f"  rollout kernel, {mode} mode: lower {out[mode]['lower_s']:.1f} s, compile "
                  f"{out[mode]['compile_s']:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed child is a result, not a stop
            out[mode] = {"error": str(e)}
            print(f"  {mode}: FAILED {str(e)[-600:]}", flush=True)


def _add_by_select(state, items, priorities, alpha, eps):
    """``replay.add`` of a plain buffer as one pass over the whole ring (a candidate): slot
    ``j`` takes item ``(j - position) mod C`` where that is below ``n``, else keeps its own;
    a gather and a select per leaf, which XLA fuses, instead of a scatter."""
    from foxhunt_jax.agent import replay

    cap, n = state.capacity, jax.tree.leaves(items)[0].shape[0]
    offset = (jnp.arange(cap, dtype=jnp.int32) - state.position) % cap
    fresh = offset < n
    src = jnp.minimum(offset, n - 1)

    def put(buf, x):
        mask = fresh.reshape((cap,) + (1,) * (buf.ndim - 1))
        return jnp.where(mask, x[src], buf)

    stored = replay.transform_priorities(priorities, alpha, eps)
    return state.replace(items=jax.tree.map(put, state.items, items),
                         priorities=put(state.priorities, stored),
                         position=((state.position + n) % cap).astype(jnp.int32),
                         size=jnp.minimum(state.size + n, cap).astype(jnp.int32),
                         max_priority=jnp.maximum(state.max_priority, jnp.max(stored)))


def section_replayadd(args, out: dict) -> None:
    """The Experience phase's replay add at the seed's sizes (one shard of 2^17 slots, one
    epoch of 102,400 transitions, the trading env's 80 B items): the library's
    ``add_shards`` (a scatter under ``vmap``), ``add`` on the shard without ``vmap``, and a
    whole-ring select; each donating the buffer as the phase does."""
    from foxhunt_jax.agent import replay

    cap, n = (256, 96) if args.quick else (1 << 17, 102_400)
    example = {"action": jnp.zeros((3,), jnp.int32), "discount": jnp.zeros((), jnp.float32),
               "next_obs": {"bar": jnp.zeros((), jnp.int32),
                            "portfolio": jnp.zeros((6,), jnp.float32)},
               "obs": {"bar": jnp.zeros((), jnp.int32),
                       "portfolio": jnp.zeros((6,), jnp.float32)},
               "reward": jnp.zeros((), jnp.float32)}
    keys = iter(jax.random.split(jax.random.key(args.seed), 64))

    def fresh(shape, dtype):
        k = next(keys)
        if dtype == jnp.int32:
            return jax.random.randint(k, shape, 0, 1000, jnp.int32)
        return jax.random.normal(k, shape, dtype)

    items = jax.tree.map(lambda x: fresh((1, n) + x.shape, x.dtype), example)
    prios = jnp.abs(fresh((1, n), jnp.float32))
    alpha, eps = 0.6, 1e-6
    forms = {
        "add_shards (library)": lambda st, it, p: replay.add_shards(st, it, p, alpha, eps),
        "add per shard, no vmap": lambda st, it, p: jax.tree.map(
            lambda x: x[None], replay.add(jax.tree.map(lambda x: x[0], st),
                                          jax.tree.map(lambda x: x[0], it), p[0], alpha, eps)),
        "whole-ring select": lambda st, it, p: jax.tree.map(
            lambda x: x[None], _add_by_select(jax.tree.map(lambda x: x[0], st),
                                              jax.tree.map(lambda x: x[0], it), p[0], alpha,
                                              eps)),
    }
    out["rows"], results = [], {}
    for name, fn in forms.items():
        state = replay.init_shards(example, cap, 1)
        state = state.replace(position=jnp.asarray([cap - n // 2], jnp.int32))  # wraps around
        f = jax.jit(fn, donate_argnums=0, compiler_options=compiler_options() or None)
        box = [f(state, items, prios)]
        results[name] = jax.device_get(box[0])

        def call(f=f, box=box):
            box[0] = f(box[0], items, prios)
            return box[0]
        row = {"form": name, "capacity": cap, "added": n, **_timed(call, args.reps)}
        out["rows"].append(row)
        print(f"  replay add {name}: {row['ms']:.3f} ms", flush=True)
    first = next(iter(results.values()))
    out["equal"] = all(all(np.array_equal(a, b) for a, b in
                           zip(jax.tree.leaves(first), jax.tree.leaves(r)))
                       for r in results.values())
    print(f"  all forms give the same buffer: {out['equal']}", flush=True)


def _annotated(name: str, fn, host: dict):
    """``fn`` inside a profiler annotation ``phase:name`` that ends once its results are ready;
    appends (ms until the call returned, ms until its results were ready) to ``host[name]``.

    Each wrapped call waits for its own results, so under these wrappers the trainer cannot
    queue its phases back to back: its Training phase time then includes Validation (whose own
    time is ~0), and the ready times are the per-phase figures."""
    def call(*a):
        with jax.profiler.TraceAnnotation(f"phase:{name}"):
            t0 = time.perf_counter()
            out = fn(*a)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            host.setdefault(name, []).append(((t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
            return out
    return call


def _busy_ns(events: list) -> int:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0, None
    for s, e in sorted(events):
        if end is None or s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    return total


def _gpu_events(path: str) -> tuple[list, list, list, list]:
    """(phase windows ``(name, start, end)``, kernels ``(start, end, stream, name)``, the GPU
    plane's line names, host events of 10 us or more ``(start, end, thread, name)``) of a
    trace."""
    pd = jax.profiler.ProfileData.from_file(path)
    windows, kernels, lines, host = [], [], [], []
    for plane in pd.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                windows += [(e.name[6:], e.start_ns, e.end_ns) for e in line.events
                            if e.name.startswith("phase:")]
                host += [(e.start_ns, e.end_ns, line.name, e.name) for e in line.events
                         if e.duration_ns >= 10_000 and not e.name.startswith("phase:")]
        elif plane.name.startswith("/device:GPU:0"):
            for line in plane.lines:
                lines.append(line.name)
                if line.name.startswith("Stream"):
                    kernels += [(e.start_ns, e.end_ns, line.name, e.name) for e in line.events
                                if "memcpy" not in e.name.lower()]
    return sorted(windows, key=lambda w: w[1]), sorted(kernels), lines, sorted(host)


def section_overlap(args, out: dict) -> None:
    """One epoch's Validation beside the next epoch's Experience in one program (the trainer's
    ``validation_experience_phase``), against the two programs one after the other. Both only
    read the agent that Training left, and the validation rollout kernel fills 4 of the GPU's
    multiprocessors at the seed's 64 windows: does XLA run them at once? With the library's XLA
    options and with command buffers serialized; same inputs (nothing donated), medians of
    ``reps`` calls."""
    from foxhunt_jax.jitcache import SCHEDULING_OPTION
    from foxhunt_jax.training.trainer import (experience_phase, validation_experience_phase,
                                              validation_phase)

    backend, dtype = _child_variant(args)
    tr = _trainer(args, backend, dtype)
    lr, cfg = tr.learner, tr.cfg
    state = tr.init_state()
    for _ in range(2):  # a replay buffer with two epochs of transitions, a trained agent
        state, _ = tr.run_epoch(state)
    trp, vap = tr.env_params["train"], tr.env_params["validation"]
    sched, starts = tr._schedule_device(), tr._val_starts_device()
    library = compiler_options()
    jit = lambda f, opts=library: jax.jit(f, compiler_options=opts or None)  # noqa: E731
    exp = jit(lambda p, s, e: experience_phase(lr, cfg, p, s, e))
    val = jit(lambda p, st, a: validation_phase(lr, cfg, p, st, a))

    def paired(q, st, p, s, e):  # in the other forms' layout: (val, val_loss), (s, stats)
        v, loss, s, stats = validation_experience_phase(lr, cfg, q, st, p, s, e)
        return (v, loss), (s, stats)
    both = jit(paired)
    serialized = jit(paired, {**library, SCHEDULING_OPTION: "SERIALIZE"})
    calls = {"experience": lambda: exp(trp, state, sched),
             "validation": lambda: val(vap, starts, state.agent),
             "one_after_other": lambda: (val(vap, starts, state.agent), exp(trp, state, sched)),
             "one_program": lambda: both(vap, starts, trp, state, sched),
             "one_program_serialized": lambda: serialized(vap, starts, trp, state, sched)}
    out["rows"] = []
    for name, fn in calls.items():
        row = {"variant": name, **_timed(fn, args.reps)}
        out["rows"].append(row)
        print(f"  {name}: {row['ms']:.3f} ms [{row['spread']['p25']:.3f}-"
              f"{row['spread']['p75']:.3f}]", flush=True)
    (v1, e1), (v2, e2) = calls["one_after_other"](), calls["one_program"]()
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves((v1, e1[1])), jax.tree.leaves((v2, e2[1]))))
    out["max_abs_diff"] = diff
    print(f"  results of the two forms differ by at most {diff:.3g}", flush=True)


def section_profile(args, out: dict) -> None:
    """The trainer's seed epochs (pallas/bf16 on a GPU) under jax.profiler: what the GPU runs in
    each phase, from CUPTI's kernel records."""
    import tempfile
    from glob import glob

    backend, dtype = _child_variant(args)
    tr = _trainer(args, backend, dtype)
    cfg = tr.cfg
    state = tr.init_state()
    queued = args.profile_queued  # the trainer's form: Validation + next Experience paired
    tr.compile(state, queued=queued)
    if args.hlo_dir:  # the phase programs as compiled, for a critical-path reading
        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
        for name, compiled in tr._phases.items():
            if hasattr(compiled, "as_text"):
                (Path(args.hlo_dir) / f"phase_{name}.hlo.txt").write_text(compiled.as_text())
    host = {}
    tr._phases = {n: _annotated(n, f, host) for n, f in tr._phases.items()}
    walls = {}
    for e in range(3 + args.reps):  # untraced: how long the host takes to launch each phase
        state, rec = tr.run_epoch(state, queue_next=queued)
        if e >= 3:
            for name, ms in rec["phase_ms"].items():
                walls.setdefault(name, []).append(ms)
    # (queued: the first epoch's Experience is the only call of that program)
    out["untraced"] = {name: {"dispatch_ms": statistics.median(d for d, _ in v[3:]),
                              "ready_ms": statistics.median(r for _, r in v[3:]),
                              "phase_ms": statistics.median(walls.get(name, [float("nan")]))}
                       for name, v in host.items() if len(v) > 3}
    for name, v in out["untraced"].items():
        print(f"  {name} (untraced): the call returns after {v['dispatch_ms']:.3f} ms, results "
              f"ready after {v['ready_ms']:.3f} ms; the trainer's phase time {v['phase_ms']:.3f} "
              f"ms", flush=True)
    epochs = args.profile_epochs
    with tempfile.TemporaryDirectory(prefix="foxhunt-profile-") as d:
        with jax.profiler.trace(d):
            for _ in range(epochs):
                state, rec = tr.run_epoch(state, queue_next=queued)
        windows, kernels, lines, host_events = _gpu_events(
            glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    out.update(variant=f"{backend}/{dtype}", epochs=epochs, gpu_lines=lines, phases={})
    k = cfg.train.train_steps
    raw, raw_host = [], []
    for i, (name, w0, w1) in enumerate(windows):
        ks = [x for x in kernels if w0 <= x[0] and x[1] <= w1]
        if i < 3:
            raw += [(name, x[0] - w0, x[1] - x[0], x[2], x[3]) for x in ks]
            # what the host does in the phase's window before and while the GPU runs it
            raw_host += [(name, x[0] - w0, x[1] - x[0], x[2], x[3][:200]) for x in host_events
                         if w0 <= x[0] < w1]
        agg = out["phases"].setdefault(name, {"wall_us": [], "busy_us": [], "kernel_sum_us": [],
                                              "kernels": [], "streams": [], "by_name": {}})
        agg["wall_us"].append((w1 - w0) / 1e3)
        agg["busy_us"].append(_busy_ns([(x[0], x[1]) for x in ks]) / 1e3)
        agg["kernel_sum_us"].append(sum(x[1] - x[0] for x in ks) / 1e3)
        agg["kernels"].append(len(ks))
        agg["streams"].append(len({x[2] for x in ks}))
        for x in ks:
            c = agg["by_name"].setdefault(x[3][:120], [0, 0.0])
            c[0] += 1
            c[1] += (x[1] - x[0]) / 1e3
    for name, agg in out["phases"].items():
        n = len(agg["wall_us"])
        top = sorted(agg.pop("by_name").items(), key=lambda kv: -kv[1][1])[:20]
        agg["top_kernels"] = [{"name": nm, "per_call": c / n, "us_per_call": t / n}
                              for nm, (c, t) in top]
        for key in ("wall_us", "busy_us", "kernel_sum_us", "kernels", "streams"):
            agg[key] = statistics.median(agg[key])
        per = (f", per learner step: busy {agg['busy_us'] / k:.1f} us, "
               f"{agg['kernels'] / k:.0f} kernels") if name == "training" else ""
        print(f"  {name}: wall {agg['wall_us']:.0f} us, GPU busy {agg['busy_us']:.0f} us, kernel "
              f"sum {agg['kernel_sum_us']:.0f} us, {agg['kernels']:.0f} kernels on "
              f"{agg['streams']:.0f} streams{per}", flush=True)
        for t in agg["top_kernels"][:6]:
            print(f"      {t['us_per_call']:8.1f} us  x{t['per_call']:.0f}  {t['name'][:90]}",
                  flush=True)
    if args.profile_events:
        Path(args.profile_events).parent.mkdir(parents=True, exist_ok=True)
        Path(args.profile_events).write_text(json.dumps(
            {"fields": ["phase", "start_ns_in_phase", "duration_ns", "stream", "name"],
             "events": raw, "host_fields": ["phase", "start_ns_in_phase", "duration_ns",
                                            "thread", "name"], "host_events": raw_host}))


def _shapes(text: str) -> tuple[tuple[int, int, int | None, int], ...]:
    """``"128x8,128x8x64,16x8x128p2"`` -> (rows, warps, max_chunk or None, lookahead) per launch
    shape (``pK``: K weight blocks read ahead, ``KernelConfig.lookahead``)."""
    out = []
    for part in text.split(","):
        part, _, ahead = part.partition("p")
        v = [int(x) for x in part.split("x")]
        out.append((v[0], v[1], v[2] if len(v) > 2 else None, int(ahead or 0)))
    return tuple(out)


def _kernel_config(shape):
    from pallas_kernels.q_forward import KernelConfig

    rows, warps, chunk, ahead = shape
    return KernelConfig(block_rows=rows, min_rows=rows, num_warps=warps, min_warps=warps,
                        max_chunk=chunk, lookahead=ahead)


def _load(path: str):
    """A module from a file (another version of the rollout kernel, for an A/B run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU check)")
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small-shapes", default=None, help="rowsxwarps[xchunk],... at N = 1024/64")
    ap.add_argument("--large-shapes", default=None, help="rowsxwarps[xchunk],... at N = 2^20")
    ap.add_argument("--forward-shapes", default=None,
                    help="rowsxwarps[xchunk][pK],... of the forward section")
    ap.add_argument("--rnd-shapes", default=None,
                    help="rowsxwarps,... of the curiosity kernel for rndshape")
    ap.add_argument("--compare-rollout", default=None,
                    help="files of other rollout kernel versions (comma-separated), each timed "
                         "at the first shape")
    ap.add_argument("--loop-forms", default="rollout_kernel,scan_fused_forward,scan_xla")
    ap.add_argument("--unrolls", default=None, help="learner scan unroll factors, e.g. 1,2,5")
    ap.add_argument("--learner-dtypes", default="bfloat16,float32")
    ap.add_argument("--rnd-variants", default=None, help="subset of the RND precisions")
    ap.add_argument("--learner-variants", default="base",
                    help="base (the library's train_steps), sequential (learner_step after "
                         "learner_step, not pipelined), tree_adam (the optimizer per tensor, as "
                         "before optax.flatten), no_rnd, concat_online (one online forward over s "
                         "and s'), gather_select (the taken action's logits by a gather), "
                         "all_bf16x6 (f32 GEMMs of every size in bf16 x6), f32_as_bf16 (a "
                         "diagnostic: every f32 GEMM as one bf16 product), block_head (the head "
                         "output layers and the dueling step as one GEMM), pallas_next (the "
                         "forwards at s' in the fused kernels), pallas_next_full (the same with "
                         "the target's logits of every action), binary_search (the block of a "
                         "draw by an unrolled binary search, as before session 13), norm_tree "
                         "(the clip's norm over the gradient tree, Adam on the flat vector)")
    ap.add_argument("--compile-flag-sets", default=";--xla_gpu_autotune_level=0",
                    help="';'-separated XLA_FLAGS sets for compileopts (empty: the defaults)")
    ap.add_argument("--compile-vmodule",
                    default="gpu_compiler=1,nvptx_compiler=1,compile_module_to_llvm_ir=1",
                    help="TF_CPP_VMODULE of the compileprofile child (XLA's scoped timers)")
    ap.add_argument("--xla-cache-settings", default="default,all",
                    help="values of jax_persistent_cache_enable_xla_caches for compilesweep")
    ap.add_argument("--learner-options", default="",
                    help="';'-separated XLA compile-option sets name=value[,name=value], each "
                         "timed as a learner variant")
    ap.add_argument("--learner-in-trainer", type=int, default=None,
                    help="also time each learner variant in the trainer's training program, "
                         "this many calls queued back to back (three runs, the median; "
                         "default 10, 0 with --quick: none)")
    ap.add_argument("--learner-trace", type=int, default=0,
                    help="trace this many calls of each learner variant and weigh its loop "
                         "body's chains by kernel time (run with XLA_FLAGS="
                         "--xla_gpu_enable_command_buffer= so the kernels are visible)")
    ap.add_argument("--hlo-dir", default=None,
                    help="write each compiled learner program (and profile's phases) here")
    ap.add_argument("--profile-epochs", type=int, default=3, help="epochs traced by profile")
    ap.add_argument("--profile-queued", action="store_true",
                    help="profile epochs as the trainer runs them (each queuing the next; "
                         "Validation and the next Experience paired where both are kernels)")
    ap.add_argument("--profile-events", default=None,
                    help="write the profile's raw kernel events of one epoch here (JSON)")
    args = ap.parse_args(argv)
    q = args.quick
    args.config = "smoke" if q else "seed"
    args.overrides = ["network.trunk=[32]", "network.head=16", "env.episode_length=8"] if q else []
    args.length = 8 if q else 100
    args.small_n, args.val_n, args.large_n = (32, 16, 64) if q else (1024, 64, 1 << 20)
    args.small_shapes = _shapes(args.small_shapes or ("16x4" if q else "16x4,16x2,16x8,32x4,64x4"))
    args.large_shapes = _shapes(args.large_shapes
                                or ("16x4" if q else "128x8,64x4,64x8,128x4,256x8"))
    args.forward_shapes = _shapes(args.forward_shapes or (
        "16x4,16x4p1" if q else "128x8,128x8x128,128x8x128p1,128x8x128p2,128x8p1"))
    args.rnd_shapes = [tuple(int(x) for x in t.split("x")) for t in
                       (args.rnd_shapes or ("16x4,32x4" if q else "128x8,64x4")).split(",")]
    args.prio_rows = 48 if q else 102_400
    args.batch_rows = 16 if q else 64
    args.launch_leaves = (1, 16) if q else (1, 16, 64, 128, 256)
    args.loop_n = (32,) if q else (16384, 262144, 1 << 20)
    args.obs_dim = 40
    args.rnd_rows = 256 if q else 1 << 22
    args.unrolls = tuple(int(u) for u in args.unrolls.split(",")) if args.unrolls else (
        (1, 2) if q else (1, 2, 5, 10))
    args.reps = 3 if q else 30
    if args.learner_in_trainer is None:  # the numbers to decide by (BENCHMARKS.md, session 13)
        args.learner_in_trainer = 0 if q else 10
    args._market = None
    args._deadline = time.perf_counter() + args.time_budget
    d = jax.devices()[0]
    res = {"meta": {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                    "command": "python3 scripts/explore_gpu.py " + " ".join(
                        argv if argv is not None else sys.argv[1:]),
                    "device": f"{d.platform} ({getattr(d, 'device_kind', d.platform)})",
                    "jax": jax.__version__}}
    for name in [s for s in args.sections.split(",") if s]:
        if name not in SECTIONS:
            raise SystemExit(f"error: unknown section {name!r}; known: {', '.join(SECTIONS)}")
        print(f"[{name}]", flush=True)
        t0 = time.perf_counter()
        out = res.setdefault(name, {})
        try:
            globals()[f"section_{name}"](args, out)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            traceback.print_exc()
        out["section_s"] = time.perf_counter() - t0
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
