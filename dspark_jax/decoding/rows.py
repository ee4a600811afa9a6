"""Data-parallel decoding: a batch's requests split by rows across a mesh's ``data`` axis.

Every request is independent (its own cache row, sampling parameters and PRNG stream), so each
device can run the one-device step on its own rows, the weights replicated, with no collective
at all. ``jax.shard_map`` states that per-row structure outright. Left to XLA's partitioner, a
row-split batch is not kept split: it cannot split ``lax.top_k`` by rows, so sampling would
gather every row's full-vocabulary logits onto every device, each step.

Without a mesh every method here is the identity, so decoders have one code path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

ROWS = PartitionSpec("data")
REPLICATED = PartitionSpec()


class RowSplit:
    """Where a decoder's arrays live: ``mesh=None`` one device, else split by rows over ``data``."""

    def __init__(self, mesh: Mesh | None):
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh with a 'data' axis (or None), got {type(mesh).__name__}")
        if mesh is not None and "data" not in mesh.axis_names:
            raise ValueError(f"the mesh needs a 'data' axis to split rows over, got axes {mesh.axis_names}")
        if mesh is not None and any(kind != AxisType.Auto for kind in mesh.axis_types):
            # The same devices and axes, sharded by the placements below: on an Explicit mesh (what
            # jax.make_mesh gives) the row scatter of a refill fails on its sharded types.
            mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        self.mesh = mesh
        self.devices = 1 if mesh is None else mesh.shape["data"]

    def scope(self):
        """This split's mesh as JAX's context mesh while a decoder runs: called inside
        ``jax.set_mesh`` of an Explicit mesh, JAX would otherwise type the decoder's arrays by that
        one (and refuse them)."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _put(self, tree, spec: PartitionSpec):
        return tree if self.mesh is None else jax.device_put(tree, NamedSharding(self.mesh, spec))

    def replicate(self, tree):
        """Weights: a full copy on every device."""
        return self._put(tree, REPLICATED)

    def on_rows(self, tree):
        """Per-request arrays (leading axis = batch), each device holding its own rows."""
        for leaf in jax.tree.leaves(tree):
            self.check_batch(leaf.shape[0])
        return self._put(tree, ROWS)

    def check_batch(self, batch: int) -> None:
        if batch % self.devices:
            raise ValueError(
                f"a batch of {batch} requests does not split over the mesh's {self.devices} "
                "data-parallel devices; pass a multiple of that many"
            )

    def allocate(self, make: Callable, num_static: int) -> Callable:
        """``make(batch, ...)``, its first ``num_static`` arguments static, creating per-row arrays
        (a cache): made in place on the mesh, since a batch's cache may not fit on one device."""
        if self.mesh is None:
            return make
        jitted = jax.jit(make, static_argnums=tuple(range(num_static)), out_shardings=NamedSharding(self.mesh, ROWS))

        def allocate(batch, *args):
            self.check_batch(batch)
            return jitted(batch, *args)

        return allocate

    def per_row(self, step: Callable, replicated: Sequence[int]) -> Callable:
        """``step`` run by each device on its own rows: its positional arguments at ``replicated``
        (weights, stop ids) are whole on every device, every other argument and every output is
        per-row. Call it inside ``jax.jit``."""
        if self.mesh is None:
            return step
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        count = sum(p.kind in positional for p in inspect.signature(step).parameters.values())
        in_specs = tuple(REPLICATED if i in replicated else ROWS for i in range(count))
        return jax.shard_map(step, mesh=self.mesh, in_specs=in_specs, out_specs=ROWS)


def in_mesh_scope(method: Callable) -> Callable:
    """A decoder method run within ``self.rows.scope()`` (see ``RowSplit.scope``)."""

    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with self.rows.scope():
            return method(self, *args, **kwargs)

    return scoped
