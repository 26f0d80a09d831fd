"""Train through the library and send every epoch's record to Weights & Biases or MLflow.

Neither service is a dependency of foxhunt-jax: the script uses whichever is installed
(``--to`` chooses when both are) and, when the one asked for is missing, says so and exits 0
without training. Each epoch's record is the dict ``train`` writes as a line of metrics.jsonl,
flattened to the TensorBoard names (``val/sharpe``) and logged at step ``epoch``.

Usage: python scripts/log_to_wandb_or_mlflow.py [--config smoke] [--set key=value ...]
           [--out runs/logged] [--to auto|wandb|mlflow] [--project foxhunt-jax]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from numbers import Number

from foxhunt_jax import api
from foxhunt_jax.config import load_config, to_dict
from foxhunt_jax.errors import FoxhuntError
from foxhunt_jax.training.rundir import flatten

SERVICES = ("wandb", "mlflow")


def scalars(record: dict) -> dict[str, float]:
    """The numeric leaves of an epoch record by their flattened names (booleans as 0/1)."""
    return {k: float(v) for k, v in flatten(record).items()
            if isinstance(v, Number) and k != "epoch"}


def pick_service(choice: str) -> str | None:
    """The installed service to log to (``choice`` ``auto``: the first installed), or None."""
    wanted = SERVICES if choice == "auto" else (choice,)
    return next((s for s in wanted if importlib.util.find_spec(s) is not None), None)


def wandb_logger(project: str, config: dict):
    """(callback, finish, where) for Weights & Biases."""
    wandb = importlib.import_module("wandb")  # optional: found by pick_service
    run = wandb.init(project=project, config=config)
    return (lambda rec: run.log(scalars(rec), step=rec["epoch"]), run.finish,
            f"W&B run {run.name} of project {project}")


def mlflow_logger(project: str, config: dict):
    """(callback, finish, where) for MLflow (tracking URI: MLFLOW_TRACKING_URI, else ./mlruns)."""
    mlflow = importlib.import_module("mlflow")  # optional: found by pick_service
    mlflow.set_experiment(project)
    run = mlflow.start_run()
    mlflow.log_params({k: str(v) for k, v in flatten(config).items()})
    return (lambda rec: mlflow.log_metrics(scalars(rec), step=rec["epoch"]), mlflow.end_run,
            f"MLflow run {run.info.run_id} of experiment {project} at "
            f"{mlflow.get_tracking_uri()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="smoke", help="config path or name in configs/")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="dotted config override (repeatable)")
    p.add_argument("--out", default="runs/logged", help="run directory")
    p.add_argument("--to", choices=("auto",) + SERVICES, default="auto",
                   help="service to log to; auto: the first installed of " + ", ".join(SERVICES))
    p.add_argument("--project", default="foxhunt-jax", help="W&B project / MLflow experiment")
    args = p.parse_args(argv)

    service = pick_service(args.to)
    if service is None:
        what = "neither wandb nor mlflow is" if args.to == "auto" else f"{args.to} is not"
        print(f"skipped: {what} installed (pip install wandb, or pip install mlflow); nothing "
              "trained or written")
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        make = wandb_logger if service == "wandb" else mlflow_logger
        callback, finish, where = make(args.project, to_dict(cfg))
        try:
            api.train(cfg, args.out, callbacks=[callback])
        finally:
            finish()
    except FoxhuntError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"logged every epoch to {where}; the run itself is in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
