"""Running past one device, and past one process, with JAX's own SPMD machinery: a Mesh with a
data axis (batch rows) and a model axis (attention heads, MLP width, vocabulary), and
NamedSharding for params and cache.

The code that computes is unchanged: XLA's partitioner inserts the collectives. A dimension is
split only where its size divides the mesh axis; otherwise it is replicated. A mesh may span
processes (start_processes, one per host): every process then calls the same functions with the
same arguments; `place` builds each array from the share its own devices hold, and `fetch` gives
every process a whole result.
"""

import socket
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.core.params import gate_up_block, path_name

DATA, MODEL = "data", "model"

def _mlp_blocks(c) -> int:
    """The units w_in's rows come in: blocks of gated gate/up rows, or single rows."""
    return c.d_ff // gate_up_block(c.d_ff) if c.gated_mlp else c.d_ff


# Which axis of each parameter (by leaf name) is split over the model axis, and which size
# must divide the model axis for the split to keep heads / units whole: fused Q/K/V rows are
# grouped by kv head, gated gate/up rows by blocks of MLP units (see params.py); a mixture's
# experts are split whole, each device holding n_experts / model of them.
_MODEL_AXIS = {
    "wqkv": (0, "n_kv_heads"), "bqkv": (0, "n_kv_heads"), "wkv": (0, "n_kv_heads"),
    "bkv": (0, "n_kv_heads"), "wq": (0, "n_heads"), "bq": (0, "n_heads"),
    "wo": (1, "n_heads"), "w_in": (0, _mlp_blocks), "b_in": (0, _mlp_blocks),
    "w_out": (1, "d_ff"), "embed": (0, "vocab_size"), "lm_head": (0, "vocab_size"),
    "experts_in": (0, "n_experts"), "experts_out": (0, "n_experts"),  # experts over devices
}


def start_processes(coordinator: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None, *, timeout_s: int = 60):
    """Joins this process to the others of a job (jax.distributed.initialize; call it before
    anything else touches JAX). Arguments as JAX's (None: from the cluster's environment, e.g.
    SLURM or a TPU pod). On CPUs the processes exchange data through gloo.

    Every wait is bounded by timeout_s. Given a coordinator HOST:PORT, the processes first meet
    over a plain TCP connection to process 0 (which listens on PORT), so that one that never
    comes is an error of jaxkv's naming who waited for what (JAX's own wait would abort the
    process from C++); then JAX joins them. (Without one, the cluster's, JAX's own wait is
    bounded by timeout_s, and ends in its abort.) A process that dies later makes every other
    one exit within about timeout_s seconds with JAX's message naming it ("tasks are unhealthy
    (stopped sending heartbeats)"), never hang; one that ends on an error waits as long for
    the others at JAX's shutdown barrier, then all stop."""
    if not isinstance(timeout_s, int) or timeout_s < 1:
        raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {timeout_s!r}")
    if coordinator is not None:
        if not (isinstance(num_processes, int) and isinstance(process_id, int)
                and 0 <= process_id < num_processes):
            raise ValueError(f"start_processes: a coordinator needs num_processes >= 1 and "
                             f"process_id in [0, num_processes), got {num_processes!r} and "
                             f"{process_id!r}")
        if process_id == 0:
            _await_processes(coordinator, num_processes, timeout_s)
        else:
            _join_process_0(coordinator, num_processes, process_id, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               heartbeat_timeout_seconds=timeout_s,
                               shutdown_timeout_seconds=timeout_s,
                               initialization_timeout=timeout_s)


def coordinator_address(text: str, name: str = "coordinator") -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets: [::1]:PORT) as (host, port)."""
    host, colon, port = str(text).rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{name} must be HOST:PORT (process 0's host and a free port, e.g. "
                         f"10.0.0.1:1234), got {text!r}")
    return (host[1:-1] if host[0] + host[-1] == "[]" else host), int(port)


def _await_processes(coordinator: str, count: int, timeout_s: int):
    """Process 0: listens on the coordinator's port until the other count - 1 processes have
    said who they are, then tells each to go on and frees the port for JAX's service."""
    port, deadline = coordinator_address(coordinator)[1], time.monotonic() + timeout_s
    dual = socket.has_dualstack_ipv6()
    try:
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else
                                      socket.AF_INET, dualstack_ipv6=dual)
    except OSError as e:
        raise OSError(f"process 0 cannot listen on port {port} of the coordinator {coordinator} "
                      f"({e.strerror}): is another job using it? choose a free port") from e
    joined = {}
    try:
        with server:
            while len(joined) < count - 1:
                _admit(server, joined, coordinator, count, deadline)
        for i, conn in joined.items():
            _tell(conn, i, coordinator)
    except TimeoutError:
        missing = ", ".join(map(str, sorted(set(range(1, count)) - set(joined))))
        raise TimeoutError(f"process 0 waited {timeout_s} s at {coordinator} for process(es) "
                           f"{missing} of {count} to join; check that each was started with "
                           f"the same coordinator and number of processes and its own process "
                           f"id, and can reach this host's port, or raise the timeout "
                           f"(--process-timeout)") from None
    finally:
        for conn in joined.values():
            conn.close()


def _admit(server, joined: dict, coordinator: str, count: int, deadline: float):
    """Process 0: takes the next process's connection and its "jaxkv PROCESS_ID COUNT" line
    (a connection saying anything else is closed and ignored); TimeoutError at the deadline."""
    server.settimeout(max(deadline - time.monotonic(), 1e-3))
    conn, _ = server.accept()
    conn.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        words = conn.makefile("rb").readline(100).split()
    except TimeoutError:
        conn.close()
        raise
    if len(words) != 3 or words[0] != b"jaxkv" or not all(w.isdigit() for w in words[1:]):
        return conn.close()
    i, n = int(words[1]), int(words[2])
    if n != count or i in joined or not 0 < i < count:
        conn.close()
        raise ValueError(f"process 0 ({coordinator}, {count} processes) was joined by a "
                         f"process {i} of {n} processes" + (" twice" if i in joined else "") +
                         ": give every process the same number of processes and its own "
                         "process id")
    joined[i] = conn


def _tell(conn, process_id: int, coordinator: str):
    """Process 0: lets a process that joined go on."""
    try:
        conn.sendall(b"go\n")
    except OSError as e:
        raise OSError(f"process 0 ({coordinator}): process {process_id} left before the job "
                      f"started ({e})") from e


def _join_process_0(coordinator: str, count: int, process_id: int, timeout_s: int):
    """A process other than 0: connects to process 0 (retrying until it listens), says who it
    is, and waits until process 0 has heard from every process."""
    (host, port), deadline = coordinator_address(coordinator), time.monotonic() + timeout_s
    waited = f"process {process_id} waited {timeout_s} s for process 0 at {coordinator}"
    while True:
        try:
            conn = socket.create_connection((host, port), max(deadline - time.monotonic(), 1e-3))
            break
        except socket.gaierror as e:
            raise OSError(f"process {process_id}: the coordinator {coordinator}'s host is not "
                          f"known here ({e.strerror})") from e
        except OSError:
            if time.monotonic() + 0.2 > deadline:
                raise TimeoutError(f"{waited} to listen; check that process 0 is running with "
                                   f"the same coordinator, that its host and port are "
                                   f"reachable from here, or raise the timeout "
                                   f"(--process-timeout)") from None
            time.sleep(0.2)
    with conn:
        try:
            conn.sendall(f"jaxkv {process_id} {count}\n".encode())
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))
            answer = conn.makefile("rb").readline(100)
        except TimeoutError:
            raise TimeoutError(f"{waited} to hear from every other process; check that "
                               f"they were all started, or raise the timeout "
                               f"(--process-timeout)") from None
        except OSError:
            answer = b""
    if answer != b"go\n":
        raise OSError(f"process {process_id}: process 0 at {coordinator} ended the job before "
                      f"it started (see process 0's message)")


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model devices (every process's: jax.devices()
    lists them process by process, so a model axis no longer than one process's devices keeps
    each model's shards inside one process)."""
    devices = np.asarray(devices if devices is not None else jax.devices())
    if data * model > devices.size:
        raise ValueError(f"a {data}x{model} mesh needs {data * model} devices, found "
                         f"{devices.size}")
    return Mesh(devices.reshape(-1)[: data * model].reshape(data, model), (DATA, MODEL))


def check_mesh(mesh, name: str = "mesh"):
    """mesh must be a jax.sharding.Mesh with jaxkv's axes (or None)."""
    if mesh is not None and not (isinstance(mesh, Mesh) and mesh.axis_names == (DATA, MODEL)):
        raise TypeError(f"{name} must be a jax.sharding.Mesh with axes ('data', 'model') (see "
                        f"jaxkv.make_mesh), got {type(mesh).__name__}"
                        f"{getattr(mesh, 'axis_names', '')}")
    return mesh


def place(x, sharding: NamedSharding):
    """x (a host value, or an array on this process's devices) as a global array laid out as
    sharding says; on a mesh that spans processes each process builds only its devices' share
    (every process must pass the same value)."""
    if sharding.is_fully_addressable or isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(place(jax.random.key_data(x), sharding),
                                        impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def fetch(tree):
    """Every leaf whole, as numpy, on every process (a leaf split across processes is gathered:
    every process must call this together)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def from_first_process(x) -> np.ndarray:
    """Process 0's x (a host array of the same shape everywhere), on every process."""
    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def same_on_every_process(x, what: str):
    """Checks that every process holds the same x (a host array of one shape): else every
    process raises the same error, naming what differs and where."""
    every = np.asarray(multihost_utils.process_allgather(np.asarray(x)))
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(f"{what} differ between processes: process {differ[0]} does not hold "
                         f"what process 0 holds (every process must be given the same)")


def _spec(ndim: int, axis, name: str | None):
    spec = [None] * ndim
    if axis is not None:
        spec[axis] = name
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """NamedSharding for every parameter leaf (same pytree structure as params); an Int8
    matrix's numbers split as its float form would be, its scales along with their rows."""
    c = params.config

    def one(path, leaf):
        *_, owner, name = ("", *path_name(path).split("."))
        if name in ("q", "scale"):  # an Int8's numbers and scales, split as its matrix
            axis, unit = _MODEL_AXIS.get(owner, (None, None))
            if name == "scale" and axis is not None and axis == leaf.ndim - 1:
                axis = None  # scales per row (or block of inputs) of an input-split matrix
        else:
            axis, unit = _MODEL_AXIS.get(name, (None, None))
        size = None if unit is None else unit(c) if callable(unit) else getattr(c, unit)
        whole = size is not None and size % mesh.shape[MODEL] == 0
        return NamedSharding(mesh, _spec(leaf.ndim, axis if whole else None, MODEL))

    return jax.tree.map_with_path(one, params)


def cache_shardings(cache, mesh: Mesh):
    """Rows over the data axis; kv heads ([B, K, S, H] leaves, a paged cache's [K, NB, P, H]
    pools: blocks are shared by rows) over the model axis."""
    pools = cache.paged or (False,) * len(cache.k)

    def one(leaf, pool=False):
        if pool:
            return NamedSharding(mesh, P(_split(leaf.shape[0], mesh, MODEL)))
        spec = [_split(leaf.shape[0], mesh, DATA)] + [None] * (leaf.ndim - 1)
        if leaf.ndim == 4:
            spec[1] = _split(leaf.shape[1], mesh, MODEL)
        return NamedSharding(mesh, P(*spec))

    layers = lambda xs: tuple(jax.tree.map(lambda leaf: one(leaf, p), x)  # noqa: E731
                              for x, p in zip(xs, pools))
    rest = jax.tree.map(one, cache.replace(k=(), v=()))
    return rest.replace(k=layers(cache.k), v=layers(cache.v))


def _split(size: int, mesh: Mesh, axis: str):
    return axis if size % mesh.shape[axis] == 0 else None


def shard_params(params, mesh: Mesh):
    """params placed on the mesh (heads / MLP width / vocabulary split over the model axis)."""
    return jax.tree.map(place, params, param_shardings(params, mesh))


def row_sharding(x, mesh: Mesh) -> NamedSharding:
    """Leading axis (batch rows) over the data axis, the rest whole."""
    return NamedSharding(mesh, P(_split(x.shape[0], mesh, DATA), *[None] * (x.ndim - 1)))


def shard_rows(tree, mesh: Mesh):
    """Every leaf's leading axis (batch rows) split over the data axis."""
    return jax.tree.map(lambda x: place(x, row_sharding(x, mesh)), tree)


def constrain_cache(cache, mesh: Mesh | None):
    """Inside jit: ask the partitioner to keep the cache split by rows and kv heads."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def replicated(tree, mesh: Mesh | None):
    """Inside jit: results every process reads whole (small ones: tokens, lengths, scores)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P()))
