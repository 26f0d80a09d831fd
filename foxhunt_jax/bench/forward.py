"""The ``forward`` section: the collection/inference Q-forward
(:func:`foxhunt_jax.agent.network.q_forward`) alone at ``--forward-n`` rows (time, rows/s,
achieved FLOP/s) on XLA and on the Pallas kernel at each launch shape of ``--kernel-configs``,
with the kernel's equality to the Flax forward on fresh random inputs (expected-Q error,
greedy-action mismatches outside near-ties); in bfloat16 also the other fused forwards against
XLA: the taken-action logits, ``network.act``, the target's part of the C51 loss and the
curiosity pass. The float32 kernel, slower than XLA and long to compile on a GPU, only with
``--forward-f32-kernel``."""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax import backend
from foxhunt_jax.agent import curiosity
from foxhunt_jax.agent.network import explore_draws, make_network, q_forward, support
from foxhunt_jax.bench.common import (Deadline, kernel_config_name, obs_dim_of, per_second,
                                      rel_err, spread, time_calls, variant_cfg)
from foxhunt_jax.jitcache import jit
from pallas_kernels import rnd as rnd_kernel
from pallas_kernels.q_forward import forward_flops, fused_q_forward
from pallas_kernels.tuning import KernelConfig, for_device


def section_forward(args, out: dict, deadline: Deadline, market) -> None:
    """Q-forward alone: xla vs pallas (each launch shape), f32 vs bf16, at each of
    ``--forward-n``; equality with the Flax forward on the device, on fresh inputs."""
    cfg = variant_cfg(args, "xla", "float32")
    sizes = cfg.env.branch_sizes
    obs_dim = obs_dim_of(cfg, market)
    z = support(cfg.network.v_min, cfg.network.v_max, cfg.network.atoms)
    flops = forward_flops(obs_dim, cfg.network.trunk, cfg.network.head, cfg.network.atoms, sizes)
    out.update({"n": list(args.forward_n), "obs_dim": obs_dim, "flops_per_row": flops,
                "rows": []})
    reps = 3 if args.quick else 10
    nets = {dt: make_network(dataclasses.replace(cfg.network, dtype=dt), sizes)
            for dt in ("float32", "bfloat16")}
    params = nets["float32"].init(jax.random.key(args.seed), jnp.zeros((1, obs_dim), jnp.float32))
    inputs = {n: jax.random.normal(jax.random.key(args.seed + 1), (n, obs_dim), jnp.float32)
              for n in args.forward_n}

    for dtype in sorted({d for _, d in args.variants}):
        net = nets[dtype]
        # fresh inputs for the equality check (not the timing inputs), of the largest N so that
        # the checked program is the timed one
        obs_chk = jax.random.normal(jax.random.key(args.seed + 2), (max(args.forward_n), obs_dim),
                                    jnp.float32) * 2.0
        # Both backends are timed returning expected Q and actions (one Pallas program per
        # launch shape serves the check and the timing; writing Q is ~64 B a row).
        f_xla = jit(lambda p, o: q_forward(p, o, net, z, with_q=True))
        ref_q, ref_a = f_xla(params, obs_chk)
        ref_q = np.concatenate([np.asarray(x) for x in ref_q], axis=1)
        ref_a = np.asarray(ref_a)
        for n, obs in inputs.items():
            ms = time_calls(lambda: f_xla(params, obs), reps, warmup=2)
            row = {"n": n, "backend": "xla", "dtype": dtype, "config": "flax",
                   **forward_rates(ms, n, flops)}
            out["rows"].append(row)
            print(f"  forward N={n} xla/{dtype}: {row['ms']:.3f} ms", flush=True)
        if dtype == "float32" and not args.forward_f32_kernel:
            # the float32 kernel is slower than XLA's forward and its Triton compile is long
            out.setdefault("skipped", []).append("pallas/float32: --forward-f32-kernel not set")
            continue
        default = for_device().q_forward_config(dtype)
        for kc in [default] + [c for c in args.kernel_configs if c != default]:
            name = kernel_config_name(kc)
            if not deadline.ok(30):
                out.setdefault("skipped", []).append(f"pallas/{dtype} {name}: time budget")
                continue
            chk_row = {"n": int(obs_chk.shape[0]), "backend": "pallas", "dtype": dtype,
                       "config": name, "default": kc == default, "kind": "equality"}
            try:
                f = jit(lambda p, o, _c=kc: fused_q_forward(p, o, net, z, config=_c))
                q, a = f(params, obs_chk)
                q = np.concatenate([np.asarray(x) for x in q], axis=1)
                chk_row.update(forward_equality(q, np.asarray(a), ref_q, ref_a, sizes))
                del q, a
                for n, obs in inputs.items():
                    ms = time_calls(lambda: f(params, obs), reps, warmup=2)
                    row = {"n": n, "backend": "pallas", "dtype": dtype, "config": name,
                           "default": kc == default, **forward_rates(ms, n, flops),
                           "q_rel_err": chk_row["q_rel_err"],
                           "action_mismatch": chk_row["action_mismatch"]}
                    out["rows"].append(row)
                    print(f"  forward N={n} pallas/{dtype} {name}: {row['ms']:.3f} ms, q rel "
                          f"err {row['q_rel_err']:.2e}, action mismatches "
                          f"{row['action_mismatch']}", flush=True)
            except Exception as e:
                chk_row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(f"  forward pallas/{dtype} {name}: FAILED {chk_row['error'][:300]}",
                      flush=True)
            out.setdefault("equality", []).append(chk_row)
        if dtype == "bfloat16" and deadline.ok(30):
            curiosity_rows(out, cfg, obs_chk, inputs, reps, args.seed, args.kernel_configs)
        if dtype == "bfloat16" and deadline.ok(30):
            logits_rows(out, net, params, obs_chk, inputs, reps, flops)
        if dtype == "bfloat16" and deadline.ok(30):
            act_rows(out, net, params, z, obs_chk, inputs, reps, flops)
        if dtype == "bfloat16" and deadline.ok(30):
            loss_rows(out, net, params, z, obs_chk, inputs, reps, flops)


def named_backends() -> dict:
    """Both backends on this device, by name, for the rows that time them side by side."""
    return {name: backend.make(name, for_device()) for name in backend.NAMES}


def logits_rows(out: dict, net, params, obs_chk, inputs: dict, reps: int, flops: int) -> None:
    """The forward of the loss's no-gradient callers (initial priorities, validation loss):
    each branch's logits of given actions (``taken_logits``) on XLA (Flax) against the fused
    kernel (default launch shape), timed at each N, and their largest relative difference on
    the fresh inputs."""
    fns = {b: jit(lambda p, o, a, _b=be: _b.taken_logits(p, o, a, net))
           for b, be in named_backends().items()}

    def actions(n, seed):  # fresh uniform actions per branch
        keys = jax.random.split(jax.random.key(seed), len(net.branch_sizes))
        return jnp.stack([jax.random.randint(k, (n,), 0, nd) for k, nd in
                                zip(keys, net.branch_sizes)], axis=1)
    def flat(xs):
        return np.concatenate([np.asarray(x).reshape(x.shape[0], -1) for x in xs], axis=1)

    check_and_time(out, fns, params, obs_chk, inputs, actions, (11, 12), reps, flops,
                   net.dtype, "taken_logits", "taken-action logits", flat, "logits_rel_err",
                   "Flax")


def act_rows(out: dict, net, params, z, obs_chk, inputs: dict, reps: int, flops: int) -> None:
    """The collection forward (``network.act``: greedy actions, and each branch's logits of the
    action taken under explore draws at epsilon 0.1) on XLA against the fused kernel, timed at
    each N; on the fresh inputs, the greedy actions that differ and the largest relative
    difference of the taken logits where both took the same actions."""
    fns = {b: jit(lambda p, o, r, _b=be: _b.act(p, o, r, net, z))
           for b, be in named_backends().items()}

    def draws(n, seed):
        return explore_draws(jax.random.key(seed), n, net.branch_sizes, 0.1)
    try:
        r = draws(obs_chk.shape[0], 13)
        (g, a, t), (g_x, a_x, t_x) = [jax.device_get(fns[b](params, obs_chk, r))
                                      for b in ("pallas", "xla")]
        same = np.all(a == a_x, axis=1)
        rel = rel_err(np.concatenate([x[same] for x in t], axis=1),
                      np.concatenate([x[same] for x in t_x], axis=1))
        out.setdefault("equality", []).append({
            "n": int(obs_chk.shape[0]), "backend": "pallas", "dtype": net.dtype, "kind": "act",
            "greedy_differ_share": float(np.mean(g != g_x)), "taken_logits_rel_err": rel})
        time_backends(out, fns, params, inputs, lambda n: draws(n, 14), reps, flops, net.dtype,
                      "act", "act (greedy + taken logits)",
                      f", greedy differ {np.mean(g != g_x):.1e}, taken rel err {rel:.2e}")
    except Exception as e:
        out.setdefault("equality", []).append({"kind": "act",
                                               "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(f"  act: FAILED {str(e)[:300]}", flush=True)


def loss_rows(out: dict, net, params, z, obs_chk, inputs: dict, reps: int, flops: int) -> None:
    """The target's part of the C51 loss (``loss.bootstrap_loss``: the target forward at the
    bootstrap actions, its softmax, the projection and the cross-entropy with given online
    logits), as the initial priorities and the validation loss run it, on XLA against the
    fused kernel, timed at each N; the largest relative difference on fresh inputs (returns
    spread over the support, a fifth of the rows terminated)."""
    fns = {b: jit(lambda p, o, a, _b=be: _b.bootstrap_loss(p, o, *a, net, z))
           for b, be in named_backends().items()}

    def loss_inputs(n, seed):
        nb = len(net.branch_sizes)
        k = jax.random.split(jax.random.key(seed), 2 * nb + 2)
        best = jnp.stack([jax.random.randint(k[d], (n,), 0, nd)
                          for d, nd in enumerate(net.branch_sizes)], axis=1)
        taken = tuple(2.0 * jax.random.normal(k[nb + d], (n, net.atoms)) for d in range(nb))
        returns = 5.0 * jax.random.normal(k[-2], (n,))
        discounts = jnp.where(jax.random.uniform(k[-1], (n,)) < 0.2, 0.0, 0.99)
        return best, taken, returns, discounts
    check_and_time(out, fns, params, obs_chk, inputs, loss_inputs, (15, 16), reps, flops,
                   net.dtype, "bootstrap_loss", "target forward + C51 loss",
                   lambda x: np.asarray(x, np.float64), "loss_rel_err", "XLA")


def curiosity_rows(out: dict, cfg, obs_chk, inputs: dict, reps: int, seed: int,
                   kernel_configs=()) -> None:
    """The curiosity pass of a bfloat16 run (``curiosity.prediction_error`` at precision
    ``bf16x3``) on XLA against the RND kernel, timed at each N (its own FLOPs a row: both
    networks, one product each); the largest relative difference on the fresh inputs. Each
    ``--kernel-configs`` entry's rows, warps and minimum rows are timed as a launch shape of
    the RND kernel too (``config`` ``rnd:rows:warps:min_rows``)."""
    c = dataclasses.replace(cfg.curiosity, precision="bf16x3")
    d = int(obs_chk.shape[1])
    rnd = curiosity.init(jax.random.key(seed + 3), d, c)
    flops = 2 * 2 * (d * c.hidden + c.hidden * c.hidden + c.hidden * c.embed)
    fns = {b: jit(lambda r, o, _, _b=be: _b.novelty(r, o))
           for b, be in named_backends().items()}
    to_f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    check_and_time(out, fns, rnd, obs_chk, inputs, lambda n, s: None, (17, 18), reps, flops,
                   "bfloat16", "curiosity", "curiosity pass (bf16 x3)", to_f64,
                   "novelty_rel_err", "XLA")
    shapes = {KernelConfig(block_rows=kc.block_rows, num_warps=kc.num_warps,
                           min_rows=kc.min_rows, min_warps=min(kc.num_warps, 4))
              for kc in kernel_configs} - {for_device().rnd}
    for kc in sorted(shapes, key=lambda k: (k.block_rows, k.num_warps, k.min_rows)):
        name = f"rnd:{kc.block_rows}:{kc.num_warps}:{kc.min_rows}"
        shaped = jit(lambda r, o, _, _kc=kc: rnd_kernel.prediction_error(
            r.target_params, r.predictor_params, o, config=_kc))
        check_and_time(out, {"pallas": shaped, "xla": fns["xla"]}, rnd, obs_chk, inputs,
                       lambda n, s: None, (17, 18), reps, flops, "bfloat16", name,
                       f"curiosity pass {name}", to_f64, "novelty_rel_err", "XLA",
                       timed=("pallas",))


def check_and_time(out: dict, fns: dict, params, obs_chk, inputs: dict, extra, seeds: tuple,
                   reps: int, flops: int, dtype: str, kind: str, label: str, to_array,
                   err_key: str, reference: str, timed: tuple = ("xla", "pallas")) -> None:
    """Both backends of ``fns`` (``fn(params, obs, extra(n, seed))``) on the fresh check
    inputs (``seeds[0]``): their largest relative difference (``to_array`` of each result)
    into ``out["equality"]`` under ``err_key``; then those of ``timed`` timed at each N of
    ``inputs`` (:func:`time_backends`, ``seeds[1]``). A failure is recorded, not raised."""
    try:
        arg = extra(obs_chk.shape[0], seeds[0])
        got, ref = (to_array(jax.device_get(fns[b](params, obs_chk, arg)))
                    for b in ("pallas", "xla"))
        rel = rel_err(got, ref)
        out.setdefault("equality", []).append({"n": int(obs_chk.shape[0]), "backend": "pallas",
                                               "dtype": dtype, "kind": kind, err_key: rel})
        time_backends(out, {b: fns[b] for b in timed}, params, inputs,
                      lambda n: extra(n, seeds[1]), reps, flops, dtype, kind, label,
                      f", rel err vs {reference} {rel:.2e}")
    except Exception as e:
        out.setdefault("equality", []).append({"kind": kind,
                                               "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(f"  {label}: FAILED {str(e)[:300]}", flush=True)


def time_backends(out: dict, fns: dict, params, inputs: dict, extra, reps: int, flops: int,
                  dtype: str, config: str, label: str, pallas_note: str) -> None:
    """Times each backend's ``fn(params, obs, extra(n))`` at each N of ``inputs`` into
    ``out["rows"]`` (``config`` names the forward) and prints it."""
    for n, obs in inputs.items():
        arg = extra(n)
        for name, f in fns.items():
            ms = time_calls(lambda: f(params, obs, arg), reps, warmup=2)
            out["rows"].append({"n": n, "backend": name, "dtype": dtype, "config": config,
                                **forward_rates(ms, n, flops)})
            print(f"  {label} N={n} {name}/{dtype}: {statistics.median(ms):.3f} ms"
                  + (pallas_note if name == "pallas" else ""), flush=True)


def forward_rates(ms: list[float], n: int, flops: int) -> dict:
    """Median time, its spread, rows/s and achieved TFLOP/s of ``n`` rows of ``flops``."""
    med = statistics.median(ms)
    flops_per_s = per_second(n * flops, med)
    return {"ms": med, "ms_spread": spread(ms), "rows_per_s": per_second(n, med),
            "tflops": flops_per_s and flops_per_s / 1e12}


def forward_equality(q, a, ref_q, ref_a, sizes) -> dict:
    """Kernel vs Flax: max relative expected-Q error; action mismatches outside near-ties."""
    rel = rel_err(q, ref_q)
    tol = 1e-4 * max(float(np.max(np.abs(ref_q))), 1e-30)  # a tie: top two within tol
    mismatch, ties, off = 0, 0, 0
    for d, n_d in enumerate(sizes):
        block = ref_q[:, off:off + n_d]
        off += n_d
        top2 = np.sort(block, axis=1)[:, -2:] if n_d > 1 else np.concatenate(
            [block - np.inf, block], axis=1)
        near_tie = (top2[:, 1] - top2[:, 0]) <= max(tol, 4 * rel * np.max(np.abs(ref_q)))
        differ = a[:, d] != ref_a[:, d]
        mismatch += int(np.sum(differ & ~near_tie))
        ties += int(np.sum(differ & near_tie))
    return {"q_rel_err": rel, "action_mismatch": mismatch, "action_differ_at_ties": ties,
            "checked_rows": int(q.shape[0])}


