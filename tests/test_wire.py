"""engine/wire.py: a call's outputs packed into one int32 vector on the device and cut back
into numpy arrays on the host, bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine import wire
from paged_jax.engine.window import WindowOut


def _window_out(key: int) -> WindowOut:
    k = jax.random.split(jax.random.key(key), 4)
    w, r, j = 3, 5, 2
    return WindowOut(
        jax.random.randint(k[0], (w, r), -2**31, 2**31 - 1), jax.random.normal(k[1], (w, r)),
        jnp.arange(w * r * j, dtype=jnp.int32).reshape(w, r, j) - 7,
        jax.random.normal(k[2], (w, r, j)).at[0, 0, 0].set(-jnp.inf),
        jax.random.bernoulli(k[3], 0.5, (w, r)), jnp.array([True, False] * 2 + [True]),
        jnp.arange(r, dtype=jnp.int32), jnp.asarray(2), jnp.asarray(False), jnp.asarray(9),
        jnp.zeros((r, 0), jnp.int32), jnp.arange(4, dtype=jnp.int32),
        drafted=jnp.arange(r, dtype=jnp.int32) if key else None)  # None: a field left out


@pytest.mark.parametrize("key", [0, 1])
def test_unpack_returns_every_field_bit_for_bit(key):
    out = _window_out(key)
    out = jax.jit(lambda o: dataclasses.replace(o, wire=wire.pack(o)))(out)
    host = wire.unpack(np.asarray(out.wire), out)
    want = jax.device_get(wire.fields(out))
    assert host.keys() == want.keys()
    for name, x in want.items():
        if x is None:  # an absent field stays absent (no words on the wire)
            assert host[name] is None, name
            continue
        assert host[name].dtype == x.dtype and host[name].shape == x.shape, name
        np.testing.assert_array_equal(host[name], x, err_msg=name)


def test_a_wire_of_the_wrong_length_is_refused():
    out = _window_out(0)
    flat = np.asarray(wire.pack(out))
    with pytest.raises(ValueError, match="packing bug"):
        wire.unpack(np.concatenate([flat, flat[:1]]), out)
