"""Device meshes with the four named axes data / fsdp / tensor / expert, laid out on the topology.

A mesh spec names how many ways each axis splits the devices of one slice, and with `dcn_` entries
how many ways it splits the slices (multi-slice pods joined over the data-center network, DCN):

    "tensor=4,expert=2"        per slice; the unnamed rest of the devices goes to `data`
    "expert"                   an axis without a size takes the rest (here: every device of a slice)
    "expert=4,dcn_data=2"      4-way expert in each slice, 2 slices as 2-way data (the default for
                               the slices: they all go to `data` unless a dcn_ entry says otherwise)

`make_mesh` orders the devices with `jax.experimental.mesh_utils`: on TPU each axis follows the
chips' physical torus (rings where the handlers for v5e / v6e / v5p know one), and devices of
several slices (their `slice_index`) form a hybrid mesh whose DCN part is the outermost factor of
each axis. Elsewhere (CPU, GPU) the order is `jax.devices()`'s.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from dgemma_jax.axis_rules import MESH_AXES, _hint

DCN = "dcn_"  # the prefix of a mesh spec's across-slice entries


def parse_mesh(spec: str | Mapping[str, int] | None, num_devices: int, num_slices: int = 1) -> dict[str, int]:
    """"tensor=4,expert=2" (or a dict) -> sizes of all four axes (each its per-slice size times its
    across-slice size); the unnamed rest goes to `data` (see the module docstring for the syntax).

    Raises ValueError for unknown axis names or sizes that do not multiply to the device count.
    """
    ici, dcn = mesh_sizes(spec, num_devices, num_slices)
    return {a: ici[a] * dcn[a] for a in MESH_AXES}


def mesh_sizes(spec: str | Mapping[str, int | None] | None, num_devices: int,
               num_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(per-slice sizes, across-slice sizes) of every axis for `num_devices` devices in `num_slices`
    equal slices."""
    if num_slices < 1 or num_devices % num_slices:
        raise ValueError(f"{num_devices} devices do not split into {num_slices} equal slices")
    entries = _entries(spec)
    ici = {k: v for k, v in entries.items() if not k.startswith(DCN)}
    dcn = {k[len(DCN):]: v for k, v in entries.items() if k.startswith(DCN)}
    for part, prefix in ((ici, ""), (dcn, DCN)):
        for name in part:
            if name not in MESH_AXES:
                valid = [prefix + a for a in MESH_AXES]
                raise ValueError(f"unknown mesh axis {prefix + name!r}{_hint(prefix + name, valid)}; the axes are "
                                 f"{', '.join(MESH_AXES)} (dcn_AXIS=N for the slices)")
    per_slice = num_devices // num_slices
    if num_slices == 1:
        ici = _fill(ici, num_devices, "devices", "")
    else:
        ici = _fill(ici, per_slice, "devices per slice", "", hint=f" (across the {num_slices} slices: dcn_AXIS=N, "
                    f"e.g. dcn_data={num_slices})")
    if num_slices == 1 and any(v != 1 for v in dcn.values()):
        raise ValueError(f"mesh {spec!r} splits slices (dcn_AXIS=N) but the devices are on one slice; drop the "
                         "dcn_ entries")
    dcn = _fill(dcn, num_slices, "slices", DCN)
    return ici, dcn


def _entries(spec) -> dict[str, int | None]:
    if spec is None or spec == "":
        return {}
    if not isinstance(spec, str):
        return dict(spec)
    out: dict[str, int | None] = {}
    for part in spec.split(","):
        name, eq, val = part.partition("=")
        name = name.strip()
        if not name or (eq and (not val.strip().isdigit() or int(val) < 1)):
            raise ValueError(f"bad mesh entry {part!r}: write axis=size, e.g. 'tensor=4,expert=2' (an axis without "
                             "a size takes the rest of the devices)")
        if name in out:
            raise ValueError(f"mesh axis {name!r} is given twice in {spec!r}")
        out[name] = int(val) if eq else None
    return out


def _fill(sizes: dict[str, int | None], count: int, noun: str, prefix: str, hint: str = "") -> dict[str, int]:
    """Every axis's size for `count` devices (or slices): the one axis given without a size (else
    `data`, when not given) takes what the others leave."""
    rest = [a for a, v in sizes.items() if v is None]
    if len(rest) > 1:
        raise ValueError(f"mesh axes {[prefix + a for a in rest]} have no size; only one axis can take the rest")
    for a, v in sizes.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"mesh axis {prefix + a!r} has size {v!r}; sizes are positive integers")
    named = math.prod(v for v in sizes.values() if v is not None)
    shown = ",".join(f"{prefix}{a}={'rest' if v is None else v}" for a, v in sizes.items())
    fill = rest[0] if rest else ("data" if "data" not in sizes else None)
    if fill is not None:
        if count % named:
            raise ValueError(f"mesh {shown} uses {named} {noun}, which does not divide the {count} there are{hint}")
        sizes = {**sizes, fill: count // named}
    total = math.prod(sizes.values())
    if total != count:
        raise ValueError(f"mesh {shown} has {total} {noun} but there are {count}; the axis sizes must multiply "
                         f"to the {'slice' if noun == 'slices' else 'device'} count{hint}")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def slices_of(devices: Sequence) -> list[list]:
    """The devices grouped by slice (`slice_index`, in its order; one slice where devices have none,
    e.g. CPU and GPU)."""
    groups: dict[int, list] = defaultdict(list)
    for d in devices:
        groups[getattr(d, "slice_index", 0)].append(d)
    return [groups[k] for k in sorted(groups)]


def device_array(spec: str | Mapping[str, int] | None, devices: Sequence) -> np.ndarray:
    """The devices as an array of shape (data, fsdp, tensor, expert), ordered by the topology
    (`mesh_utils.create_device_mesh`; `create_hybrid_device_mesh` across several slices)."""
    from jax.experimental import mesh_utils  # deferred: only a mesh needs it

    devices = list(devices)
    slices = slices_of(devices)
    if len({len(s) for s in slices}) > 1:
        raise ValueError(f"the slices have different device counts {[len(s) for s in slices]}; a mesh needs equal slices")
    ici, dcn = mesh_sizes(spec, len(devices), len(slices))
    ici_shape = tuple(ici[a] for a in MESH_AXES)
    # allow_split_physical_axes: an axis may take part of a physical torus axis when no whole axes
    # fit (the physical axes are kept whole wherever they can be)
    if len(slices) == 1:
        return mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    return mesh_utils.create_hybrid_device_mesh(ici_shape, tuple(dcn[a] for a in MESH_AXES), devices,
                                                allow_split_physical_axes=True)


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A Mesh over `devices` (default: all) with axes (data, fsdp, tensor, expert), Auto axis types,
    the devices laid out on the topology (`device_array`)."""
    devices = list(devices if devices is not None else jax.devices())
    arr = device_array(spec, devices)
    return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
