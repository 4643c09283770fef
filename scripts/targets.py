"""The accelerators a CPU-only host can compile for (deviceless ahead-of-time compilation):
XLA's own description of each chip, turned into JAX devices that jax.jit(...).lower(...)
.compile() can target. Needs the CUDA plugin (NVIDIA targets) or libtpu (TPU targets) installed
beside jax at its version, as the test extra does; no GPU or TPU, no driver.

NVIDIA: get_topology_desc(platform="cuda") with a GpuTargetConfigProto in text form, XLA's per
card (target_specs/, with their source and licence). TPU: libtpu's topologies by name, one chip.
"""

import functools
import os
from pathlib import Path

# Before a backend starts: JAX computes on this host's CPU, looking for no CUDA driver or
# libraries and no cloud metadata server (the topologies need neither).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402

SPECS = Path(__file__).with_name("target_specs")
# name: (platform, GPU target spec file or TPU topology name)
TARGETS = {"h100": ("cuda", "h100_sxm.txtpb"), "h200": ("cuda", "h200.txtpb"),
           "v5e": ("tpu", "v5e:1x1"), "v6e": ("tpu", "v6e:1x1"), "v5p": ("tpu", "v5p:1x1x1")}


@functools.cache
def target_devices(target: str) -> tuple:
    """The devices of one chip of target (a key of TARGETS), for placing abstract arrays."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    platform, name = TARGETS[target]
    if platform == "cuda":
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="", topology="1x1x1",
            target_config=(SPECS / name).read_text())
    else:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                chips_per_host_bounds=[1, 1, 1])
    return tuple(topology.devices)
