"""The ``train`` section: learner throughput: steps/s at the seed batch (from the seed
section's rows) and samples/s at ``--big-batch``."""

from __future__ import annotations

import traceback

from foxhunt_jax.bench.common import Deadline, build_trainer, per_second, variant_cfg
from foxhunt_jax.bench.seed import run_epochs


def seed_train_rows(seed_rows: list) -> list[dict]:
    """The learner's steps/s at the seed batch, from the seed section's XLA rows (the
    Q-forward backend does not enter training)."""
    rows = []
    for row in seed_rows:
        if "phases" in row and row["backend"] == "xla" and row["train_step_ms"] is not None:
            step = row["train_step_ms"]
            rows.append({"dtype": row["dtype"], "batch": row["batch_size"], "step_ms": step,
                         "steps_per_s": per_second(1, step),
                         "samples_per_s": per_second(row["batch_size"], step),
                         "source": "seed section"})
    return rows


def section_train(args, out: dict, deadline: Deadline, market, seed_rows: list) -> None:
    """Learner throughput: steps/s at the seed batch (from the seed section), samples/s at a big
    batch (its own trainer; the Q-forward backend does not enter training)."""
    out["rows"] = seed_train_rows(seed_rows)
    for dtype in sorted({d for _, d in args.variants}):
        if not deadline.ok(25):
            out.setdefault("skipped", []).append(f"batch {args.big_batch} {dtype}: time budget")
            continue
        row = {"dtype": dtype, "batch": args.big_batch}
        try:
            # learner steps alone: with train.overlap the Training phase holds a collection too
            cfg = variant_cfg(args, "xla", dtype, [f"train.batch_size={args.big_batch}",
                                                   "train.overlap=false"])
            tr = build_trainer(cfg, market)
            res = run_epochs(tr, max(3, args.epochs // 4), 1)
            k = max(cfg.train.train_steps, 1)
            step = res["phases"]["training"]["median"] / k
            row.update({"step_ms": step, "steps_per_s": per_second(1, step),
                        "samples_per_s": per_second(args.big_batch, step),
                        "training_ms": res["phases"]["training"], "train_steps": k})
            rate = row["samples_per_s"]
            print(f"  train batch {args.big_batch} {dtype}: {step:.3f} ms/step, "
                  + (f"{rate / 1e6:.2f}M samples/s" if rate else "below the timer's resolution"),
                  flush=True)
            del tr
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        out["rows"].append(row)
