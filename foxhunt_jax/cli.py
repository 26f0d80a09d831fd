"""Command line: ``foxhunt-jax <command> [<subcommand>] ...``.

Each command is a function ``cmd_<name>(args) -> int`` registered in :data:`COMMANDS` with the
function that adds its arguments. :func:`main` turns every
:class:`~foxhunt_jax.errors.FoxhuntError` into one ``error: <message>`` line on stderr and the
error's exit code (2 by default), without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from foxhunt_jax.version import __version__
from foxhunt_jax.errors import ConfigError, FoxhuntError
from foxhunt_jax.pystack import call_with_reserve


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already states its default
    or the option is a flag or has no default (those state it in words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.nargs == 0 or action.default is None
                or action.default is argparse.SUPPRESS or not action.option_strings):
            return text
        shown = (",".join(map(str, action.default)) if isinstance(action.default, list)
                 else str(action.default))
        return f"{text} (default: {shown.replace('%', '%%')})"  # help text is %-formatted


def _config_options(p: argparse.ArgumentParser, config_default: str | None = "default",
                    config_note: str = "") -> None:
    """``--config`` and ``--set``, as every command that builds a run's config takes them."""
    p.add_argument("--config", metavar="FILE", default=config_default,
                   help="YAML config: a path or a name in configs/" + config_note)
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="dotted override, e.g. --set train.epochs=5 (repeatable; default: none; "
                        "`foxhunt-jax config keys` lists the keys)")


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("data", "check") is `foxhunt-jax data check`
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------------
# Formatting helpers


def human_duration(seconds: float) -> str:
    """86400 -> "1 day", 3600 -> "1 hour", 900 -> "15 min", 7.5 -> "7.5 s"."""
    for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("min", 60)):
        count = seconds / size
        if count >= 1 and abs(count - round(count)) < 1e-9:
            n = int(round(count))
            plural = "s" if n != 1 and unit != "min" else ""
            return f"{n} {unit}{plural}"
    return f"{seconds:g} s"


def format_timestamp(ts: np.datetime64, date_only: bool) -> str:
    text = str(np.datetime64(ts, "s")).replace("T", " ")
    return text[:10] if date_only else text


def _parse_splits(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--splits must be three comma-separated numbers, got '{text}'") from None
    if len(values) != 3:
        raise ConfigError(f"--splits needs three fractions (train,validation,test), got '{text}'")
    return values  # type: ignore[return-value]


def _render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str,
                  footer: str) -> None:
    """A rich table on a terminal, plain aligned text otherwise (pipes, files, tests)."""
    right = {i for i, h in enumerate(headers) if h in ("bars", "train", "validation", "test")}
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, caption=footer)
        for i, h in enumerate(headers):
            table.add_column(h, justify="right" if i in right else "left")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    print(title)
    print(line(headers))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))
    print(footer)


# ---------------------------------------------------------------------------------------------
# data check


def _args_data_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="CSV/Parquet files or builtin:NAME (us_stocks_daily, eurusd_hourly, "
                        "synthetic[?instruments=2&bars=5000&seed=3])")
    p.add_argument("--sort", action="store_true",
                   help="sort unsorted timestamps instead of rejecting the file")
    p.add_argument("--splits", default="0.7,0.15,0.15",
                   help="train,validation,test fractions of the distinct bar times of all "
                        "instruments pooled, one calendar boundary for all (default "
                        "0.7,0.15,0.15)")
    p.add_argument("--split-dates", metavar="VALIDATION_START,TEST_START", default=None,
                   help="calendar boundaries in place of --splits, e.g. 2009-01-01,2011-01-01 "
                        "(default: none)")
    p.add_argument("--episode-length", default=None, metavar="L",
                   help="env.episode_length: an instrument contributes to a split only with at "
                        "least L + 1 bars there (default: the config default, 100)")


def cmd_data_check(args: argparse.Namespace) -> int:
    """Loads and validates the sources; prints one row per instrument."""
    from foxhunt_jax.config import from_dict
    from foxhunt_jax.data.features import SPLITS, split_boundaries, window_text
    from foxhunt_jax.data.loader import load_market, split_counts
    from foxhunt_jax.data.market import median_bar_seconds

    dates = [] if args.split_dates is None else args.split_dates.split(",")
    full = from_dict({"data": {"source": list(args.paths), "sort": bool(args.sort),
                               "splits": list(_parse_splits(args.splits)),
                               "split_dates": dates},
                      "env": ({} if args.episode_length is None
                              else {"episode_length": args.episode_length})})
    cfg, needed = full.data, full.env.episode_length + 1
    market = load_market(cfg.source, sort=cfg.sort, synthetic=cfg.synthetic)
    boundaries = split_boundaries(market, cfg.splits, cfg.split_dates)

    headers = ("instrument", "source", "bars", "first", "last", "frequency", "train",
               "validation", "test")
    rows = []
    total = 0
    for ins in market.instruments:
        n = len(ins)
        total += n
        midnight = bool(np.all(ins.timestamps == ins.timestamps.astype("datetime64[D]")))
        counts = [f"{c}" if c >= needed else f"{c}*"
                  for c in split_counts(ins.timestamps, boundaries)]
        rows.append((ins.name, ins.source, str(n), format_timestamp(ins.timestamps[0], midnight),
                     format_timestamp(ins.timestamps[-1], midnight),
                     human_duration(median_bar_seconds([ins])), *counts))
    title = f"market data: {', '.join(cfg.source)}"
    windows = "; ".join(f"{s} {window_text(boundaries, s)}" for s in SPLITS)
    footer = (f"{len(market.instruments)} instruments, {total} bars, bar frequency "
              f"{human_duration(market.bar_seconds)}, {market.bars_per_year:.1f} bars per year\n"
              f"splits by calendar time, the same for every instrument: {windows} "
              f"({boundaries.rule})\n"
              f"counts are bars after each instrument's warm-up; * fewer than {needed} "
              f"(env.episode_length + 1): the instrument contributes none of them there\n"
              f"a check: nothing written")
    _render_table(headers, rows, title, footer)
    return 0


# ---------------------------------------------------------------------------------------------
# config show / config keys


def _args_config_show(p: argparse.ArgumentParser) -> None:
    _config_options(p)
    p.add_argument("--out", metavar="FILE", default=None,
                   help="write the YAML to this new file instead of stdout (default: stdout)")


def cmd_config_show(args: argparse.Namespace) -> int:
    """The resolved config as YAML, each key commented with its meaning and default."""
    from pathlib import Path

    from foxhunt_jax.config import load_config, resolve_config_path, show_yaml

    cfg = load_config(args.config, args.overrides)
    source = str(resolve_config_path(args.config))
    origin = f"# resolved from {source}" + (f" with {' '.join(args.overrides)}"
                                             if args.overrides else "")
    text = f"{origin}\n{show_yaml(cfg)}"
    if args.out is None:
        sys.stdout.write(text)
        print("# written to stdout; `foxhunt-jax config show --out FILE` writes a file")
        return 0
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"--out {out} exists; config show never replaces a file")
    try:
        with open(out, "x") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"cannot write {out} ({(e.strerror or str(e)).lower()})") from None
    print(f"config written to {out} (train --config {out} runs it)")
    return 0


def _args_config_keys(p: argparse.ArgumentParser) -> None:
    del p  # no options


def cmd_config_keys(args: argparse.Namespace) -> int:
    """Every dotted key with its type, default and meaning."""
    from foxhunt_jax.config import keys, yaml_line

    rows = [(k.key, k.type, yaml_line(k.default), k.meaning) for k in keys()]
    _render_table(("key", "type", "default", "meaning"), rows, "config keys",
                  f"{len(rows)} keys; set one with --set KEY=VALUE or in a YAML file "
                  "(foxhunt-jax config show prints a full one); nothing written")
    return 0


# ---------------------------------------------------------------------------------------------
# Registry and entry point

def _args_train(p: argparse.ArgumentParser) -> None:
    _config_options(p, None, " (default: default; with --resume, the run's own "
                             "DIR/config.yaml)")
    p.add_argument("--data", metavar="PATH|builtin:NAME", action="append", default=None,
                   help="market data replacing data.source (repeatable; default: the config's)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="run directory: new, empty, or a run of this program (default: "
                        "runs/<config>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --out")
    p.add_argument("--log", metavar="WRITERS", default="jsonl,tensorboard",
                   help="comma-separated epoch-record writers: jsonl (metrics.jsonl, always "
                        "written: resume and the report read it) and tensorboard (tb/ event "
                        "files); --log jsonl writes no event files")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (without a terminal there is none anyway)")
    g = p.add_argument_group(
        "several processes (hosts)",
        "every process runs the same command with its own --process-id; defaults come from "
        "FOXHUNT_COORDINATOR, FOXHUNT_NUM_PROCESSES, FOXHUNT_PROCESS_ID, FOXHUNT_DISTRIBUTED")
    g.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="address of process 0's coordination service (default: "
                        "FOXHUNT_COORDINATOR, else one process)")
    g.add_argument("--num-processes", metavar="K", default=None,
                   help="number of processes (default: FOXHUNT_NUM_PROCESSES, else 1)")
    g.add_argument("--process-id", metavar="I", default=None,
                   help="this process, 0..K-1 (default: FOXHUNT_PROCESS_ID, else 0)")
    g.add_argument("--distributed", choices=("auto", "off"), default=None,
                   help="auto: let jax.distributed.initialize detect the cluster (Slurm, Open "
                        "MPI, ...) for whatever the flags above leave out (default: "
                        "FOXHUNT_DISTRIBUTED, else off)")


def distributed_from_args(args: argparse.Namespace):
    """The :class:`foxhunt_jax.parallel.DistributedSpec` of ``train`` flags and environment."""
    from foxhunt_jax import parallel

    return parallel.distributed_spec(args.coordinator, args.num_processes, args.process_id,
                                     args.distributed)


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from foxhunt_jax import parallel

    spec = distributed_from_args(args)  # bad flags fail before anything starts
    parallel.initialize(spec)  # before any JAX computation

    from foxhunt_jax import api
    from foxhunt_jax.config import load_config

    overrides = list(args.overrides)
    if args.data:
        overrides.append("data.source=[" + ", ".join(repr(d) for d in args.data) + "]")
    out = Path(args.out) if args.out else Path("runs") / Path(args.config or "default").stem
    config = args.config
    if config is None:  # a resumed run continues with the config it was started with
        saved = out / "config.yaml"
        config = str(saved) if args.resume and saved.is_file() else "default"
    cfg = load_config(config, overrides)
    writers = tuple(w.strip() for w in args.log.split(",") if w.strip())
    # api.train turns the compilation caches on, checks, marks and locks --out before it loads
    # data or compiles, and ends with a line naming what it wrote
    api.train(cfg, out, resume=args.resume, progress=False if args.no_progress else None,
              log_to=writers)
    return 0


def _args_evaluate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", metavar="DIR", required=True,
                   help="a run directory written by train (required)")
    p.add_argument("--split", choices=("validation", "test"), default="test",
                   help="the split walked greedily from its first bar to its last")
    p.add_argument("--data", metavar="PATH|builtin:NAME", action="append", default=None,
                   help="evaluate on other market data (repeatable; default: the run's own "
                        "data); written to report/evaluate_<split>_<names>-<digest>.*")
    p.add_argument("--agent", choices=("selected", "last"), default="selected",
                   help="selected: the epoch chosen on validation (train.select_by); last: the "
                        "last checkpoint (written to report/evaluate_<split>_last.*) "
                        "(default: selected)")
    _member_option(p)


def _member_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--member", metavar="K", type=int, default=None,
                   help="of a population run (train.population > 1): member K's agent, under "
                        "its own seed and hyperparameters (required there; default: none)")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from foxhunt_jax import api

    api.evaluate(args.run, split=args.split, data=args.data, agent=args.agent,
                 member=args.member)  # turns the compile cache on
    return 0


def _args_act(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", metavar="DIR", required=True,
                   help="a run directory written by train, or a folder written by export "
                        "(required)")
    p.add_argument("--data", metavar="PATH|builtin:NAME", action="append", default=None,
                   help="bars to decide on (repeatable; default: the run's own data)")
    p.add_argument("--at", metavar="TIMESTAMP", default=None,
                   help="decide at each instrument's last bar at or before this time "
                        "(default: its last bar); later bars are not read")
    p.add_argument("--agent", choices=("selected", "last"), default="selected",
                   help="selected: the agent of the epoch chosen on validation "
                        "(train.select_by; a run from before selection gives its last agent and "
                        "the output says so); last: the latest checkpoint")
    _member_option(p)
    g = p.add_argument_group("portfolio held into the decision bar's close (default flat)")
    g.add_argument("--position", metavar="P", type=float, default=0.0,
                   help="the exposure held, one of the run's env.exposures")
    g.add_argument("--entry-price", metavar="PRICE", type=float, default=None,
                   help="its entry price (default: the decision bar's close)")
    g.add_argument("--units", metavar="U", type=float, default=None,
                   help="units held (default: position * equity / entry price)")
    g.add_argument("--take-profit-price", metavar="PRICE", type=float, default=None,
                   help="its take-profit level (default: none)")
    g.add_argument("--stop-loss-price", metavar="PRICE", type=float, default=None,
                   help="its stop-loss level (default: none)")
    g.add_argument("--bars-held", metavar="N", type=int, default=0,
                   help="bars since it was opened")
    g.add_argument("--equity", metavar="E", type=float, default=1.0,
                   help="equity at the decision bar's close (the run started at 1)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the decisions as JSON (default: none)")


def cmd_act(args: argparse.Namespace) -> int:
    from foxhunt_jax.policy.act import act, table, write_json
    from foxhunt_jax.policy.policy import Position

    position = Position(exposure=args.position, entry_price=args.entry_price, units=args.units,
                        take_profit=args.take_profit_price, stop_loss=args.stop_loss_price,
                        bars_held=args.bars_held, equity=args.equity)
    records, note = act(args.run, data=args.data, at=args.at, agent=args.agent,
                        position=position, member=args.member)
    held = ("flat" if position.exposure == 0 else f"exposure {position.exposure:+g}")
    last = max(r["data_last_timestamp"] for r in records)
    headers, rows = table(records)
    _render_table(headers, rows, f"decisions of {args.run}: {note}",
                  f"portfolio decided from: {held}, equity {position.equity:g}; data's last bar "
                  f"{last}; Q in reward units ({'--json' if not args.json else args.json} "
                  "has every branch)")
    if args.json:
        write_json(args.json, records)
        print(f"wrote {args.json} (the decisions as JSON)")
    return 0


def _args_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", metavar="DIR", required=True,
                   help="a run directory written by train (required)")
    p.add_argument("--out", metavar="DIR2", required=True,
                   help="the export folder to write (required; must not exist or be empty)")
    p.add_argument("--agent", choices=("selected", "last"), default="selected",
                   help="as for act")
    _member_option(p)


def cmd_export(args: argparse.Namespace) -> int:
    from foxhunt_jax.policy import Policy
    from foxhunt_jax.policy.export import export_policy

    policy = Policy.load(args.run, agent=args.agent, member=args.member)
    out = export_policy(policy, args.out)
    print(f"exported the agent of {args.run} ({policy.agent_note}) to {out}; "
          f"{out / 'load_policy.py'} loads it with jax and numpy only")
    return 0


def _args_walkforward(p: argparse.ArgumentParser) -> None:
    _config_options(p)
    p.add_argument("--data", metavar="PATH|builtin:NAME", action="append", default=None,
                   help="market data replacing data.source (repeatable; default: the config's)")
    p.add_argument("--folds", metavar="K", required=True,
                   help="folds: the data after the warm-up is cut into K + 1 blocks; fold k "
                        "trains on blocks before block k and tests on it (required)")
    p.add_argument("--window", default="expanding",
                   help="expanding (all earlier blocks, default) or sliding (the last "
                        "--sliding-blocks)")
    p.add_argument("--sliding-blocks", metavar="N", default="2",
                   help="blocks a sliding fold trains on (default 2)")
    p.add_argument("--validation-fraction", metavar="F", default="0.2",
                   help="the last part of each fold's training period that validates "
                        "(default 0.2)")
    p.add_argument("--out", metavar="DIR", required=True,
                   help="new or empty folder; gets fold_1..fold_K run folders, "
                        "walkforward.json and walkforward.png (required)")
    p.add_argument("--resume", action="store_true",
                   help="continue a walk-forward in --out (same config, folds and window; "
                        "default: off)")


def cmd_walkforward(args: argparse.Namespace) -> int:
    from pathlib import Path

    from foxhunt_jax.config import load_config
    from foxhunt_jax.jitcache import enable_compilation_cache
    from foxhunt_jax.research.walkforward import walkforward

    try:
        folds = int(args.folds)
    except ValueError:
        raise ConfigError(f"--folds must be an integer >= 1, got {args.folds!r}") from None
    try:
        sliding_blocks = int(args.sliding_blocks)
    except ValueError:
        raise ConfigError(f"--sliding-blocks must be an integer >= 1, got "
                          f"{args.sliding_blocks!r}") from None
    try:
        validation_fraction = float(args.validation_fraction)
    except ValueError:
        raise ConfigError(f"--validation-fraction must be in (0, 1), got "
                          f"{args.validation_fraction!r}") from None
    overrides = list(args.overrides)
    if args.data:
        overrides.append("data.source=[" + ", ".join(repr(d) for d in args.data) + "]")
    cfg = load_config(args.config, overrides)
    enable_compilation_cache()
    walkforward(cfg, folds, args.window, Path(args.out), resume=args.resume,
                sliding_blocks=sliding_blocks, validation_fraction=validation_fraction)
    return 0


def _args_bench(p: argparse.ArgumentParser) -> None:
    from foxhunt_jax.bench import add_arguments

    add_arguments(p)


def cmd_bench(args: argparse.Namespace) -> int:
    from foxhunt_jax.bench.runner import run

    run(args)
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(("data", "check"), "validate market data files and summarize them",
            _args_data_check, cmd_data_check),
    Command(("train",), "train the agent and write a run directory", _args_train, cmd_train),
    Command(("evaluate",), "evaluate a trained run on the validation or test split",
            _args_evaluate, cmd_evaluate),
    Command(("act",), "the trained agent's decision at the latest bar (or --at) of each "
            "instrument", _args_act, cmd_act),
    Command(("export",), "write a self-contained policy (jax.export program, parameters, "
            "statistics) that loads with jax and numpy only", _args_export, cmd_export),
    Command(("config", "show"), "print the resolved configuration as YAML, every key with its "
            "meaning and default", _args_config_show, cmd_config_show),
    Command(("config", "keys"), "list every config key with its type, default and meaning",
            _args_config_keys, cmd_config_keys),
    Command(("walkforward",), "train and test K folds through time; stitch the test blocks into "
            "one out-of-sample equity curve with its significance", _args_walkforward,
            cmd_walkforward),
    Command(("bench",), "time every phase, compile, collection, training and replay on this "
            "device; print tables and write JSON", _args_bench, cmd_bench),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foxhunt-jax",
        description="Distributional branching dueling Double-DQN trading agent in JAX.")
    parser.add_argument("--version", action="version", version=f"foxhunt-jax {__version__}")
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {
        (): parser.add_subparsers(dest="command", metavar="COMMAND")}
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {(): parser}
    for cmd in COMMANDS:
        for depth in range(1, len(cmd.path) + 1):
            prefix = cmd.path[:depth]
            if prefix in parsers:
                continue
            leaf = depth == len(cmd.path)
            sub = groups[prefix[:-1]].add_parser(
                prefix[-1], help=cmd.help if leaf else f"{prefix[-1]} commands",
                description=cmd.help if leaf else None, formatter_class=DefaultsHelpFormatter)
            parsers[prefix] = sub
            if leaf:
                cmd.add_arguments(sub)
                sub.set_defaults(_run=cmd.run)
            else:
                groups[prefix] = sub.add_subparsers(dest="_".join(prefix) + "_command",
                                                    metavar="SUBCOMMAND")
                sub.set_defaults(_help=sub)
    parser.set_defaults(_help=parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit status (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    run = getattr(args, "_run", None)
    if run is None:
        args._help.print_help(sys.stderr)
        return 2
    try:
        # the command's frames in one reserved stack chunk: its tracing does not pay CPython
        # 3.11/3.12's chunk mapping at every call (foxhunt_jax.pystack)
        return int(call_with_reserve(run, args))
    except FoxhuntError as err:
        message = " ".join(str(err).split("\n")).strip()
        print(f"error: {message}", file=sys.stderr)
        return int(getattr(err, "exit_code", 2))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "build_parser", "COMMANDS", "Command", "cmd_data_check", "cmd_train",
           "cmd_evaluate", "cmd_act", "cmd_export", "cmd_bench", "cmd_config_show",
           "cmd_config_keys", "cmd_walkforward", "human_duration"]
