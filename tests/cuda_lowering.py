"""Lowering for CUDA on a machine with no GPU (`.lower(lowering_platforms=("cuda",))`).

JAX 0.10's Pallas Triton lowering assumed compute capability 9.0 when no GPU was present;
JAX 0.11's asks the device, and fails on a CPU machine. An abstract H100 in an abstract mesh
answers for it on both. Trace and lower inside the context; run nothing eagerly there (JAX
0.11 refuses eager work under an abstract mesh of another platform).
"""

from __future__ import annotations

import jax


def cuda_lowering():
    """A context in which Pallas kernels lower for CUDA without a GPU (module docstring)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)
