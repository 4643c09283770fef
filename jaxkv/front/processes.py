"""The command line across hosts: one process per host, every host running the same
`jaxkv generate --input` command, joined by JAX's distributed runtime (see jsonl.py: process 0
writes the answers)."""

import os
import re


def add_process_flags(cmd) -> None:
    """One process per host, every host running the same command (generate --input, eval): JAX's
    own distributed runtime; process 0 writes what is written."""
    env = os.environ.get
    group = cmd.add_argument_group("across hosts (one process each, the same command on each)")
    group.add_argument("--coordinator", default=env("JAX_COORDINATOR_ADDRESS"),
                       metavar="HOST:PORT", help="process 0's address (JAX_COORDINATOR_ADDRESS); "
                       "'auto': the cluster's (SLURM, Open MPI, a TPU pod)")
    group.add_argument("--num-processes", type=int, default=env("JAX_NUM_PROCESSES"),
                       help="processes in the job (JAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int, default=env("JAX_PROCESS_ID"),
                       help="this one's, from 0 (JAX_PROCESS_ID)")
    group.add_argument("--process-timeout", type=int, default=60, metavar="SECONDS",
                       help="how long a process waits for the others to join; if one dies, "
                       "the others stop after about this long")
    group.add_argument("--mesh", metavar="DATAxMODEL",
                       help="devices for rows x devices for the model (default: across processes, "
                       "every device for rows; one process: its default device)")


def join_processes(args):
    """--coordinator: this process joins the job's others (before anything touches JAX); returns
    the mesh the work is split over (--mesh; default: across processes, every device on the data
    axis; one process: none, unless --mesh asks)."""
    import jax

    from jaxkv.core.sharding import make_mesh, start_processes

    _check_process_flags(args)
    if args.coordinator is not None:
        if getattr(args, "prompt", None) is not None:
            raise ValueError("--coordinator: several processes answer an --input file; a PROMPT "
                             "is answered by one process")
        auto = args.coordinator == "auto"
        if not auto and (args.num_processes is None or args.process_id is None):
            raise ValueError("--coordinator HOST:PORT needs --num-processes and --process-id (or "
                             "JAX_NUM_PROCESSES and JAX_PROCESS_ID); 'auto' takes them from the "
                             "cluster (SLURM, Open MPI, a TPU pod)")
        start_processes(None if auto else args.coordinator, args.num_processes,
                        args.process_id, timeout_s=args.process_timeout)
    if args.mesh is None:
        return make_mesh(jax.device_count(), 1) if jax.process_count() > 1 else None
    data, model = mesh_shape(args.mesh)
    if data * model != jax.device_count():
        raise ValueError(f"--mesh {args.mesh} needs {data * model} devices; the job has "
                         f"{jax.device_count()} ({jax.process_count()} process(es))")
    return make_mesh(data, model)


def _check_process_flags(args):
    """--coordinator HOST:PORT or 'auto', --num-processes >= 1, 0 <= --process-id < it,
    --process-timeout >= 1, and the two only with --coordinator (alone they would be
    ignored)."""
    from jaxkv.core.sharding import coordinator_address

    if args.coordinator not in (None, "auto"):
        coordinator_address(args.coordinator, "--coordinator")
    n, i = args.num_processes, args.process_id
    if n is not None and int(n) < 1:
        raise ValueError(f"--num-processes must be at least 1, got {n}")
    if i is not None and (int(i) < 0 or (n is not None and int(i) >= int(n))):
        raise ValueError(f"--process-id must be in [0, --num-processes) = [0, {n}), got {i}"
                         if n is not None else f"--process-id must be >= 0, got {i}")
    if args.process_timeout < 1:
        raise ValueError(f"--process-timeout must be at least 1 second, got "
                         f"{args.process_timeout}")
    if args.coordinator is None and (n is not None or i is not None):
        raise ValueError("--num-processes and --process-id (or JAX_NUM_PROCESSES and "
                         "JAX_PROCESS_ID) join a job only with --coordinator HOST:PORT (or "
                         "JAX_COORDINATOR_ADDRESS); give it, or leave them out")


def mesh_shape(text: str) -> tuple[int, int]:
    """--mesh DATAxMODEL as two positive ints."""
    m = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", text)
    if m is None:
        raise ValueError(f"--mesh must be DATAxMODEL (e.g. 4x2: rows over 4 devices, the model "
                         f"over 2), got {text!r}")
    return int(m.group(1)), int(m.group(2))
