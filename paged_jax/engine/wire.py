"""A call's outputs as one int32 vector, so the host reads a step with one device -> host copy.

A StepOut or WindowOut holds up to 16 arrays. Reading each costs the host about 25 us on CPU
(JAX's per-array checks and its own sync), 0.4 ms per step at batch 1: with async scheduling
that is host time taken from the cores the step runs on. The jitted call therefore also
returns every field bit-packed into `wire` (a few hundred bytes, packed on the device), and the
host splits it by the fields' shapes and dtypes, which it has without a copy.

    device: out = replace(out, wire=pack(out))           inside the jitted call
    host:   fields = unpack(np.asarray(out.wire), out)   {name: numpy array}, nested
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.types import Array, Int


def fields(x) -> object:
    """A device output as nested dicts of its arrays, `wire` left out (dicts, not the
    dataclasses: a host copy of those would run their jaxtyping checks on numpy arrays)."""
    if dataclasses.is_dataclass(x):
        return {f.name: fields(getattr(x, f.name)) for f in dataclasses.fields(x)
                if f.name != "wire"}
    return x


def _as_int32(x: Array) -> Int[Array, "n"]:
    x = x.ravel()
    if x.dtype == jnp.int32:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):  # float32 bits as they are (bf16 widened)
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return x.astype(jnp.int32)  # bool and narrow ints


def pack(out) -> Int[Array, "B"]:
    """Every field of `out` (in `fields` order), raveled and bit-cast into one int32 vector."""
    leaves = jax.tree.leaves(fields(out))
    return jnp.concatenate([_as_int32(x) for x in leaves]) if leaves else jnp.zeros(0, int)


def unpack(flat: np.ndarray, out) -> object:
    """`fields(out)` as numpy arrays cut from `flat` (the host copy of `out.wire`); `out`'s
    arrays give only their shapes and dtypes."""
    leaves, tree = jax.tree.flatten(fields(out))
    host, at = [], 0
    for x in leaves:
        part = flat[at:at + x.size]
        at += x.size
        if jnp.issubdtype(x.dtype, jnp.floating):
            part = part.view(np.float32)
        host.append(part.astype(x.dtype, copy=False).reshape(x.shape))
    if at != flat.size:
        raise ValueError(f"wire holds {flat.size} words, the fields {at} (a packing bug)")
    return jax.tree.unflatten(tree, host)
