"""Checkpoints with orbax: atomic, synchronous, arrays + JSON only (nothing that can run code).

A checkpoint of step ``s`` is the orbax directory ``ckpt_dir/<s>/`` with three items:

* ``state``: the leaves of the state pytree as a flat dict ``{"leaf_00000": array, ...}`` in
  ``jax.tree_util`` flattening order. Typed PRNG keys (``jax.random.key``) are stored as their
  raw ``uint32`` key data and wrapped again on restore; Python and NumPy scalars are stored as
  0-d arrays. Storing leaves flat (instead of orbax's own view of the tree) makes any pytree work
  the same way: dicts, optax states (NamedTuples), ``flax.struct`` dataclasses.
  Replicated jax arrays of one dtype and placement are packed into one vector,
  ``"pack_000"``, ...: orbax's time grows with the number of arrays more than with their bytes,
  and the agent alone is 62 replicated arrays (docs/training.md gives the measurements).
* ``layout`` (JSON): path, shape, dtype and kind of every leaf (and, for a packed leaf, its pack
  and offset), checked against the restore target so a checkpoint of another configuration
  fails with one line naming the first leaf that differs. Checkpoints written before packing
  (no ``packs`` in the layout) restore leaf by leaf, as before.
* ``metadata`` (JSON): the caller's dict (epoch, config, the selection, ...).

A run folder holds two such folders: ``checkpoints/`` (the whole trainer state) and
``selected/``, whose step ``e`` holds the network parameters of the agent selected at epoch
``e`` (:func:`restore_selected` says which step a state at a given epoch uses).

orbax writes a step into a temporary directory and renames it when complete; a step whose save
was interrupted is never listed by :func:`latest_step` and its leftovers are removed by the next
save. Saves are synchronous: when :func:`save` returns the checkpoint is complete on disk. The
last ``keep`` (default 2) checkpoints are kept.

After the save, ``<s>/digests.json`` records the size and CRC-32 of every file of the step;
:func:`restore` checks them first (a step saved before digests existed, or killed before its
digests were written, is checked by reading it). A damaged step (a file truncated, garbled or
missing, a layout that is not JSON, an array orbax cannot read) raises
:class:`DamagedCheckpoint`; :func:`restore_latest` then warns and falls back to the newest
intact step.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.errors import FoxhuntError, NonFiniteError
from foxhunt_jax.files import write_atomic
from foxhunt_jax.training.rundir import to_jsonable

KEEP = 2
SELECTED_DIR = "selected"  # the run folder's checkpoints of the selected agent's parameters
DIGESTS_FILE = "digests.json"


class DamagedCheckpoint(FoxhuntError):
    """A checkpoint step that cannot be read back as it was written; names the step and why."""


def _quiet_orbax() -> None:
    """orbax reports every save at INFO through absl; the trainer prints its own line."""
    from absl import logging as absl_logging

    if absl_logging.get_verbosity() > absl_logging.WARNING:
        absl_logging.set_verbosity(absl_logging.WARNING)


def _manager(ckpt_dir: str | os.PathLike, keep: int = KEEP, read_only: bool = False):
    import orbax.checkpoint as ocp

    _quiet_orbax()
    # read_only=True would log warnings on every call: a reader simply never saves.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=False,  # a kill right after save() must leave it complete
        cleanup_tmp_directories=not read_only,  # leftovers of an interrupted save
        create=not read_only,
    )
    return ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=options,
                                 item_names=("state", "layout", "metadata"))


# ---------------------------------------------------------------------------------------------
# Leaves


def path_str(path: tuple) -> str:
    """A ``jax.tree_util`` key path as ``"params/trunk_0/kernel"``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _is_typed_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _kind(leaf: Any) -> str:
    """How a leaf is stored and rebuilt: typed key, jax array, numpy array/scalar, Python scalar."""
    if _is_typed_key(leaf):
        return f"prng_key {leaf.dtype}"  # e.g. key<fry>: also known for a ShapeDtypeStruct
    if isinstance(leaf, (bool, int, float)):
        return "python_" + type(leaf).__name__
    if isinstance(leaf, np.generic):
        return "numpy_scalar"
    if isinstance(leaf, np.ndarray):
        return "numpy"
    return "jax"


def _storable(leaf: Any) -> Any:
    """The array orbax stores for a leaf (typed keys -> uint32 key data, scalars -> 0-d arrays)."""
    if _is_typed_key(leaf):
        return jax.random.key_data(leaf)  # stays a (possibly sharded) jax array
    if isinstance(leaf, (bool, int, float, np.generic)):
        return np.asarray(leaf)
    return leaf


def _restore_target(leaf: Any) -> Any:
    """What orbax restores into for a target leaf (shape, dtype and, for jax arrays, sharding)."""
    if _is_typed_key(leaf):
        if isinstance(leaf, jax.Array):  # restore the key data with the key's own sharding
            data = jax.random.key_data(leaf)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)
        data = jax.eval_shape(jax.random.key_data, leaf)
        return np.zeros(data.shape, data.dtype)  # abstract key: restored on host, then placed
    if isinstance(leaf, (bool, int, float, np.generic)):
        return np.asarray(leaf)
    return leaf


def _rebuild(value: Any, target: Any, saved: dict) -> Any:
    """The restored array in the form of the target leaf (``saved``: its layout entry)."""
    if _is_typed_key(target):
        key = jax.random.wrap_key_data(jnp.asarray(value), impl=saved["impl"])
        sharding = getattr(target, "sharding", None)
        if sharding is None or isinstance(value, jax.Array):
            return key
        return jax.device_put(key, sharding)
    if isinstance(target, (bool, int, float)):
        return type(target)(np.asarray(value).item())
    if isinstance(target, np.generic):
        return np.asarray(value, dtype=target.dtype)[()]
    if isinstance(target, np.ndarray):
        return np.asarray(value)
    return value


# Larger arrays are saved by themselves: per-array overhead matters little next to their bytes,
# and packing them would hold a second copy of them on the device while saving.
PACK_MAX_BYTES = 4 << 20


def _pack_group(value: Any) -> tuple | None:
    """Which pack a stored leaf joins: replicated jax arrays up to ``PACK_MAX_BYTES``, by dtype
    and placement (None: saved by itself)."""
    if (isinstance(value, jax.Array) and value.sharding.is_fully_replicated
            and value.nbytes <= PACK_MAX_BYTES):
        return str(value.dtype), value.sharding
    return None


@functools.cache
def _concat(sharding) -> Any:
    return jax.jit(lambda *xs: jnp.concatenate([jnp.ravel(x) for x in xs]),
                   out_shardings=sharding)


def _packed_payload(stored: list, layout: list[dict]) -> tuple[dict, list[dict]]:
    """What orbax saves: packs of replicated leaves (``layout`` entries get ``"pack": [pack,
    offset]``) and every other leaf by itself. Returns ``(payload, packs)``."""
    groups: dict = {}
    for i, value in enumerate(stored):
        key = _pack_group(value)
        if key is not None:
            groups.setdefault(key, []).append(i)
    payload, packs = {}, []
    for (dtype, sharding), idx in groups.items():
        if len(idx) < 2:
            continue
        offset = 0
        for i in idx:
            layout[i]["pack"] = [len(packs), offset]
            offset += int(np.prod(stored[i].shape, dtype=np.int64))
        payload[f"pack_{len(packs):03d}"] = _concat(sharding)(*[stored[i] for i in idx])
        packs.append({"dtype": dtype, "size": offset})
    for i, value in enumerate(stored):
        if "pack" not in layout[i]:
            payload[f"leaf_{i:05d}"] = value
    return payload, packs


def _pack_target(pack: dict, targets: list) -> Any:
    """The restore target of a pack: placed like its leaves' targets when they agree, else a
    host array (then each piece is placed by itself)."""
    shardings = {getattr(t, "sharding", None) for t in targets}
    sharding = shardings.pop() if len(shardings) == 1 else None
    if sharding is None:
        return np.zeros((pack["size"],), jnp.dtype(pack["dtype"]))
    return jax.ShapeDtypeStruct((pack["size"],), jnp.dtype(pack["dtype"]), sharding=sharding)


def _unpack(flat: Any, entries: list[dict], targets: list) -> list:
    """The leaves of a restored pack, each shaped by its layout entry and placed like its
    target (a host pack gives host pieces, turned into jax arrays for jax targets)."""
    pieces = []
    for entry, target in zip(entries, targets):
        offset, shape = entry["pack"][1], tuple(entry["shape"])
        size = int(np.prod(shape, dtype=np.int64))
        piece = flat[offset:offset + size].reshape(shape)
        sharding = getattr(target, "sharding", None)
        if sharding is not None and getattr(piece, "sharding", None) != sharding:
            # a slice of a replicated vector is replicated; this names the target's placement
            # (e.g. P("data") on a one-device mesh) without moving data
            piece = jax.device_put(piece, sharding)
        elif isinstance(piece, np.ndarray) and not isinstance(target, np.ndarray):
            piece = jnp.asarray(piece)
        pieces.append(piece)
    return pieces


def _layout(tree: Any) -> tuple[list, list[dict], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in flat]
    layout = []
    for path, leaf in flat:
        stored = _restore_target(leaf)  # array or ShapeDtypeStruct: both have shape and dtype
        entry = {"path": path_str(path), "kind": _kind(leaf), "shape": list(stored.shape),
                 "dtype": str(stored.dtype)}
        if _is_typed_key(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
            entry["impl"] = str(jax.random.key_impl(leaf))  # name wrap_key_data accepts
        layout.append(entry)
    return leaves, layout, treedef


# ---------------------------------------------------------------------------------------------
# Public API


def save(ckpt_dir: str | os.PathLike, step: int, state: Any, metadata: dict,
         keep: int = KEEP) -> Path:
    """Saves ``state`` (any pytree of arrays, typed keys, scalars) and ``metadata`` (JSON).

    Synchronous and atomic; keeps the last ``keep`` steps. Saving a step that already exists
    replaces it. Returns the step directory.
    """
    import orbax.checkpoint as ocp

    meta = to_jsonable(metadata)
    leaves, layout, _ = _layout(state)
    payload, packs = _packed_payload([_storable(leaf) for leaf in leaves], layout)
    mgr = _manager(ckpt_dir, keep=keep)
    try:
        if step in mgr.all_steps():
            mgr.delete(step)
        mgr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(payload),
            layout=ocp.args.JsonSave({"leaves": layout, "packs": packs}),
            metadata=ocp.args.JsonSave(meta),
        ), force=True)
        mgr.wait_until_finished()
    finally:
        mgr.close()
    step_dir = Path(ckpt_dir) / str(int(step))
    if jax.process_index() == 0:
        _write_digests(step_dir)
    return step_dir


def drop_after(ckpt_dir: str | os.PathLike, step: int) -> list[int]:
    """Deletes the complete steps after ``step`` (what a resume's or a fresh start's run
    will write again); returns them. Every process calls it, as :func:`save`."""
    later = [s for s in all_steps(ckpt_dir) if s > step]
    if later:
        mgr = _manager(ckpt_dir)
        try:
            for s in later:
                mgr.delete(s)
        finally:
            mgr.close()
    return later


# ---------------------------------------------------------------------------------------------
# Integrity


def _file_digest(path: Path) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": crc}


def _step_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != DIGESTS_FILE)


def _write_digests(step_dir: Path) -> None:
    """``digests.json`` of a complete step: size and CRC-32 of each file (written atomically)."""
    files = {str(p.relative_to(step_dir)): _file_digest(p) for p in _step_files(step_dir)}
    write_atomic(step_dir / DIGESTS_FILE, json.dumps({"format": 1, "files": files}, indent=1))


def verify(ckpt_dir: str | os.PathLike, step: int) -> bool:
    """Checks step ``step`` against its ``digests.json``: True when it matches, False when the
    step has no digests (then only reading it tells); DamagedCheckpoint naming the first file
    that is missing, of another size or of other contents."""
    step_dir = Path(ckpt_dir) / str(int(step))
    where = str(step_dir)
    path = step_dir / DIGESTS_FILE
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text())["files"]
        wanted = {str(name): (int(d["size"]), int(d["crc32"])) for name, d in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise DamagedCheckpoint(f"checkpoint {where}: {DIGESTS_FILE} is not readable") from None
    present = {str(p.relative_to(step_dir)) for p in _step_files(step_dir)}
    missing = sorted(set(wanted) - present)
    if missing:
        raise DamagedCheckpoint(f"checkpoint {where}: file {missing[0]} is missing")
    for name, (size, crc) in sorted(wanted.items()):
        got = _file_digest(step_dir / name)
        if got["size"] != size:
            raise DamagedCheckpoint(f"checkpoint {where}: file {name} has {got['size']} bytes, "
                                    f"{size} were written")
        if got["crc32"] != crc:
            raise DamagedCheckpoint(f"checkpoint {where}: file {name} differs from what was "
                                    "written (CRC-32)")
    return True


def all_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint, ascending (``[]`` if the directory does not exist)."""
    if not Path(ckpt_dir).is_dir():
        return []
    mgr = _manager(ckpt_dir, read_only=True)
    try:
        return sorted(int(s) for s in mgr.all_steps())
    finally:
        mgr.close()


def latest_step(ckpt_dir: str | os.PathLike) -> int | None:
    """The newest complete checkpoint step, or None."""
    steps = all_steps(ckpt_dir)
    return steps[-1] if steps else None


def restore(ckpt_dir: str | os.PathLike, step: int | None, target: Any,
            prefix: str | None = None) -> tuple[Any, dict]:
    """Restores step ``step`` (None: the latest) into the structure of ``target``.

    ``target`` gives the tree structure, shapes, dtypes and shardings (a state built the same
    way as the saved one; its values are not used). ``prefix`` (e.g. ``"agent/params"``):
    ``target`` is the saved subtree at that path, and only its layout must match; the rest of
    the step is read but not checked or returned. Returns ``(state, metadata)``. The step is
    verified first (:func:`verify`); a damaged one raises :class:`DamagedCheckpoint`, a
    checkpoint of another state layout FoxhuntError.
    """
    steps = all_steps(ckpt_dir)
    if step is None:
        if not steps:
            raise FoxhuntError(f"no checkpoint in {ckpt_dir}")
        step = steps[-1]
    if step not in steps:
        raise FoxhuntError(f"no checkpoint of step {step} in {ckpt_dir} (have: {steps or 'none'})")
    verify(ckpt_dir, step)
    try:
        return _restore(ckpt_dir, step, target, prefix)
    except (FoxhuntError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - whatever orbax or tensorstore raise on bad bytes
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DamagedCheckpoint(f"checkpoint {ckpt_dir}/{step} cannot be read "
                                f"({type(e).__name__}: {first})") from None


def restore_latest(ckpt_dir: str | os.PathLike, target: Any,
                   warn=lambda line: None) -> tuple[Any, dict, int]:
    """Restores the newest intact step: a damaged one is skipped with one ``warn`` line naming
    it. Returns ``(state, metadata, step)``; FoxhuntError when no step is intact."""
    steps = all_steps(ckpt_dir)
    if not steps:
        raise FoxhuntError(f"no checkpoint in {ckpt_dir}")
    found = _newest_intact(ckpt_dir, steps, target, lambda e: warn(f"warning: {e}; skipped"))
    if found is None:
        raise FoxhuntError(f"no intact checkpoint in {ckpt_dir} (steps "
                           f"{', '.join(map(str, steps))} are damaged)")
    return found


def _newest_intact(ckpt_dir, steps: list[int], target: Any, skipped) -> tuple | None:
    """``(tree, metadata, step)`` of the newest of ``steps`` that restores; ``skipped(error)``
    for each damaged one passed over; None when all are damaged."""
    for step in reversed(steps):
        try:
            tree, meta = restore(ckpt_dir, step, target)
        except DamagedCheckpoint as e:
            skipped(e)
            continue
        return tree, meta, step
    return None


def restore_selected(selected_dir: str | os.PathLike, epoch: int, target: Any,
                     warn=lambda line: None) -> tuple[Any, dict, int] | None:
    """The selected agent of a run whose state is at ``epoch``: the newest intact step of
    ``selected_dir`` at or before ``epoch`` (later steps were selected after that state, by a
    run killed before its next checkpoint). A damaged step is skipped with one ``warn`` line and
    the selection before it is used. Returns ``(params, metadata, step)``, None when there is
    no step (a run from before selection); FoxhuntError when every step is damaged."""
    steps = [s for s in all_steps(selected_dir) if s <= epoch]
    if not steps:
        return None
    found = _newest_intact(selected_dir, steps, target, lambda e: warn(
        f"warning: {e}; skipped, the agent selected before it is used"))
    if found is not None:
        return found
    raise FoxhuntError(f"no intact selected agent in {selected_dir} (steps "
                       f"{', '.join(map(str, steps))} are damaged); --agent last uses the last "
                       "checkpoint")


def _subtree(saved: list[dict], prefix: str | None) -> list[int]:
    """Indices of the saved leaves at or under path ``prefix`` (None: all of them)."""
    if prefix is None:
        return list(range(len(saved)))
    return [i for i, e in enumerate(saved)
            if e["path"] == prefix or e["path"].startswith(prefix + "/")]


def _restore(ckpt_dir: str | os.PathLike, step: int, target: Any,
             prefix: str | None = None) -> tuple[Any, dict]:
    import orbax.checkpoint as ocp

    leaves, layout, treedef = _layout(target)
    mgr = _manager(ckpt_dir, read_only=True)
    try:
        saved = mgr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))
        saved_layout, packs = saved["layout"]["leaves"], saved["layout"].get("packs", [])
        wanted = _subtree(saved_layout, prefix)
        strip = 0 if prefix is None else len(prefix) + 1
        _check_layout([dict(saved_layout[i], path=saved_layout[i]["path"][strip:])
                       for i in wanted], layout, f"{ckpt_dir}/{step}")
        targets = dict(zip(wanted, map(_restore_target, leaves)))
        targets = [targets[i] if i in targets else  # outside the subtree: read to the host
                   np.zeros(e["shape"], np.dtype(e["dtype"])) for i, e in enumerate(saved_layout)]
        members = [[] for _ in packs]  # each pack's leaf indices, in the pack's order
        for i, entry in enumerate(saved_layout):
            if "pack" in entry:
                members[entry["pack"][0]].append(i)
        payload = {f"leaf_{i:05d}": t for i, (t, e) in enumerate(zip(targets, saved_layout))
                   if "pack" not in e}
        for j, (pack, idx) in enumerate(zip(packs, members)):
            payload[f"pack_{j:03d}"] = _pack_target(pack, [targets[i] for i in idx])
        out = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(payload), metadata=ocp.args.JsonRestore()))
    finally:
        mgr.close()
    values = {i: out["state"][f"leaf_{i:05d}"] for i, e in enumerate(saved_layout)
              if "pack" not in e}
    for j, idx in enumerate(members):
        pieces = _unpack(out["state"][f"pack_{j:03d}"], [saved_layout[i] for i in idx],
                         [targets[i] for i in idx])
        values.update(zip(idx, pieces))
    restored = [_rebuild(values[i], leaf, saved_layout[i]) for i, leaf in zip(wanted, leaves)]
    return jax.tree_util.tree_unflatten(treedef, restored), out["metadata"]


# what a layout that differs means: a checkpoint of another config, or of an older state layout
_LAYOUT_CAUSE = "another configuration, or an earlier version of foxhunt-jax"


def _check_layout(saved: list[dict], wanted: list[dict], where: str) -> None:
    if len(saved) != len(wanted):
        raise FoxhuntError(f"checkpoint {where} holds {len(saved)} arrays, this run's state has "
                           f"{len(wanted)} ({_LAYOUT_CAUSE})")
    for s, w in zip(saved, wanted):
        for field in ("path", "shape", "dtype", "kind"):
            # A jax leaf may come back as numpy and back; only PRNG keys must stay keys.
            if field == "kind" and "prng_key" not in s[field] + w[field]:
                continue
            if s[field] != w[field]:
                raise FoxhuntError(
                    f"checkpoint {where}: leaf '{s['path']}' has {field} {s[field]}, this run "
                    f"expects {w[field]} ({_LAYOUT_CAUSE})")


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    """``[n leaves] -> bool [n]``: one compiled call per tree layout, one transfer."""
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def assert_finite(tree: Any, what: str, epoch: int) -> None:
    """Raises NonFiniteError naming the epoch and the first leaf with a NaN or Inf.

    Integer, boolean and PRNG-key leaves are skipped. One device->host transfer of one boolean
    per leaf (plus one for the leaf that failed). ``what`` names the quantity ("loss",
    "params"); the message reads "epoch 3: loss is NaN" for a single unnamed value and
    "epoch 3: params contain Inf (leaf 'trunk_0/kernel')" for a tree.
    """
    flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if not _is_typed_key(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not flat:
        return
    ok = jax.device_get(_all_finite([x for _, x in flat]))
    bad = next((i for i, good in enumerate(ok) if not good), None)
    if bad is None:
        return
    path, leaf = flat[bad]
    kind = "NaN" if bool(jax.device_get(jnp.any(jnp.isnan(leaf)))) else "Inf"
    if len(flat) == 1 and not path:
        raise NonFiniteError(f"epoch {epoch}: {what} is {kind}")
    verb = "contain" if what.endswith("s") else "contains"
    raise NonFiniteError(f"epoch {epoch}: {what} {verb} {kind} (leaf '{path_str(path)}')")


__all__ = ["save", "restore", "restore_latest", "restore_selected", "drop_after",
           "SELECTED_DIR", "verify", "DamagedCheckpoint", "latest_step",
           "all_steps", "assert_finite", "path_str", "KEEP"]
