"""Run what the README's results section reports and compare it with the recorded figures.

The results are the default config on the embedded US stocks (``make train``: seeds 0, 1 and 2),
its 5-fold walk-forward, and with ``--population`` the same walk-forward with 16 members a fold
(about 20 minutes on a 2-core CPU). The JSON keeps the figures whole; they are printed and
compared as printed (Sharpe to 0.01, returns and drawdowns to 0.1 %), so a code change that
moves only the last bits of a run keeps them, and one that moves a selection does not. A run on
another processor model may differ (docs/training.md, "Determinism"): the JSON names the
processor it was measured on.

    python scripts/readme_results.py --population --json benchmarks/readme_results.json  # record
    python scripts/readme_results.py --check benchmarks/readme_results.json  # compare (3 min)

``--check`` prints each figure that differs and exits with status 1 if any does; every run
prints the README's phrases that do not match the figures it measured.
``tests/unit/test_readme_results.py`` checks that the README states what the recorded JSON
holds.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SEEDS = (0, 1, 2)
FOLDS = 5
POPULATION = 16


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}" if round(x, digits) != 0 else f"{0:.{digits}f}"


def shown(key: str, value):
    """A figure as the README prints it: fractions as percent to 0.1, Sharpe ratios to 0.01,
    trade counts whole, percentiles as they are."""
    if key in ("total_return", "max_drawdown", "turnover"):
        return f"{100 * value:.1f}"
    if key in ("sharpe", "low", "high"):
        return f"{value:.2f}"
    if key == "trades":
        return f"{value:.0f}"
    if key == "deflated_sharpe":
        return f"{value:.3f}"
    return value


POLICY_KEYS = ("total_return", "sharpe", "max_drawdown", "turnover", "trades")


def split_figures(split: dict) -> dict:
    """The README's figures of one split of a ``report/summary.json``."""
    def policy(m: dict) -> dict:
        return {k: m[k] for k in POLICY_KEYS}
    return {"agent": policy(split["agent"]),
            "agent_percentile_sharpe": split["agent_percentile"]["sharpe"],
            "buy_and_hold": policy(split["buy_and_hold"]), "flat": policy(split["flat"]),
            "random": {q: policy(split["random"][q]) for q in ("p5", "p50", "p95")}}


def run_figures(summary: dict) -> dict:
    """Selected epoch and both splits' figures of a ``report/summary.json``."""
    return {"selected_epoch": summary["selected_epoch"],
            "validation": split_figures(summary["validation"]),
            "test": split_figures(summary["test"])}


def walkforward_figures(report: dict) -> dict:
    """The README's figures of a ``walkforward.json``."""
    oos = report["out_of_sample"]
    return {"sharpe": oos["agent"]["sharpe"], "total_return": oos["agent"]["total_return"],
            "bootstrap_95": {k: oos["sharpe_bootstrap_95"][k] for k in ("low", "high")},
            "agent_percentile_sharpe": oos["agent_percentile_sharpe"],
            "deflated_sharpe": oos["deflated_sharpe"]["probability"],
            "n_trials": oos["deflated_sharpe"]["n_trials"],
            "per_fold": [{"selected_epoch": f["selected_epoch"], "member": f["member"],
                          "sharpe": f["test"]["sharpe"]} for f in report["per_fold"]]}


def table_rows(figures: dict) -> list[str]:
    """The README's results table (its body rows) from :func:`run_figures`' output."""
    def cells(m: dict, pct: str = "") -> str:
        return (f"{_signed(100 * m['total_return'], 1)}% | {_signed(m['sharpe'], 2)}{pct} | "
                f"{100 * m['max_drawdown']:.1f}% | {100 * m['turnover']:.1f}% | "
                f"{m['trades']:.0f}")
    rows = []
    for split in ("validation", "test"):
        s = figures[split]
        r = [s["random"][q] for q in ("p5", "p50", "p95")]
        pct = f" (pct {s['agent_percentile_sharpe']:g})"
        rows.append(f"| {split} | agent (selected, epoch {figures['selected_epoch']}) | "
                    f"{cells(s['agent'], pct)} |")
        rows.append(f"| {split} | buy & hold | {cells(s['buy_and_hold'])} |")
        rows.append(f"| {split} | flat (cash) | {cells(s['flat'])} |")
        returns = " / ".join(_signed(100 * m["total_return"], 1) for m in r)
        sharpes = " / ".join(_signed(m["sharpe"], 2) for m in r)
        drawdowns = " / ".join(f"{100 * m['max_drawdown']:.1f}" for m in r)
        rows.append(f"| {split} | random 5% / 50% / 95% | {returns}% | {sharpes} | {drawdowns}% | "
                    f"{100 * r[0]['turnover']:.0f}-{100 * r[2]['turnover']:.0f}% | "
                    f"{r[0]['trades']:.0f}-{r[2]['trades']:.0f} |")
    return rows


_MISSING = object()


def _listed(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def readme_fragments(figures: dict) -> list[str]:
    """Phrases the README's results section holds for ``figures`` (whitespace collapsed): the
    table's rows, the other seeds' epochs and test Sharpe, and each walk-forward's figures."""
    found = table_rows(figures["default_seed0"])
    others = [figures[f"default_seed{seed}"] for seed in SEEDS[1:]]
    sharpes = [_signed(f["test"]["agent"]["sharpe"], 2) for f in others]
    found += [f"select epochs {_listed([str(f['selected_epoch']) for f in others])} and reach "
              f"test Sharpe {sharpes[0]}", f"and {sharpes[1]} ("]
    for name in ("walkforward", "walkforward_population"):
        if name not in figures:
            continue
        w = figures[name]
        low, high = (_signed(w["bootstrap_95"][k], 2) for k in ("low", "high"))
        found += [f"**{_signed(w['sharpe'], 2)}**", f"95% interval {low} to {high}",
                  f"return {_signed(100 * w['total_return'], 1)}%",
                  f"beats {w['agent_percentile_sharpe']:.1f}% of",
                  f"counting the {w['n_trials']:,} epochs",
                  f"is {w['deflated_sharpe']:.3f}",
                  _listed([_signed(f["sharpe"], 2) for f in w["per_fold"]])]
    return found


def differences(recorded, now, path: str = "") -> list[str]:
    """``path: recorded -> now`` for every leaf of ``recorded`` that ``now`` shows otherwise
    (:func:`shown`, keyed by the leaf's name)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        return [d for k in recorded
                for d in differences(recorded[k], now.get(k, _MISSING), f"{path}.{k}".lstrip("."))]
    if isinstance(recorded, list) and isinstance(now, list) and len(recorded) == len(now):
        return [d for i, (r, n) in enumerate(zip(recorded, now))
                for d in differences(r, n, f"{path}[{i}]")]
    key = path.rsplit(".", 1)[-1]
    if now is _MISSING:
        return [f"{path}: {shown(key, recorded)} -> missing"]
    return [] if shown(key, recorded) == shown(key, now) else [
        f"{path}: {shown(key, recorded)} -> {shown(key, now)}"]


def _processor() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _commit(package: Path) -> str:
    """The checkout that holds the imported ``foxhunt_jax`` (which an editable install may place
    outside this script's repository)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True, cwd=package).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(out: Path, population: bool, log) -> dict:
    """Trains and walks everything the README reports into ``out``; returns the figures."""
    import jax

    import foxhunt_jax
    from foxhunt_jax import api
    from foxhunt_jax.config import load_config
    from foxhunt_jax.research.walkforward import walkforward

    figures = {"machine": {"processor": _processor(), "jax": jax.__version__,
                           "device": jax.devices()[0].device_kind},
               "commit": _commit(Path(foxhunt_jax.__file__).parent),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    for seed in SEEDS:
        log(f"default config, seed {seed}")
        result = api.train(load_config("default", [f"train.seed={seed}"]),
                           out / f"default_seed{seed}", progress=False, log=lambda s: None)
        figures[f"default_seed{seed}"] = run_figures(result.summary)
    walks = {"walkforward": []}
    if population:
        walks["walkforward_population"] = [f"train.population={POPULATION}"]
    for name, overrides in walks.items():
        log(f"walk-forward, {FOLDS} folds, {overrides or 'one seed'}")
        report = walkforward(load_config("default", overrides), FOLDS, out_dir=out / name,
                             log=lambda s: None)
        figures[name] = walkforward_figures(report)
    return figures


def _recorded(path: str) -> dict | str:
    """The figures recorded in ``path``, or why they cannot be read."""
    try:
        recorded = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"--check {path}: not a readable JSON file ({e})"
    if not isinstance(recorded, dict) or "default_seed0" not in recorded:
        return f"--check {path}: not figures written by this script (no 'default_seed0')"
    return recorded


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--population", action="store_true",
                    help=f"also the walk-forward with {POPULATION} members a fold (slow)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--check", default=None, help="compare with the figures in this file")
    ap.add_argument("--out", default=None, help="keep the runs in this new folder")
    args = ap.parse_args(argv)
    recorded = _recorded(args.check) if args.check else None
    if args.json and not Path(args.json).resolve().parent.is_dir():
        return _error(f"--json {args.json}: its folder does not exist")
    if isinstance(recorded, str):
        return _error(recorded)
    from foxhunt_jax.files import write_atomic
    from foxhunt_jax.jitcache import enable_compilation_cache

    enable_compilation_cache()
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(Path(args.out or tmp), args.population,
                          lambda s: print(s, file=sys.stderr, flush=True))
    readme = " ".join(README.read_text().split()) if README.is_file() else ""
    missing = [f for f in readme_fragments(figures) if f not in readme]
    print("\n".join(["the README does not state:", *missing] if missing
                    else ["the README states these figures"]))
    if args.json:
        write_atomic(Path(args.json), json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")
    if not args.check:
        return 0
    results = [k for k in recorded if k in figures and k not in ("machine", "commit", "date")]
    found = differences({k: recorded[k] for k in results}, figures)
    for line in found:
        print(line)
    processor = recorded.get("machine", {}).get("processor")
    if found and processor != figures["machine"]["processor"]:
        print(f"note: recorded on {processor}; another processor model gives other last bits "
              "(docs/training.md, Determinism)")
    print(f"{len(found)} figures differ from {args.check}" if found
          else f"every figure equals {args.check}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
