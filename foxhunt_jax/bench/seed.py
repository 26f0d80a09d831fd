"""The ``seed`` section: the seed workload (``--config``, default ``seed``) through the public
:class:`~foxhunt_jax.training.trainer.Trainer` API: per-phase times of ``--epochs`` epochs after
``--warmup`` (median, quartiles, min, max), and each variant's compile in this process (the first
with an empty cache; later ones reuse what earlier ones compiled, such as XLA's autotuning
results)."""

from __future__ import annotations

import traceback

from foxhunt_jax.bench.common import Deadline, build_trainer, spread, variant_cfg
from foxhunt_jax.training.pipeline import PHASES


def time_epochs(tr, state, count: int, warmup: int) -> tuple[dict, dict, dict]:
    """Runs warmup + count epochs from ``state``: (per-phase lists of the last ``count``, the
    first epoch's ``phase_ms``, the last record).

    Each epoch queues the next one's phases, and the following Experience where it is paired
    with Validation (``run_epoch(queue_next=2)``, as training without a checkpoint between
    epochs does), so the times are those of a steady loop: Experience runs from the previous
    epoch's Validation to its own completion.
    """
    phases = {k: [] for k in PHASES + ("total",)}
    first = rec = None
    for e in range(warmup + count):
        state, rec = tr.run_epoch(state, queue_next=min(2, warmup + count - 1 - e))
        ms = rec["phase_ms"]
        first = first or ms
        if e >= warmup:
            for k in PHASES:
                phases[k].append(ms[k])
            phases["total"].append(sum(ms[k] for k in PHASES))
    return phases, first, rec


def run_epochs(tr, epochs: int, warmup: int) -> dict:
    """Runs warmup + epochs epochs; returns per-phase spreads and the first epoch's init/compile
    (:func:`time_epochs`)."""
    phases, first, rec = time_epochs(tr, tr.init_state(), epochs, warmup)
    return {"init_ms": first.get("init", 0.0), "compile_ms": first.get("compile", 0.0),
            "phases": {k: spread(v) for k, v in phases.items()},
            "samples": phases, "finite": bool(rec["finite_params"]), "last_loss": rec["loss"]}


def section_seed(args, out: dict, deadline: Deadline, market) -> None:
    """The seed workload's epoch, per phase, for every variant (in this process)."""
    out.update({"config": str(args.config), "epochs": args.epochs, "warmup": args.warmup,
                "rows": []})
    for backend, dtype in args.variants:
        if not deadline.ok(20):
            out.setdefault("skipped", []).append(f"{backend}/{dtype}: time budget")
            continue
        row = {"backend": backend, "dtype": dtype}
        try:
            cfg = variant_cfg(args, backend, dtype)
            row.update({"num_episodes": cfg.train.num_episodes,
                        "episode_length": cfg.env.episode_length,
                        "train_steps": cfg.train.train_steps, "batch_size": cfg.train.batch_size,
                        "validation_windows": cfg.train.validation_windows})
            tr = build_trainer(cfg, market)
            row.update(run_epochs(tr, args.epochs, args.warmup))
            k = max(cfg.train.train_steps, 1)
            # with train.overlap the Training phase also holds the next collection (and on one
            # device Validation), so it is no learner-step time
            row["train_step_ms"] = (None if cfg.train.overlap
                                    else row["phases"]["training"]["median"] / k)
            ph = row["phases"]
            print(f"  seed {backend}/{dtype}: total {ph['total']['median']:.2f} ms (exp "
                  f"{ph['experience']['median']:.2f}, train {ph['training']['median']:.2f}, val "
                  f"{ph['validation']['median']:.2f}), compile {row['compile_ms'] / 1e3:.1f} s",
                  flush=True)
            del tr
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        out["rows"].append(row)

