"""One named DeviceMesh for the whole job, built from the frozen ParallelDims.

Every axis is always present, size 1 included, so code can name an axis without asking whether it
is enabled: ``mesh["tp"]``, ``mesh["dp", "sharding"]``. Axis order, outermost first:

    pp        pipeline stages      (spans nodes: point-to-point traffic only)
    dp        replicated data parallel
    sharding  sharded data parallel (ZeRO / FSDP)
    cp        context parallel     (the sequence split across ranks: suite.parallel.context_parallel)
    tp        tensor parallel      (innermost: neighbouring ranks, i.e. GPUs of one node)

``dp`` and ``sharding`` are also flattened into one axis named ``data``: the ranks that see
different samples. The data loader's rank uses it. With cp > 1, two more flattened axes: ``data_cp``
(dp x sharding x cp: the ranks whose gradients are averaged and whose losses make the global mean,
since cp ranks hold the same parameters) and ``sharding_cp`` (sharding x cp: what FSDP shards over,
torchtitan's dp_shard_cp).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("pp", "dp", "sharding", "cp", "tp")
DATA_AXIS = "data"
DATA_CP_AXIS = "data_cp"
SHARDING_CP_AXIS = "sharding_cp"


_DATA_MESHES: dict[int, DeviceMesh] = {}
_DATA_CP_MESHES: dict[int, DeviceMesh] = {}
_HSDP_CP_MESHES: dict[int, DeviceMesh] = {}


def build_mesh(dims, device_type: str) -> DeviceMesh:
    """The job's mesh over ``dims.world_size`` ranks (collective: every rank calls it)."""
    shape = tuple(getattr(dims, axis) for axis in MESH_AXES)
    if not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs an initialised process group (suite.parallel.env.init_process_group)"
        )
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    # torch wants flattened axes kept by their creator rather than sliced from the root again
    _DATA_MESHES[id(mesh)] = mesh["dp", "sharding"]._flatten(DATA_AXIS)
    if dims.cp > 1:
        data_cp = mesh["dp", "sharding", "cp"]._flatten(DATA_CP_AXIS)
        _DATA_CP_MESHES[id(mesh)] = data_cp
        if dims.dp > 1 and dims.sharding > 1:  # HSDP: replicate over dp, shard over sharding x cp
            shape = (dims.dp, dims.sharding * dims.cp)
            _HSDP_CP_MESHES[id(mesh)] = data_cp._unflatten(0, shape, ("dp", SHARDING_CP_AXIS))
    return mesh


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh of the data-parallel ranks (dp x sharding flattened) that hold this rank's model slice."""
    return _DATA_MESHES[id(mesh)]


def data_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh of the ranks that hold the same model slice: data-parallel ranks and cp ranks."""
    return _DATA_CP_MESHES.get(id(mesh)) or data_mesh(mesh)


def fsdp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP shards over when cp > 1: (dp, sharding_cp) for HSDP, else sharding x cp (= data_cp)."""
    return _HSDP_CP_MESHES.get(id(mesh)) or _DATA_CP_MESHES[id(mesh)]


def data_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate among the ranks that see different samples: dp_coord * sharding + sharding_coord."""
    return data_mesh(mesh).get_local_rank()


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    return mesh.size(mesh.mesh_dim_names.index(axis))
