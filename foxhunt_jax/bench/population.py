"""The ``population`` section: the seed workload trained as populations of P agents in one
program (:mod:`foxhunt_jax.training.population`), P from ``--population-sizes``: the epoch's
median time and its phases' medians, agent-epochs per second and the state's bytes per member.
P = 1 is the single-agent trainer itself (the path a run without ``train.population`` takes;
its Validation holds the next epoch's Experience where the two rollouts are paired)."""

from __future__ import annotations

import traceback

import jax

from foxhunt_jax.bench.common import Deadline, build_trainer, spread, variant_cfg
from foxhunt_jax.bench.seed import time_epochs
from foxhunt_jax.training.pipeline import PHASES
from foxhunt_jax.training.population import PopulationTrainer


def state_bytes(state) -> int:
    """Bytes of every array of a (population) state."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def time_population(cfg, market, epochs: int, warmup: int) -> dict:
    """Warmup + epochs epochs of a population of ``cfg.train.population`` members; an epoch's
    time runs from the previous epoch's Validation to its own (the next epoch is queued before
    the host builds the per-member records)."""
    pop = PopulationTrainer.build(cfg, market=market)
    state = pop.init_state()
    phases = {k: [] for k in PHASES}
    first = None
    for e in range(warmup + epochs):  # each epoch queues the next, as training does
        state, _, extra = pop.run_epoch(state, queue_next=e + 1 < warmup + epochs)
        ms = extra["phase_ms"]
        first = first or ms
        if e >= warmup:  # the device phases, as the seed section's total
            for k in PHASES:
                phases[k].append(ms[k])
    return {"epoch_ms": spread([sum(t) for t in zip(*phases.values())]),
            "phase_ms": {k: spread(v) for k, v in phases.items()},
            "compile_ms": first["compile"],
            "state_bytes_per_member": state_bytes(state) / pop.size}


def time_single(cfg, market, epochs: int, warmup: int) -> dict:
    """The single-agent trainer's epochs, measured as the seed section measures them."""
    tr = build_trainer(cfg, market)
    state = tr.init_state()
    phases, first, _ = time_epochs(tr, state, epochs, warmup)
    return {"epoch_ms": spread(phases["total"]),
            "phase_ms": {k: spread(phases[k]) for k in PHASES},
            "compile_ms": first.get("compile", 0.0), "state_bytes_per_member": state_bytes(state)}


def section_population(args, out: dict, deadline: Deadline, market) -> None:
    """Epoch time and agent-epochs/s of the workload at every ``--population-sizes`` P, with
    the first variant (``--variants``)."""
    backend, dtype = args.variants[0]
    out.update({"config": str(args.config), "variant": f"{backend}:{dtype}",
                "epochs": args.epochs, "warmup": args.warmup, "rows": []})
    for size in args.population_sizes:
        if not deadline.ok(20):
            out.setdefault("skipped", []).append(f"P={size}: time budget")
            continue
        row = {"population": size}
        try:
            cfg = variant_cfg(args, backend, dtype, [f"train.population={size}"])
            timing = time_single if size == 1 else time_population
            row.update(timing(cfg, market, args.epochs, args.warmup))
            median = row["epoch_ms"]["median"]
            row["agent_epochs_per_s"] = size / (median / 1e3) if median > 0 else None
            print(f"  population P={size}: epoch {median:.2f} ms, "
                  f"{row['agent_epochs_per_s'] or float('nan'):.1f} agent-epochs/s, "
                  f"{row['state_bytes_per_member'] / 2**20:.1f} MiB a member", flush=True)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        out["rows"].append(row)
    base = next((r for r in out["rows"] if r.get("population") == 1 and "epoch_ms" in r), None)
    for r in out["rows"]:
        if base and "epoch_ms" in r and base["epoch_ms"]["median"] > 0:
            r["time_vs_single"] = r["epoch_ms"]["median"] / base["epoch_ms"]["median"]
