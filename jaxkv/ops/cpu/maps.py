"""A warning before XLA:CPU's compiled programs use up the process's memory maps (Linux).

XLA:CPU links each compiled program's kernels into memory regions of their own: about 150 for a
small model's decode step, 350 for generate's loop (docs/guide.md, "Many compiled programs in
one process"). They stay while JAX's caches hold the program, and Linux gives a process
vm.max_map_count of them (65,530 by default). At the limit XLA crashes the process while
compiling (a segmentation fault or an abort, no Python error), so a sweep that compiles a
program per setting (a jitted function over hundreds of shapes) would die without a word. Every
EVERY compiles the regions are counted, and past WARN_AT of the limit a RuntimeWarning says what
frees them.
"""

import functools
import warnings

import jax.monitoring

COMPILED = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event per program
LIMIT = "/proc/sys/vm/max_map_count"
WARN_AT = 0.75
EVERY = 16  # compiles between two counts; 16 programs add a few thousand regions at most
_state = {"compiles": 0, "warned": False}


def limit() -> int | None:
    """Linux's vm.max_map_count; None where it cannot be read (another OS)."""
    try:
        with open(LIMIT) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def count() -> int:
    """The memory regions this process has mapped now."""
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def check(most: int) -> None:
    """Warns once past WARN_AT of `most` regions (again after they fell below it)."""
    used = count()
    if used < WARN_AT * most:
        _state["warned"] = False
    elif not _state["warned"]:
        _state["warned"] = True
        warnings.warn(
            f"this process has mapped {used} memory regions of the {most} Linux allows it "
            "(vm.max_map_count); XLA:CPU keeps about 150-350 for each compiled program (each "
            "new shape of a jitted function) and crashes while compiling at the "
            "limit. jax.clear_caches() frees the programs; or raise the limit: sudo sysctl -w "
            "vm.max_map_count=262144", RuntimeWarning, stacklevel=2)


def _compiled(event: str, seconds: float, **_) -> None:
    if event != COMPILED:
        return
    _state["compiles"] += 1
    if _state["compiles"] % EVERY == 0:
        check(watch())


@functools.cache
def watch() -> int | None:
    """Starts counting after compiles (once per process); the limit, None where there is none
    to watch."""
    most = limit()
    if most is not None:
        jax.monitoring.register_event_duration_secs_listener(_compiled)
    return most
