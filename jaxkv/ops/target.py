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


def device_of(where):
    """The first device of where (a device, a Mesh, or a pytree whose first leaf with a sharding
    places it: a jax.Array, or a jax.ShapeDtypeStruct on a topology's devices); None."""
    if isinstance(where, jax.sharding.Mesh):
        return where.devices.flat[0]
    if hasattr(where, "platform") and hasattr(where, "device_kind"):
        return where
    for leaf in jax.tree.leaves(where):
        if getattr(leaf, "sharding", None) is not None:
            return next(iter(leaf.sharding.device_set))
    return None


def platform_of(where) -> str | None:
    """The platform of where: a platform name, or device_of(where)'s; None when nothing in it is
    placed (numpy arrays, Python numbers)."""
    if isinstance(where, str):
        if ALIASES.get(where, where) not in PLATFORMS:
            raise ValueError(f"platform must be one of {', '.join(PLATFORMS)} (or cuda, rocm), "
                             f"got {where!r}")
        return ALIASES.get(where, where)
    device = device_of(where)
    return None if device is None else ALIASES.get(device.platform, device.platform)


@contextlib.contextmanager
def on(where):
    """Builds the programs traced inside for where's platform (see platform_of): jaxkv's
    backend, kernels and checks follow it. jax.default_device is set to where's device (a
    kernel compiler may read the chip's kind from it) or platform name; nothing changes where
    where is not placed or is on the platform in use already."""
    name = platform_of(where)
    if name is None or name == platform():
        yield
        return
    with jax.default_device(name if isinstance(where, str) else device_of(where)):
        yield
