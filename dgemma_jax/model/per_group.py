"""`PerGroup`: one parameter of every scanned layer group kept as G separate arrays.

The stacked layer layout (`model.layout`) keeps the kernels an opaque kernel reads (the MoE's grouped
matmuls) per group instead of stacked, so that the TPU kernel reads them in place; `model.layers`
hands such a stored kernel through as it is. Its own module so that both can import it.
"""

from __future__ import annotations

import jax


@jax.tree_util.register_pytree_node_class
class PerGroup:
    """One parameter of every scanned group as G separate arrays (or shapes, shardings, logical
    specs), and `index`, the group a scan body runs (None outside one)."""

    def __init__(self, arrays, index=None):
        self.arrays, self.index = tuple(arrays), index

    def tree_flatten(self):
        return (self.arrays, self.index), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __repr__(self):
        return f"PerGroup({len(self.arrays)} x {getattr(self.arrays[0], 'shape', self.arrays[0])}, index={self.index})"

    @property
    def shape(self):
        return tuple(self.arrays[0].shape)

    @property
    def dtype(self):
        return self.arrays[0].dtype

    @property
    def ndim(self):
        return len(self.shape)

    def at(self, index) -> "PerGroup":
        return PerGroup(self.arrays, index)

    def astype(self, dtype) -> "PerGroup":
        if all(a.dtype == dtype for a in self.arrays):
            return self
        return PerGroup(tuple(a.astype(dtype) for a in self.arrays), self.index)
