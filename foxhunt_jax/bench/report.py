"""What a run leaves: the roofline derived from the device and forward sections, the markdown
tables, and ``--merge``, which joins the JSONs of runs that split the sections between them
(:func:`merge`)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from foxhunt_jax.bench.common import SHORT_DTYPE, format_rate, vname
from foxhunt_jax.bench.options import SECTIONS
from foxhunt_jax.bench.train import seed_train_rows
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import FoxhuntError
from foxhunt_jax.files import write_atomic


def roofline(res: dict, args) -> dict:
    """FLOPs and bytes per env step against the measured GEMM rate and bandwidth."""
    cfg = load_config(args.config, list(args.overrides))
    fwd = res.get("forward", {})
    dev = res.get("device", {})
    obs_dim = fwd.get("obs_dim")
    if not obs_dim or "gemm" not in dev:
        return {}
    q_flops = fwd["flops_per_row"]
    h, e = cfg.curiosity.hidden, cfg.curiosity.embed
    # RND: target and predictor, each D -> h -> h -> e
    rnd_flops = 0 if cfg.curiosity.coef == 0 else 2 * 2 * (obs_dim * h + h * h + h * e)
    # The fewest bytes an env step moves: the feature row gathered (F floats), open/high/low/
    # close/sigma at t and t+1, the episode state read and written (10 x 4 B each way), the
    # transition written (bar + 6 portfolio floats for s and s', 3 actions, reward, extrinsic,
    # bonus, novelty, 2 flags), what the priorities reuse of the step's forward (the greedy
    # actions and each branch's logits of the action taken) and the observation written and
    # read back by the next forward.
    f = obs_dim - 6
    nb = len(cfg.env.branch_sizes)
    reuse = 4 * nb + 4 * nb * cfg.network.atoms
    bytes_step = (4 * f + 2 * 5 * 4 + 2 * 10 * 4 + (2 * 28 + 12 + 16 + 2) + reuse
                  + 2 * obs_dim * 4)
    bf16 = dev["gemm"]["bf16"]["tflops"] * 1e12
    f32 = dev["gemm"]["f32_bf16x6"]["tflops"] * 1e12  # network.F32_PRECISION
    bw = dev["copy"]["gb_per_s"] * 1e9
    out = {"q_forward_flops": q_flops, "rnd_flops": rnd_flops, "bytes_per_step": bytes_step,
           "gemm_bf16_tflops": bf16 / 1e12, "gemm_f32_tflops": f32 / 1e12,
           "copy_gb_per_s": bw / 1e9}
    for name, rate in (("bf16", bf16), ("f32", f32)):
        # curiosity.precision "auto": three bf16 products per GEMM in a bf16 run, f32-accurate
        # (bf16 x6) in a float32 one (curiosity.py says why)
        t = q_flops / rate + rnd_flops / (bf16 / 3 if name == "bf16" else f32)
        out[f"floor_steps_per_s_{name}"] = 1.0 / max(t, bytes_step / bw)
        out[f"floor_steps_per_s_{name}_no_curiosity"] = 1.0 / max(q_flops / rate, bytes_step / bw)
    return out


def _f(x, fmt="{:.2f}"):
    """``x`` formatted, or "n/a" where it is missing or NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)



def step_text(step_ms) -> str:
    """A learner step's milliseconds, or why there is none (``train.overlap``)."""
    return "overlapped" if step_ms is None else f"{step_ms:.3f}"

def tables(res: dict) -> str:
    """The results as markdown tables."""
    lines = []
    meta = res.get("meta", {})
    lines.append(f"device: {meta.get('device')}  jax {meta.get('jax')}  commit {meta.get('commit')}")
    dev = res.get("device", {})
    if "gemm" in dev:
        g = dev["gemm"]
        lines.append(f"GEMM TFLOP/s: bf16 {g['bf16']['tflops']:.1f}, f32 as bf16x6 "
                     f"{g['f32_bf16x6']['tflops']:.1f}, f32 HIGHEST "
                     f"{g['f32_highest']['tflops']:.1f}, f32 default "
                     f"{g['f32_default']['tflops']:.1f}"
                     f"; copy {dev['copy']['gb_per_s']:.0f} GB/s (read+write)")
        sc = dev.get("scan", {})
        lines.append("lax.scan iteration: " + ", ".join(
            f"{k} {v['us_per_iteration']:.1f} us" if "us_per_iteration" in v else f"{k} error"
            for k, v in sc.items() if isinstance(v, dict)))
    seed = res.get("seed", {})
    if seed.get("rows"):
        lines += ["", f"Seed epoch ({seed['config']}, median [p25-p75] of {seed['epochs']} epochs "
                      f"after {seed['warmup']} warm-up), ms",
                  "| variant | experience | training (ms/step) | validation | total | compile s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in seed["rows"]:
            if "phases" not in r:
                lines.append(f"| {vname(r['backend'], r['dtype'])} | error: "
                             f"{r.get('error', '')[:80]} |||||")
                continue
            p = r["phases"]
            cell = lambda k: f"{p[k]['median']:.2f} [{p[k]['p25']:.2f}-{p[k]['p75']:.2f}]"
            lines.append(f"| {vname(r['backend'], r['dtype'])} | {cell('experience')} | "
                         f"{cell('training')} ({step_text(r['train_step_ms'])}) | "
                         f"{cell('validation')} | "
                         f"{cell('total')} | {r['compile_ms'] / 1e3:.2f} |")
    pop = res.get("population", {})
    if pop.get("rows"):
        lines += ["", f"Populations ({pop['config']}, {pop['variant']}, one program a phase; "
                      f"median of {pop['epochs']} epochs after {pop['warmup']} warm-up)",
                  "| P | epoch ms | Experience | Training | Validation | x P=1 | agent-epochs/s"
                  " | MiB a member |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in pop["rows"]:
            if "epoch_ms" not in r:
                lines.append(f"| {r['population']} | error: {r.get('error', '')[:80]} |||||||")
                continue
            phase = lambda k: _f(r.get("phase_ms", {}).get(k, {}).get("median"))  # noqa: E731
            lines.append(f"| {r['population']} | {r['epoch_ms']['median']:.2f} | "
                         f"{phase('experience')} | {phase('training')} | {phase('validation')} | "
                         f"{_f(r.get('time_vs_single'))} | {_f(r['agent_epochs_per_s'], '{:.1f}')}"
                         f" | {r['state_bytes_per_member'] / 2**20:.2f} |")
    comp = res.get("compile", {})
    if comp.get("cold", {}).get("rows"):
        lines += ["", "Whole-epoch compile (the phase programs; a fourth pairs Validation and the"
                      " next Experience where both rollouts are kernels) and the state-init"
                      " program, s: cold = a fresh process per variant with empty caches; then"
                      " fresh processes"
                      " with the caches it filled: JAX's persistent cache"
                      " only (XLA cache) and with the executable cache too (loaded: programs"
                      " it served)",
                  "| variant | cold compile | cold init | XLA cache compile | executable cache"
                  " compile (loaded) | its init |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        rows = {name: {(r["backend"], r["dtype"]): r for r in comp.get(name, {}).get("rows", [])}
                for name in ("cached_xla_only", "cached")}
        for c in comp["cold"]["rows"]:
            v = (c["backend"], c["dtype"])
            x, w = rows["cached_xla_only"].get(v, {}), rows["cached"].get(v, {})
            lines.append(f"| {vname(*v)} | {c['compile_ms'] / 1e3:.2f} | "
                         f"{c['init_ms'] / 1e3:.2f} | "
                         f"{_f(x.get('compile_ms', float('nan')) / 1e3)} | "
                         f"{_f(w.get('compile_ms', float('nan')) / 1e3)} "
                         f"({w.get('executables_loaded', '-')}/{w.get('programs', '-')}) | "
                         f"{_f(w.get('init_ms', float('nan')) / 1e3)} |")
    for name in ("cold", "cached_xla_only", "cached"):
        if "error" in comp.get(name, {}):
            lines.append(f"compile {name}: error {comp[name]['error'][-200:]}")
    cb = res.get("cmdbuf", {})
    if cb.get("rows") or "error" in cb:
        lines += ["", f"Seed epoch without while loops in command buffers ({cb.get('xla_flags')}),"
                      f" fresh process, median of {cb.get('epochs')} epochs, ms"]
        for r in cb.get("rows", []):
            if "phases" in r:
                p = r["phases"]
                lines.append(f"{vname(r['backend'], r['dtype'])}: total {p['total']['median']:.2f}"
                             f" (experience {p['experience']['median']:.2f}, training "
                             f"{p['training']['median']:.2f}, validation "
                             f"{p['validation']['median']:.2f}); compile "
                             f"{r['compile_ms'] / 1e3:.2f} s")
        if "error" in cb:
            lines.append(f"error: {cb['error'][-300:]}")
    fwd = res.get("forward", {})
    if fwd.get("rows"):
        lines += ["", f"Q-forward alone ({fwd['flops_per_row']:,} FLOP/row; Pallas launch = "
                      "layout:rows:warps:min_rows)",
                  "| N | variant | launch | ms | rows/s | TFLOP/s | q rel err vs Flax | "
                  "action mismatches |",
                  "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in sorted(fwd["rows"], key=lambda r: (r["n"], r["dtype"], r["backend"])):
            lines.append(f"| {r['n']:,} | {vname(r['backend'], r['dtype'])} | {r['config']} | "
                         f"{r['ms']:.3f} | {format_rate(r['rows_per_s'])} | {_f(r['tflops'], '{:.1f}')} | "
                         f"{_f(r.get('q_rel_err'), '{:.1e}')} | {r.get('action_mismatch', '-')} |")
    for r in fwd.get("equality", []):
        if "error" in r:
            lines.append(f"pallas/{SHORT_DTYPE.get(r.get('dtype'), '?')} "
                         f"{r.get('config', r.get('kind'))}: error {r['error'][:200]}")
    col = res.get("collect", {})
    if col.get("rows"):
        lines += ["", f"Collection, env-steps/s (L = {col.get('episode_length')}; rollout = the "
                      "collection loop, experience = collect + replay add)",
                  "| N | kind | " + " | ".join(vname(b, d) for b, d in res["meta"]["variants"]) + " |",
                  "| ---: | --- | " + " | ".join("---:" for _ in res["meta"]["variants"]) + " |"]
        keys = sorted({(r["n"], r["kind"]) for r in col["rows"]})
        for n, kind in keys:
            cells = []
            for b, d in res["meta"]["variants"]:
                r = next((x for x in col["rows"] if x["n"] == n and x["kind"] == kind
                          and x["backend"] == b and x["dtype"] == d), None)
                cells.append("-" if r is None else ("error" if "error" in r else
                                                    format_rate(r["env_steps_per_s"])))
            lines.append(f"| {n:,} | {kind} | " + " | ".join(cells) + " |")
        for r in col.get("breakdown", []):
            if "ms" in r:
                lines.append(f"breakdown N={r['n']:,} {vname(r['backend'], r['dtype'])} "
                             f"{r['kind']}: {r['ms']:.2f} ms ({r['us_per_step']:.1f} us/step), "
                             f"{format_rate(r['env_steps_per_s'])} env-steps/s")
    trn = res.get("train", {})
    if trn.get("rows"):
        lines += ["", "Training throughput",
                  "| precision | batch | ms/step | steps/s | samples/s |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for r in trn["rows"]:
            if "step_ms" in r:
                samples = r["samples_per_s"]
                lines.append(f"| {r['dtype']} | {r['batch']} | {r['step_ms']:.3f} | "
                             f"{_f(r['steps_per_s'], '{:.0f}')} | "
                             f"{_f(samples and samples / 1e6)}M |")
    rep = res.get("replay", {})
    if rep.get("rows"):
        lines += ["", "Replay (ms, median)", "| capacity | op | ours | flashbax | flashbax / ours |",
                  "| ---: | --- | ---: | ---: | ---: |"]
        for r in rep["rows"]:
            lines.append(f"| {r['capacity']:,} | {r['op']} | {_f(r['ours_ms'], '{:.3f}')} | "
                         f"{_f(r['flashbax_ms'], '{:.3f}')} | {_f(r['ratio'])} |")
    pol = res.get("policy", {})
    if pol.get("rows"):
        lines += ["", "A live decision (Policy.step), microseconds a call",
                  "| variant | path | instruments | median | p99 |", "| --- | --- | ---: | ---: | ---: |"]
        for r in pol["rows"]:
            lines.append(f"| {vname(r['backend'], r['dtype'])} | {r['path']} | "
                         f"{r['instruments']:,} | {r['median_us']:.0f} | {r['p99_us']:.0f} |")
    roof = res.get("roofline", {})
    if roof:
        lines += ["", f"Roofline per env step: Q-forward {roof['q_forward_flops']:,} FLOP, "
                      f"curiosity {roof['rnd_flops']:,} FLOP (bf16 x3 in bf16, else f32), "
                      f">= {roof['bytes_per_step']} B; "
                      f"floor {roof['floor_steps_per_s_bf16'] / 1e9:.2f}e9 env-steps/s in bf16 "
                      f"({roof['floor_steps_per_s_bf16_no_curiosity'] / 1e9:.2f}e9 without "
                      f"curiosity), {roof['floor_steps_per_s_f32'] / 1e9:.2f}e9 in f32"]
    return "\n".join(lines)


def merge(parts: list[tuple[str, dict]]) -> dict:
    """One result from the JSONs of runs that split the sections between them (a device that
    limits each command's time, say): ``parts`` is ``[(name, result), ...]`` in run order.

    Each section comes from the last part that has it; ``train`` gains the seed-batch rows of a
    seed section run in another part (:func:`seed_train_rows`); the roofline is recomputed
    from the merged device and forward sections. ``meta`` is the first part's, with every
    part's file, commit, date and command under ``meta.parts`` and ``meta.command`` listing the
    commands; ``meta.commit`` is the parts' commit, or ``"mixed"`` where they differ.
    """
    if not parts:
        raise SystemExit("error: bench --merge needs at least one JSON file")
    meta = dict(parts[0][1].get("meta", {}))
    meta["parts"] = [{"file": name, **{k: r.get("meta", {}).get(k)
                                       for k in ("commit", "date", "command")}}
                     for name, r in parts]
    meta["command"] = [p["command"] for p in meta["parts"]]
    commits = {p["commit"] for p in meta["parts"]}
    meta["commit"] = commits.pop() if len(commits) == 1 else "mixed"
    res: dict = {"meta": meta}
    for name in SECTIONS:
        for _, r in parts:
            if name in r:
                res[name] = r[name]
    meta["sections"] = [n for n in SECTIONS if n in res]
    if "train" in res and "seed" in res and not any(
            row.get("source") == "seed section" for row in res["train"].get("rows", [])):
        res["train"] = dict(res["train"], rows=seed_train_rows(res["seed"].get("rows", []))
                            + list(res["train"].get("rows", [])))
    args = argparse.Namespace(config=meta.get("config") or "seed",
                              overrides=list(meta.get("overrides") or []))
    res["roofline"] = roofline(res, args)
    return res


def check_bench_json(obj: Any, path: str) -> dict:
    """``obj`` if it is a result this command wrote (an object with a ``meta`` object holding
    commit, date and command, and at least one section, each an object); else FoxhuntError
    naming ``path``."""
    def refuse(why: str):
        raise FoxhuntError(f"bench --merge: {path} is not a bench result JSON: {why}")

    if not isinstance(obj, dict):
        refuse(f"it holds a JSON {type(obj).__name__}, not an object")
    meta = obj.get("meta")
    if not isinstance(meta, dict):
        refuse("no 'meta' object")
    missing = [k for k in ("commit", "date", "command") if k not in meta]
    if missing:
        refuse(f"'meta' lacks {', '.join(missing)}")
    sections = [name for name in SECTIONS if name in obj]
    if not sections:
        refuse(f"no section ({', '.join(SECTIONS)})")
    for name in sections:
        if not isinstance(obj[name], dict):
            refuse(f"section '{name}' is not an object")
    return obj


def read_bench_json(path: str) -> dict:
    """One ``--merge`` input: a regular file holding valid JSON that passes
    :func:`check_bench_json`; every failure is one FoxhuntError naming the file."""
    p = Path(path)
    if not p.is_file():  # is_file is False for a FIFO or device too, which must not be read
        why = "no such file" if not p.exists() else "not a regular file"
        raise FoxhuntError(f"bench --merge: cannot read {path}: {why}")
    try:
        obj = json.loads(p.read_bytes())
    except OSError as e:
        raise FoxhuntError(f"bench --merge: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise FoxhuntError(f"bench --merge: {path} is not valid JSON: {e}") from None
    return check_bench_json(obj, path)


def run_merge(args) -> dict:
    """``--merge A.json B.json ...``: :func:`merge`, its tables printed, written to ``--json``."""
    parts = [(Path(f).name, read_bench_json(f)) for f in args.merge]
    try:
        res = merge(parts)
        text = tables(res)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field of another format
        raise FoxhuntError(f"bench --merge: {', '.join(args.merge)}: not the results of this "
                           f"version of the bench ({type(e).__name__}: {e})") from None
    print(text, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(res, indent=2, default=str))
    print(wrote_line(args.json), flush=True)
    return res


def wrote_line(json_path: str | None) -> str:
    """The bench's last line: the JSON file it wrote, or that it wrote none."""
    if json_path:
        return f"wrote {json_path} (the results as JSON)"
    return "wrote no file (--json FILE writes the results as JSON)"
