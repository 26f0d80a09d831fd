"""The ``collect`` section: collection throughput in env-steps/s at ``--collect-n`` episodes x
L: the collection loop (``rollout``: Q-forward, epsilon-greedy, env step, curiosity bonus,
auto-reset, the per-step transitions written out: the per-step work of
:func:`foxhunt_jax.training.collect.collect`'s scan), and the whole experience phase (``collect``
+ replay add) at ``--experience-n`` (its initial-priority pass holds ``[N*L, width]``
activations); at the largest N a breakdown without curiosity and without the Q-forward; with
``pallas`` among the variants, the rollout kernel's trajectory is compared with the scan's at
the smallest N (same keys and parameters)."""

from __future__ import annotations

import math
import statistics
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.agent import replay
from foxhunt_jax.agent.learner import init_agent, make_learner
from foxhunt_jax.backend import resolve
from foxhunt_jax.bench.common import (Deadline, build_trainer, format_rate, per_second, rel_err,
                                      spread, time_calls, variant_cfg)
from foxhunt_jax.env import trading
from foxhunt_jax.env.trading import PORTFOLIO_DIM
from foxhunt_jax.jitcache import jit
from foxhunt_jax.training import collect
from foxhunt_jax.training.phases import TRADING_ADAPTER


def make_rollout(learner, backend, adapter, env_params, num_steps: int, *, use_q: bool = True,
                 use_rnd: bool = True):
    """The collection loop alone: ``run(agent, rollout, key, epsilon) -> (rollout, traj)``.

    :func:`foxhunt_jax.training.collect.trajectory` (Q-forward on ``backend``,
    per-branch epsilon-greedy, env step, auto-reset, the per-step transitions written out; one
    fused kernel with ``backend=pallas``) followed by the curiosity pass over the next
    observations as the collector runs it (:func:`~foxhunt_jax.training.collect.
    trajectory_novelty`: per kernel launch, so the first launch's pass can run beside the
    second). Not included: n-step targets,
    initial priorities and the replay write. ``use_rnd=False`` skips curiosity; ``use_q=False``
    times the env's own random-action rollout (:func:`foxhunt_jax.env.trading.rollout`: env
    step, random actions, auto-reset; no forward, no transitions kept).
    """
    def run(agent, rollout, key, epsilon):
        if not use_q:
            return trading.rollout(key, env_params, trading.random_policy(
                learner.network.branch_sizes), rollout.obs.shape[0], num_steps)
        rollout, traj = collect.trajectory(learner, backend, adapter, env_params, agent.params,
                                           rollout, key, epsilon, num_steps)
        if use_rnd and agent.rnd is not None:
            traj = dict(traj, novelty=collect.trajectory_novelty(backend, adapter, env_params,
                                                                 agent.rnd, traj["next_obs"]))
        return rollout, traj

    return run


def section_collect(args, out: dict, deadline: Deadline, market, seed_rows: list) -> None:
    """Collection throughput at each N (every variant at the largest N, ``--collect-variants``
    below it), the experience phase at ``--experience-n`` and, from the seed section, at its N;
    a breakdown at the largest N."""
    out.update({"rows": [], "breakdown": []})
    for r in seed_rows:  # the seed epoch's experience phase: collect + replay add at its N
        if "phases" in r:
            ms = r["phases"]["experience"]["median"]
            out["rows"].append({"n": r["num_episodes"], "backend": r["backend"],
                                "dtype": r["dtype"], "kind": "experience (seed epoch)",
                                "ms": ms, "env_steps_per_s":
                                    per_second(r["num_episodes"] * r["episode_length"], ms)})
    eps = 0.1  # a late-training epsilon: mostly greedy actions, as after the decay
    largest = max(args.collect_n)
    # the breakdown of the fast path; --quick takes the first variant, the cheapest to compile
    # on a CPU (the kernels' paths run in the rollout rows)
    bd_variant = (args.variants[0] if args.quick
                  else ("pallas", "bfloat16") if ("pallas", "bfloat16") in args.variants
                  else args.variants[-1])
    for n in args.collect_n:
        cfg0 = variant_cfg(args, "xla", "float32", [f"train.num_episodes={n}"])
        length = cfg0.env.episode_length
        out["episode_length"] = length
        tr = build_trainer(cfg0, market)
        env_p = tr.env_params["train"]
        start = jit(lambda p, k, _n=n: collect.start(TRADING_ADAPTER, p, k, _n))
        rollout0 = start(env_p, jax.random.key(args.seed))
        reps = 3 if n >= 262144 else 5
        variants = args.variants if n == largest else (args.collect_variants or args.variants)
        for backend, dtype in variants:
            if not deadline.ok(25):
                out.setdefault("skipped", []).append(f"N={n} {backend}/{dtype}: time budget")
                continue
            cfg = variant_cfg(args, backend, dtype, [f"train.num_episodes={n}"])
            resolved = resolve(cfg.network)
            learner = make_learner(cfg, cfg.env.branch_sizes,
                                   replay_search=resolved.tuning.replay)
            agent = jit(lambda k, _l=learner: init_agent(k, _l, tr.obs_dim))(
                jax.random.key(args.seed))
            kinds = [("rollout", dict(use_q=True, use_rnd=True))]
            if args.breakdown and n == largest and (backend, dtype) == bd_variant:
                kinds += [("rollout_no_curiosity", dict(use_q=True, use_rnd=False)),
                          ("env_only_random_actions", dict(use_q=False, use_rnd=False))]
            for kind, flags in kinds:
                row = {"n": n, "backend": backend, "dtype": dtype, "kind": kind}
                try:
                    run = jit(make_rollout(learner, resolved, TRADING_ADAPTER, env_p, length,
                                           **flags))
                    keys, eps_d = call_inputs(jax.random.key(args.seed + 7), reps + 2, eps)
                    ms = time_calls(lambda: run(agent, rollout0, next(keys), eps_d), reps,
                                    warmup=1)
                    med = statistics.median(ms)
                    row.update({"ms": med, "ms_spread": spread(ms),
                                "env_steps_per_s": per_second(n * length, med),
                                "us_per_step": med * 1e3 / length})
                    print(f"  collect N={n} {backend}/{dtype} {kind}: {med:.2f} ms, "
                          f"{format_rate(row['env_steps_per_s'])} env-steps/s", flush=True)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"  collect N={n} {backend}/{dtype} {kind}: FAILED {row['error'][:200]}",
                          flush=True)
                (out["breakdown"] if kind != "rollout" else out["rows"]).append(row)
            # the whole experience phase: collect (incl. n-step targets and initial priorities)
            # + replay add; its priority pass holds [N*L, width] activations, so only small N
            if n in args.experience_n and deadline.ok(25):
                row = {"n": n, "backend": backend, "dtype": dtype, "kind": "experience"}
                try:
                    cap = 1 << max(int(math.ceil(math.log2(n * length))), 10)
                    example = {"obs": {"bar": jnp.zeros((), jnp.int32),
                                       "portfolio": jnp.zeros((PORTFOLIO_DIM,), jnp.float32)},
                               "action": jnp.zeros((len(cfg.env.branch_sizes),), jnp.int32),
                               "reward": jnp.zeros((), jnp.float32),
                               "discount": jnp.zeros((), jnp.float32)}
                    example["next_obs"] = example["obs"]
                    buf = replay.init(example, cap)

                    def phase(agent, rollout, buf, key, e, _l=learner, _b=resolved):
                        r2, items, prio, rnd, stats = collect.collect(
                            _l, _b, TRADING_ADAPTER, env_p, agent, rollout, key, e, length)
                        return r2, replay.add(buf, items, prio, cfg.replay.alpha,
                                              cfg.replay.priority_eps), stats

                    ph = jit(phase)
                    keys, eps_d = call_inputs(jax.random.key(args.seed + 9), reps + 2, eps)
                    ms = time_calls(lambda: ph(agent, rollout0, buf, next(keys), eps_d), reps,
                                    warmup=1)
                    med = statistics.median(ms)
                    row.update({"ms": med, "ms_spread": spread(ms),
                                "env_steps_per_s": per_second(n * length, med)})
                    print(f"  experience N={n} {backend}/{dtype}: {med:.2f} ms", flush=True)
                    del buf
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"  experience N={n} {backend}/{dtype}: FAILED {row['error'][:200]}",
                          flush=True)
                out["rows"].append(row)
            del agent
        del rollout0, tr
        np.asarray(0)
    if ("pallas", "bfloat16") in args.variants and deadline.ok(30):
        try:
            out["equality"] = rollout_equality(args, market, min(args.collect_n))
        except Exception as e:
            out["equality"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            traceback.print_exc()


def call_inputs(key, calls: int, eps: float):
    """An iterator over ``calls`` device keys and epsilon as a device scalar, made before the
    timing starts: slicing a key array or copying a host scalar inside a timed call would add
    an eager device op (a launch and a copy) to every sample."""
    keys = list(jax.random.split(key, calls))
    return iter(jax.block_until_ready(keys)), jax.block_until_ready(jnp.float32(eps))


def rollout_equality(args, market, n: int) -> dict:
    """The fused rollout kernel against the scan, bfloat16 network, same keys and parameters.

    Near-ties of expected Q can pick different greedy actions in the two (their bf16 GEMMs sum in
    different orders), after which an episode's paths part; so this reports the share of
    episodes whose L actions all agree and, over those, the largest reward and portfolio
    differences.
    """
    cfg = variant_cfg(args, "xla", "bfloat16", [f"train.num_episodes={n}"])
    tr = build_trainer(cfg, market)
    env_p, length = tr.env_params["train"], cfg.env.episode_length
    rollout = jit(lambda p, k: collect.start(TRADING_ADAPTER, p, k, n))(
        env_p, jax.random.key(args.seed))
    agent = None
    trajs = {}
    for backend in ("xla", "pallas"):
        c = variant_cfg(args, backend, "bfloat16", [f"train.num_episodes={n}"])
        learner = make_learner(c, c.env.branch_sizes)
        if agent is None:
            agent = jit(lambda k, _l=learner: init_agent(k, _l, tr.obs_dim))(
                jax.random.key(args.seed))
        run = jit(lambda a, r, k, _l=learner, _b=resolve(c.network): collect.trajectory(
            _l, _b, TRADING_ADAPTER, env_p, a.params, r, k, jnp.float32(0.1), length)[1])
        trajs[backend] = jax.device_get(run(agent, rollout, jax.random.key(args.seed + 1)))
    ref, got = trajs["xla"], trajs["pallas"]
    same = np.all(ref["action"] == got["action"], axis=(0, 2))  # [N]
    res = {"n": n, "episode_length": length, "episodes_all_actions_equal": float(same.mean()),
           "action_mismatch_share": float(np.mean(ref["action"] != got["action"]))}
    if same.any():
        res["max_abs_reward_diff"] = float(np.max(np.abs(ref["reward"] - got["reward"])[:, same]))
        res["max_abs_portfolio_diff"] = float(np.max(np.abs(
            ref["next_obs"]["portfolio"] - got["next_obs"]["portfolio"])[:, same]))
        res["bars_equal"] = bool(np.all(ref["next_obs"]["bar"][:, same]
                                        == got["next_obs"]["bar"][:, same]))
        res["greedy_equal"] = bool(np.all(ref["greedy"][:, same] == got["greedy"][:, same]))
        res["taken_logits_rel_err"] = rel_err(
            np.stack([x[:, same] for x in got["taken_logits"]]),
            np.stack([x[:, same] for x in ref["taken_logits"]]))
    print(f"  rollout kernel vs scan at N={n}: {res}", flush=True)
    return res


