"""maps: a warning once a process's memory regions near Linux's limit, before XLA:CPU would
crash compiling; counted every EVERY compiles, where the CPU backend is in use."""

import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxkv
from jaxkv.ops.cpu import maps

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's limit")


def compile_new_program(n: int):
    jax.jit(lambda x: x * n + n)(jnp.ones(3)).block_until_ready()  # a new closure: a new program


def test_the_cpu_backend_watches_and_counts_regions():
    jaxkv.ops.backend()  # the CPU backend imported
    assert maps.watch() == maps.limit() > 1000
    assert 10 < maps.count() < maps.limit()


def test_warns_once_past_the_share_of_the_limit_then_again_after_they_fell(monkeypatch):
    monkeypatch.setattr(maps, "EVERY", 1)
    monkeypatch.setitem(maps._state, "warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(maps, "WARN_AT", 0.0)  # every count is past it
        compile_new_program(1)
        compile_new_program(2)
        assert len(caught) == 1 and caught[0].category is RuntimeWarning
        said = str(caught[0].message)
        assert "vm.max_map_count" in said and "jax.clear_caches()" in said
        monkeypatch.setattr(maps, "WARN_AT", 1.0)  # fell below: armed again
        compile_new_program(3)
        monkeypatch.setattr(maps, "WARN_AT", 0.0)
        compile_new_program(4)
    assert len(caught) == 2


def test_counts_only_every_few_compiles(monkeypatch):
    counted = []
    monkeypatch.setattr(maps, "check", counted.append)
    monkeypatch.setitem(maps._state, "compiles", 0)
    for n in range(2 * maps.EVERY):
        compile_new_program(10 + n)
    assert maps._state["compiles"] >= 2 * maps.EVERY
    assert counted == [maps.limit()] * (maps._state["compiles"] // maps.EVERY)
