"""Checkpoints with orbax: atomic, synchronous, arrays + JSON only (nothing that can run code).

A checkpoint of step ``s`` is the orbax directory ``ckpt_dir/<s>/`` with three items:

* ``state``: the leaves of the state pytree as a flat dict ``{"leaf_00000": array, ...}`` in
  ``jax.tree_util`` flattening order. Typed PRNG keys (``jax.random.key``) are stored as their
  raw ``uint32`` key data and wrapped again on restore; Python and NumPy scalars are stored as
  0-d arrays. Storing leaves flat (instead of orbax's own view of the tree) makes any pytree work
  the same way: dicts, optax states (NamedTuples), ``flax.struct`` dataclasses.
* ``layout`` (JSON): path, shape, dtype and kind of every leaf, checked against the restore
  target so a checkpoint of another configuration fails with one line naming the first leaf
  that differs.
* ``metadata`` (JSON): the caller's dict (epoch, config, ...).

orbax writes a step into a temporary directory and renames it when complete; a step whose save
was interrupted is never listed by :func:`latest_step` and its leftovers are removed by the next
save. Saves are synchronous: when :func:`save` returns the checkpoint is complete on disk. The
last ``keep`` (default 2) checkpoints are kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.errors import FoxhuntError, NonFiniteError

KEEP = 2


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

    from foxhunt_jax.training.rundir import to_jsonable

    meta = to_jsonable(metadata)
    leaves, layout, _ = _layout(state)
    payload = {f"leaf_{i:05d}": _storable(leaf) for i, leaf in enumerate(leaves)}
    mgr = _manager(ckpt_dir, keep=keep)
    try:
        if step in mgr.all_steps():
            mgr.delete(step)
        mgr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(payload),
            layout=ocp.args.JsonSave({"leaves": layout}),
            metadata=ocp.args.JsonSave(meta),
        ), force=True)
        mgr.wait_until_finished()
    finally:
        mgr.close()
    return Path(ckpt_dir) / str(int(step))


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


def restore(ckpt_dir: str | os.PathLike, step: int | None, target: Any) -> tuple[Any, dict]:
    """Restores step ``step`` (None: the latest) into the structure of ``target``.

    ``target`` gives the tree structure, shapes, dtypes and shardings (a state built the same
    way as the saved one; its values are not used). Returns ``(state, metadata)``.
    """
    import orbax.checkpoint as ocp

    steps = all_steps(ckpt_dir)
    if step is None:
        if not steps:
            raise FoxhuntError(f"no checkpoint in {ckpt_dir}")
        step = steps[-1]
    if step not in steps:
        raise FoxhuntError(f"no checkpoint of step {step} in {ckpt_dir} (have: {steps or 'none'})")
    leaves, layout, treedef = _layout(target)
    mgr = _manager(ckpt_dir, read_only=True)
    try:
        saved = mgr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))
        saved_layout = saved["layout"]["leaves"]
        _check_layout(saved_layout, layout, f"{ckpt_dir}/{step}")
        payload = {f"leaf_{i:05d}": _restore_target(leaf) for i, leaf in enumerate(leaves)}
        out = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(payload), metadata=ocp.args.JsonRestore()))
    finally:
        mgr.close()
    restored = [_rebuild(out["state"][f"leaf_{i:05d}"], leaf, entry)
                for i, (leaf, entry) in enumerate(zip(leaves, saved_layout))]
    return jax.tree_util.tree_unflatten(treedef, restored), out["metadata"]


def _check_layout(saved: list[dict], wanted: list[dict], where: str) -> None:
    if len(saved) != len(wanted):
        raise FoxhuntError(f"checkpoint {where} holds {len(saved)} arrays, this run's state has "
                           f"{len(wanted)} (was the configuration changed?)")
    for s, w in zip(saved, wanted):
        for field in ("path", "shape", "dtype", "kind"):
            # A jax leaf may come back as numpy and back; only PRNG keys must stay keys.
            if field == "kind" and "prng_key" not in s[field] + w[field]:
                continue
            if s[field] != w[field]:
                raise FoxhuntError(
                    f"checkpoint {where}: leaf '{s['path']}' has {field} {s[field]}, this run "
                    f"expects {w[field]} (was the configuration changed?)")


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


__all__ = ["save", "restore", "latest_step", "all_steps", "assert_finite", "path_str", "KEEP"]
