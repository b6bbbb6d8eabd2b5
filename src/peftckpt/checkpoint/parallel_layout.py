"""The parallel layout a checkpoint records: sizes (``tp``, ``pp``, ``dp``, ``vpp``) and this rank's coordinates.

A checkpoint stores global tensors, so any layout can load it; the recorded layout only decides whether
per-rank state (RNG) can be restored as is, and names the legacy format's per-rank files.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.distributed.device_mesh import DeviceMesh

from .collectives import Collectives

__all__ = ["MESH_DIM_NAMES", "parallel_layout"]

MESH_DIM_NAMES = {"tp": "tp", "pp": "pp", "dp": "dp", "dp_replicate": "dp", "dp_shard": "dp"}
"""Mesh dimension names a checkpointer understands, and the layout dimension each one counts as."""


def parallel_layout(comm: Collectives, num_chunks: int, mesh: DeviceMesh | None = None,
                    layout: Mapping[str, int] | None = None, coords: Mapping[str, int] | None = None
                    ) -> tuple[dict[str, int], dict[str, int]]:
    """``(layout, coords)`` from explicit dicts, from a named ``mesh``, or (neither) pure data parallelism
    over ``comm``'s group."""
    if (layout is None) != (coords is None):
        raise ValueError("layout and coords go together: pass both or neither")
    if layout is not None and coords is not None:
        if mesh is not None:
            raise ValueError("pass mesh, or layout and coords, not both")
        return dict(layout), dict(coords)
    if mesh is None:
        return ({"tp": 1, "pp": 1, "dp": comm.world, "vpp": num_chunks},
                {"tp": 0, "pp": 0, "dp": comm.rank})
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("the DeviceMesh needs named dimensions (tp, pp, dp, dp_replicate, dp_shard), e.g. "
                         "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    unknown = [n for n in names if n not in MESH_DIM_NAMES]
    if unknown:
        raise ValueError(f"DeviceMesh dimension(s) {unknown} are not checkpoint layout dimensions: name them "
                         f"among {sorted(MESH_DIM_NAMES)}")
    if mesh.size() != comm.world:
        raise ValueError(f"the DeviceMesh spans {mesh.size()} ranks but the process group {comm.world}: pass the "
                         "process_group of the mesh's ranks")
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    ranks = {"tp": 0, "pp": 0, "dp": 0}
    for name in names:  # several data-parallel dims combine row-major, in mesh order
        dim = MESH_DIM_NAMES[name]
        ranks[dim] = ranks[dim] * mesh.size(names.index(name)) + mesh.get_local_rank(name)
        sizes[dim] *= mesh.size(names.index(name))
    return dict(sizes, vpp=num_chunks), ranks
