"""A compiled JAX program as bytes that load without running code: no pickle.

An entry is the XLA executable that the platform's client serializes (machine code for the
devices, loaded by the client, as JAX's own persistent cache stores it) and a JSON description
of how JAX calls it: the argument and result types, shardings and layouts, the donated
arguments and the result's tree structure. A SHA-256 digest over both is checked before either
is parsed. Decoding builds only a fixed set of types: arrays' abstract values, single-device and
named shardings over this process's devices, layouts, and tree nodes whose classes an allowed
package has already imported (nothing is imported by name).

:func:`encode` refuses (:class:`Unsupported`) a program whose description does not decode back
equal to what JAX built (effects, host callbacks, shardings of other kinds, tree nodes holding
functions), so every stored entry is known to round-trip. Both directions use JAX's internal
classes that its own ``serialize_executable`` pickles (``pxla.UnloadedMeshExecutable`` and
``stages.Compiled``); the cache key holds the JAX version, so an entry is only ever read by the
JAX that wrote it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any

import jax
import numpy as np
from jax._src import core, stages
from jax._src.interpreters import pxla
from jax._src.layout import Layout
from jax._src.lib import xla_client as xc
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

MAGIC = b"foxhunt-jax executable 1\n"
DIGEST_BYTES = 64  # hex SHA-256
# packages whose classes may appear as tree nodes or dataclass values in a stored description
ALLOWED_PACKAGES = ("foxhunt_jax", "pallas_kernels", "flax", "optax", "chex", "jax", "jaxlib")
# fields of pxla.UnloadedMeshExecutable that a stored program must leave empty
_EMPTY_FIELDS = ("unordered_effects", "ordered_effects", "keepalive", "host_callbacks")
_NONE_FIELDS = ("mut", "pgle_profiler")
_ENCODED_FIELDS = ("name", "committed", "kept_var_idx", "input_avals", "output_avals",
                   "input_shardings", "output_shardings", "xla_in_layouts",
                   "dispatch_in_layouts", "xla_out_layouts", "all_args_info")
_KNOWN_FIELDS = {"xla_executable", "device_list", "backend", *_EMPTY_FIELDS, *_NONE_FIELDS,
                 *_ENCODED_FIELDS}


class BadEntry(ValueError):
    """Bytes that are not an intact entry for the expected key (damaged, truncated, other)."""


class Unsupported(ValueError):
    """A program (or an entry) this format cannot describe exactly."""


# ---------------------------------------------------------------------------------------------
# The container: magic, digest, metadata length, metadata, payload


def pack(metadata: dict, payload: bytes) -> bytes:
    """The entry's bytes: ``metadata`` (JSON) and ``payload`` behind a digest of both."""
    meta = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
    body = b"%d\n" % len(meta) + meta + payload
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def unpack(blob: bytes) -> tuple[dict, bytes]:
    """``(metadata, payload)`` of an entry whose digest matches; :class:`BadEntry` otherwise.
    The digest is checked before the metadata is parsed."""
    head = len(MAGIC) + DIGEST_BYTES + 1
    if not blob.startswith(MAGIC) or len(blob) < head or blob[head - 1:head] != b"\n":
        raise BadEntry("not an executable-cache entry")
    body = blob[head:]
    if hashlib.sha256(body).hexdigest().encode() != blob[len(MAGIC):head - 1]:
        raise BadEntry("digest mismatch (damaged or truncated)")
    size, _, rest = body.partition(b"\n")
    if not size.isdigit() or int(size) > len(rest):
        raise BadEntry("bad metadata length")
    metadata = json.loads(rest[:int(size)])
    if not isinstance(metadata, dict):
        raise BadEntry("metadata is not an object")
    return metadata, rest[int(size):]


# ---------------------------------------------------------------------------------------------
# Classes named in a description


def _class_name(cls: type) -> str:
    if "<locals>" in cls.__qualname__ or cls.__module__.split(".")[0] not in ALLOWED_PACKAGES:
        raise Unsupported(f"class {cls.__module__}.{cls.__qualname__} is not storable")
    return f"{cls.__module__}:{cls.__qualname__}"


def _class(name: str) -> type:
    """The class ``module:qualname`` of an allowed package that is already imported."""
    module, _, qualname = name.partition(":")
    if module.split(".")[0] not in ALLOWED_PACKAGES or module not in sys.modules:
        raise Unsupported(f"class {name} is not available")
    obj: Any = sys.modules[module]
    for part in qualname.split("."):
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    if not isinstance(obj, type):
        raise Unsupported(f"{name} is not a class")
    return obj


# ---------------------------------------------------------------------------------------------
# Values: tagged JSON, so tuples, lists and dicts come back as what they were


def _value(x) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return {"tuple": [_value(v) for v in x]}
    if isinstance(x, list):
        return {"list": [_value(v) for v in x]}
    if isinstance(x, dict) and type(x) is dict:
        return {"dict": [[_value(k), _value(v)] for k, v in x.items()]}
    if isinstance(x, np.dtype):
        return {"dtype": x.name}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = dataclasses.fields(x)
        if not all(f.init for f in fields):
            raise Unsupported(f"dataclass {type(x).__name__} has fields outside __init__")
        return {"dataclass": _class_name(type(x)),
                "fields": {f.name: _value(getattr(x, f.name)) for f in fields}}
    raise Unsupported(f"a value of type {type(x).__name__} is not storable")


def _from_value(v) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if not isinstance(v, dict) or len(v) not in (1, 2):
        raise Unsupported("unknown value")
    if "tuple" in v:
        return tuple(_from_value(x) for x in v["tuple"])
    if "list" in v:
        return [_from_value(x) for x in v["list"]]
    if "dict" in v:
        return {_from_value(k): _from_value(x) for k, x in v["dict"]}
    if "dtype" in v:
        return np.dtype(_dtype(v["dtype"], {}))
    if "dataclass" in v:
        cls = _class(v["dataclass"])
        if not dataclasses.is_dataclass(cls):
            raise Unsupported(f"{v['dataclass']} is not a dataclass")
        return cls(**{k: _from_value(x) for k, x in v["fields"].items()})
    raise Unsupported("unknown value")


# ---------------------------------------------------------------------------------------------
# Trees


def _tree(t) -> Any:
    node = t.node_data()
    if node is None:
        return "*"
    kind, aux = node
    builtin = {tuple: "tuple", list: "list", dict: "dict", type(None): "None"}.get(kind)
    return {"node": builtin or _class_name(kind), "aux": _value(aux),
            "children": [_tree(c) for c in t.children()]}


def _from_tree(v):
    if v == "*":
        return jax.tree.structure(0)
    kinds = {"tuple": tuple, "list": list, "dict": dict, "None": type(None)}
    kind = kinds.get(v["node"]) or _class(v["node"])
    children = [_from_tree(c) for c in v["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, (kind, _from_value(v["aux"])), children)


# ---------------------------------------------------------------------------------------------
# Abstract values, shardings, layouts


def _dtype(name: str, extended: dict):
    """A dtype by name: NumPy's and JAX's (bfloat16, float8...), or an extended one (PRNG keys)
    that an argument of the program carries."""
    if name in extended:
        return extended[name]
    try:
        return jax.numpy.dtype(name)
    except TypeError as e:
        raise Unsupported(f"dtype {name}") from e


def _aval(a, meshes: list) -> dict:
    """``a`` as JSON; its sharding's abstract mesh is either empty or that of one of the
    program's concrete ``meshes`` (named by position)."""
    if type(a) is not core.ShapedArray:
        raise Unsupported(f"abstract value {a}")
    v = {"shape": list(a.shape), "dtype": str(a.dtype), "weak_type": bool(a.weak_type)}
    sharding = getattr(a, "sharding", None)
    if sharding is not None and not sharding.mesh.empty:
        where = [i for i, m in enumerate(meshes) if m.abstract_mesh == sharding.mesh]
        if not where:
            raise Unsupported(f"abstract value {a} on a mesh the program does not run on")
        v.update(mesh=where[0], spec=[_spec_entry(e) for e in sharding.spec])
    return v


def _from_aval(v, extended, meshes: list) -> core.ShapedArray:
    shape, dtype = tuple(v["shape"]), _dtype(v["dtype"], extended)
    if "mesh" not in v:
        return core.ShapedArray(shape, dtype, v["weak_type"])
    sharding = NamedSharding(meshes[v["mesh"]].abstract_mesh, _from_spec(v["spec"]))
    return core.ShapedArray(shape, dtype, v["weak_type"], sharding=sharding)


def _spec_entry(e):
    if e is None or isinstance(e, str):
        return e
    if isinstance(e, tuple) and all(isinstance(n, str) for n in e):
        return list(e)
    raise Unsupported(f"partition entry {e!r}")


def _from_spec(entries: list) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def _mesh(mesh: Mesh) -> dict:
    return {"shape": list(mesh.devices.shape), "devices": [d.id for d in mesh.devices.flat],
            "axis_names": list(mesh.axis_names),
            "axis_types": [t.name for t in mesh.axis_types]}


def _from_mesh(v, by_id) -> Mesh:
    devices = np.array([by_id[i] for i in v["devices"]], dtype=object).reshape(v["shape"])
    return Mesh(devices, tuple(v["axis_names"]),
                axis_types=tuple(jax.sharding.AxisType[t] for t in v["axis_types"]))


def _meshes(shardings) -> list:
    """The distinct concrete meshes of ``shardings``' named shardings, in order."""
    found = []
    for s in shardings:
        if type(s) is NamedSharding and type(s.mesh) is Mesh and s.mesh not in found:
            found.append(s.mesh)
    return found


def _sharding(s, meshes: list) -> dict:
    if type(s) is SingleDeviceSharding:
        [device] = s.device_set
        return {"device": device.id, "memory_kind": s.memory_kind}
    if type(s) is NamedSharding and type(s.mesh) is Mesh:
        return {"mesh": meshes.index(s.mesh), "spec": [_spec_entry(e) for e in s.spec],
                "memory_kind": s.memory_kind}
    raise Unsupported(f"sharding {s}")


def _from_sharding(v, by_id, meshes: list):
    if "device" in v:
        return SingleDeviceSharding(by_id[v["device"]], memory_kind=v["memory_kind"])
    return NamedSharding(meshes[v["mesh"]], _from_spec(v["spec"]), memory_kind=v["memory_kind"])


def _layout(x):
    if x is None:
        return None
    if type(x) is not Layout:
        raise Unsupported(f"layout {x}")
    tiling = None if x.tiling is None else [list(t) for t in x.tiling]
    return {"major_to_minor": list(x.major_to_minor), "tiling": tiling,
            "sub_byte_element_size_in_bits": x.sub_byte_element_size_in_bits}


def _from_layout(v):
    return None if v is None else Layout(tuple(v["major_to_minor"]), v["tiling"],
                                         v["sub_byte_element_size_in_bits"])


def _debug_info(d) -> dict:
    fields = {k: getattr(d, k) for k in d._fields}
    if callable(fields.get("result_paths")):
        raise Unsupported("lazy result paths")
    return {k: _value(x) for k, x in fields.items()}


# ---------------------------------------------------------------------------------------------
# A compiled program


def _describe(compiled: stages.Compiled, args: tuple) -> dict:
    """The JSON description of ``compiled``'s call for ``args``; :class:`Unsupported` where
    there is none."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if type(unloaded) is not pxla.UnloadedMeshExecutable:
        raise Unsupported("not a serializable mesh executable")
    fields = {f.name for f in dataclasses.fields(unloaded)}
    if fields != _KNOWN_FIELDS:
        raise Unsupported(f"this JAX's executables have fields {sorted(fields ^ _KNOWN_FIELDS)}")
    if any(getattr(unloaded, f) for f in _EMPTY_FIELDS) or any(
            getattr(unloaded, f) is not None for f in _NONE_FIELDS):
        raise Unsupported("effects, host callbacks, mutable arrays or a profiler")
    if compiled._params.const_args:
        raise Unsupported("closed-over constants")
    info = unloaded.all_args_info
    args_info = jax.tree.leaves(compiled.args_info, is_leaf=lambda x: isinstance(x, stages.ArgInfo))
    # abstract values may name the mesh of an argument that the program itself does not use
    meshes = _meshes([*unloaded.input_shardings, *unloaded.output_shardings,
                      *(getattr(x, "sharding", None) for x in jax.tree.leaves(args))])
    aval = lambda a: _aval(a, meshes)  # noqa: E731
    return {
        "meshes": [_mesh(m) for m in meshes],
        "name": unloaded.name, "committed": bool(unloaded.committed),
        "kept_var_idx": sorted(unloaded.kept_var_idx),
        "device_ids": [d.id for d in unloaded.device_list],
        "input_avals": [aval(a) for a in unloaded.input_avals],
        "output_avals": [aval(a) for a in unloaded.output_avals],
        "input_shardings": [_sharding(s, meshes) for s in unloaded.input_shardings],
        "output_shardings": [_sharding(s, meshes) for s in unloaded.output_shardings],
        "xla_in_layouts": [_layout(x) for x in unloaded.xla_in_layouts],
        "dispatch_in_layouts": [_layout(x) for x in unloaded.dispatch_in_layouts],
        "xla_out_layouts": [_layout(x) for x in unloaded.xla_out_layouts],
        "all_args_info": None if info is None else {
            "in_avals": [aval(a) for a in info.in_avals],
            "debug_info": _debug_info(info.debug_info)},
        "args_info": [[aval(a._aval), bool(a.donated)] for a in args_info],
        "out_tree": _tree(compiled.out_tree), "no_kwargs": bool(compiled._no_kwargs),
    }


def _rebuild(meta: dict, args: tuple, executable) -> tuple[dict, stages.Compiled | None]:
    """The executable's fields and (with ``executable``) the callable, from ``meta``."""
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in meta["device_ids"]]
    extended = {str(x.dtype): x.dtype for x in jax.tree.leaves(args) if hasattr(x, "dtype")}
    meshes = [_from_mesh(m, by_id) for m in meta["meshes"]]
    avals = lambda vs: [_from_aval(v, extended, meshes) for v in vs]  # noqa: E731
    info = meta["all_args_info"]
    fields = {
        "xla_executable": executable, "device_list": xc.DeviceList(tuple(devices)),
        "backend": devices[0].client,
        **{f: [] for f in _EMPTY_FIELDS}, **{f: None for f in _NONE_FIELDS},
        "name": meta["name"], "committed": meta["committed"],
        "kept_var_idx": set(meta["kept_var_idx"]),
        "input_avals": avals(meta["input_avals"]), "output_avals": avals(meta["output_avals"]),
        "input_shardings": [_from_sharding(s, by_id, meshes) for s in meta["input_shardings"]],
        "output_shardings": [_from_sharding(s, by_id, meshes)
                             for s in meta["output_shardings"]],
        "xla_in_layouts": [_from_layout(x) for x in meta["xla_in_layouts"]],
        "dispatch_in_layouts": [_from_layout(x) for x in meta["dispatch_in_layouts"]],
        "xla_out_layouts": [_from_layout(x) for x in meta["xla_out_layouts"]],
        "all_args_info": None if info is None else pxla.AllArgsInfo(
            avals(info["in_avals"]),
            core.DebugInfo(**{k: _from_value(x) for k, x in info["debug_info"].items()})),
    }
    in_tree = jax.tree.structure((tuple(args), {}))
    args_info = in_tree.unflatten([stages.ArgInfo(_from_aval(a, extended, meshes), donated)
                                   for a, donated in meta["args_info"]])
    out_tree = _from_tree(meta["out_tree"])
    fields.update(args_info=args_info, out_tree=out_tree, in_tree=in_tree)
    if executable is None:
        return fields, None
    unloaded = pxla.UnloadedMeshExecutable(
        **{k: v for k, v in fields.items() if k in _KNOWN_FIELDS})
    return fields, stages.Compiled(unloaded.load(), [], args_info, out_tree,
                                   no_kwargs=meta["no_kwargs"])


def encode(compiled: stages.Compiled, args: tuple, key: str,
           payload: bytes | None = None) -> bytes:
    """The entry of ``compiled`` (compiled for ``args``) under cache key ``key``; raises
    :class:`Unsupported` unless its description decodes back to what JAX built. ``payload``:
    the serialized executable to store (default: ``compiled``'s own serialization; JAX's
    persistent cache's bytes for an executable that cache served)."""
    meta = _describe(compiled, args)
    meta["key"] = key
    meta = json.loads(json.dumps(meta))  # what a load will read
    rebuilt, _ = _rebuild(meta, args, None)
    unloaded = compiled._executable._unloaded_executable
    original = {f: getattr(unloaded, f) for f in _ENCODED_FIELDS}
    original.update(device_list=unloaded.device_list, args_info=compiled.args_info,
                    out_tree=compiled.out_tree, in_tree=compiled.in_tree)
    for name, value in original.items():
        back = rebuilt[name]
        same = (list(back) == list(value)) if name.endswith(("avals", "shardings", "layouts")) \
            else back == value
        if not same:
            raise Unsupported(f"{name} does not round-trip")
    if payload is None:
        xla = unloaded.xla_executable
        payload = xla.client.serialize_executable(xla)
    return pack(meta, payload)


def decode(blob: bytes, args: tuple, key: str) -> stages.Compiled:
    """The program stored in ``blob`` for ``args`` under ``key``: :class:`BadEntry` for bytes
    that fail the digest or belong to another key, :class:`Unsupported` for a description
    this process cannot build (a device it lacks, a class not imported)."""
    meta, payload = unpack(blob)
    if meta.get("key") != key:
        raise BadEntry("entry of another key")
    try:
        by_id = {d.id: d for d in jax.devices()}
        devices = xc.DeviceList(tuple(by_id[i] for i in meta["device_ids"]))
    except (KeyError, TypeError) as e:
        raise Unsupported(f"devices {meta.get('device_ids')}") from e
    executable = devices[0].client.deserialize_executable(payload, executable_devices=devices)
    return _rebuild(meta, args, executable)[1]
