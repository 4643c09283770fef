"""pages: large CPU arrays onto 2 MiB pages, values untouched; anything else left alone."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.ops.cpu import pages

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_allowed() -> bool:
    try:
        with open(THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not thp_allowed(),
                    reason="needs Linux with transparent huge pages not set to never")
def test_a_large_array_is_collapsed_and_keeps_its_values():
    # 12 MiB (some whole 2 MiB pages inside), on the CPU where JAX's default device is another
    x = jax.device_put(jnp.arange(3 << 20, dtype=jnp.float32), jax.devices("cpu")[0])
    want = np.asarray(x).copy()
    assert pages.advise(x) > 0
    np.testing.assert_array_equal(np.asarray(x), want)
    assert float(jnp.sum(x[-4:])) == float(want[-4:].sum())


def test_small_arrays_tracers_and_other_leaves_are_left_alone():
    assert pages.advise(jnp.ones(16)) == 0.0
    assert pages.advise(np.ones(1 << 20)) == 0.0
    assert jax.jit(lambda x: x + pages.advise(x))(jnp.ones(1 << 20)).shape == (1 << 20,)
    tree = {"w": jnp.ones(1 << 19), "n": None, "i": 3}
    assert pages.huge_pages(tree) is tree
