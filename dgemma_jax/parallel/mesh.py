"""Device meshes with the four named axes data / fsdp / tensor / expert."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from dgemma_jax.parallel.rules import MESH_AXES


def parse_mesh(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """"tensor=4,expert=2" (or a dict) -> sizes of all four axes; the unnamed rest goes to `data`.

    Raises ValueError for unknown axis names or sizes that do not multiply to the device count.
    """
    if spec is None or spec == "":
        sizes = {}
    elif isinstance(spec, str):
        sizes = {}
        for part in spec.split(","):
            name, _, val = part.partition("=")
            name = name.strip()
            if not val.strip().isdigit() or int(val) < 1:
                raise ValueError(f"bad mesh entry {part!r}: write axis=size, e.g. 'tensor=4,expert=2'")
            sizes[name] = int(val)
    else:
        sizes = dict(spec)
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown}; the axes are {', '.join(MESH_AXES)}")
    named = math.prod(sizes.values()) if sizes else 1
    if "data" not in sizes:
        if num_devices % named:
            raise ValueError(f"mesh {sizes} uses {named} devices, which does not divide the {num_devices} available")
        sizes["data"] = num_devices // named
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {sizes} has {math.prod(sizes.values())} devices but {num_devices} are available; "
                         "the axis sizes must multiply to the device count")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A Mesh over `devices` (default: all) with axes (data, fsdp, tensor, expert), Auto axis types."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
