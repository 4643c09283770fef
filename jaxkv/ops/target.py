"""Which platform the programs being built run on: what chooses a backend, its kernels, and
whether value checks are compiled in.

It is the platform of jax.default_device when one is set (a device or a platform name), else
JAX's default backend. jax.default_device is part of JAX's trace and compile keys, so a program
built inside `on("tpu")` is traced anew for the TPU and never served from a CPU trace; that is
also how a CPU-only host compiles for an accelerator (scripts/compile_targets.py).
"""

import contextlib

import jax

ALIASES = {"cuda": "gpu", "rocm": "gpu"}  # a device's platform -> the family it belongs to
PLATFORMS = ("cpu", "gpu", "tpu")


def platform() -> str:
    """"cpu", "gpu" or "tpu": the platform of the programs traced now."""
    chosen = jax.config.jax_default_device
    name = jax.default_backend() if chosen is None else (
        chosen if isinstance(chosen, str) else chosen.platform)
    return ALIASES.get(name, name)


def platform_of(where) -> str | None:
    """The platform of where: a platform name, a device, a Mesh, or a pytree whose first leaf
    with a sharding (a jax.Array, or a jax.ShapeDtypeStruct placed on a topology's devices)
    says it; None when nothing in it is placed (numpy arrays, Python numbers)."""
    if isinstance(where, str):
        if ALIASES.get(where, where) not in PLATFORMS:
            raise ValueError(f"platform must be one of {', '.join(PLATFORMS)} (or cuda, rocm), "
                             f"got {where!r}")
        return ALIASES.get(where, where)
    if isinstance(where, jax.sharding.Mesh):
        return platform_of(where.devices.flat[0])
    if hasattr(where, "platform") and hasattr(where, "device_kind"):  # a device
        return ALIASES.get(where.platform, where.platform)
    for leaf in jax.tree.leaves(where):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return platform_of(next(iter(sharding.device_set)))
    return None


@contextlib.contextmanager
def on(where):
    """Builds the programs traced inside for where's platform (see platform_of): jaxkv's
    backend, kernels and checks follow it. Nothing changes where where is not placed or is on
    the platform in use already."""
    name = platform_of(where)
    if name is None or name == platform():
        yield
        return
    with jax.default_device(name):
        yield

