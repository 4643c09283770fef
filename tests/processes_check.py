"""Run by tests/test_processes.py as one of several processes joined by
jaxkv.sharding.start_processes. Writes its results as JSON to OUT/process-PID.json.

usage: processes_check.py jobs COORDINATOR NUM_PROCESSES PROCESS_ID OUT [CHECKPOINT...]
    (4 host devices each) generate, generate_many, loglikelihood_many and speculative_generate
    on meshes that span the processes; process 0 also runs them alone on its first device and
    compares (the other processes' results are compared with process 0's by the caller); each
    checkpoint is loaded as `load` does, on the mesh whose model axis spans the processes;
usage: processes_check.py load COORDINATOR NUM_PROCESSES PROCESS_ID OUT CHECKPOINT...
    (1 host device each) each checkpoint loaded with the model split across the processes:
    its leaves against the whole checkpoint read alone, and the peak resident memory the
    loading added.
"""

import json
import os
import sys

DEVICES = {"jobs": 4, "load": 1}
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES[sys.argv[1]]}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.core.sharding import make_mesh, start_processes  # noqa: E402

CONFIG = jaxkv.Config.llama(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=96, max_seq_len=128)
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11], [3, 3, 60, 12, 40], [1, 2], [90, 91, 92, 93],
           [17], [4, 4, 4, 4, 4, 4]]
SHARED = [[6] * 20 + p for p in PROMPTS[:6]]  # a shared beginning: the prefix cache's blocks
REQUESTS = [(c, x) for c in ([1, 2, 3], [9, 8, 7, 6, 5], [40]) for x in ([5], [6, 7], [8, 9, 10],
                                                                          [11])]


def meshes():
    """Rows split across the processes (model within each), and the model split across them."""
    devices = np.array(jax.devices())
    across = devices.reshape(jax.process_count(), -1).T.reshape(-1)
    return {"data across processes": make_mesh(4, 2),
            "model across processes": make_mesh(4, 2, devices=across)}


def run(params, mesh, every_job=True):
    """The jobs' results (lists and floats: what JSON keeps); every_job=False: generate and
    loglikelihood_many only (the model split across processes; generate_many and speculative
    place rows and params as they do)."""
    key = jax.random.key(1)
    sampled, lengths = jaxkv.generate(params, PROMPTS, 10, temperature=0.8, key=key, mesh=mesh)
    out = {"sampled": [np.asarray(sampled).tolist(), np.asarray(lengths).tolist()],
           "loglikelihood": jaxkv.loglikelihood_many(params, REQUESTS, batch_size=4, mesh=mesh)}
    if every_job:
        many = jaxkv.generate_many(params, PROMPTS + SHARED, [6, 9] * 7, batch_size=4,
                                   mesh=mesh, temperature=0.7, key=key, logprobs=2)
        spec, spec_lengths, _ = jaxkv.speculative_generate(params, PROMPTS, 10, mesh=mesh)
        out.update(many=[a.ids for a in many], many_logprobs=[a.logprobs for a in many],
                   speculative=[np.asarray(spec).tolist(), np.asarray(spec_lengths).tolist()])
    return out


def compare(alone: dict, spread: dict) -> dict:
    """Per job: equal tokens / greedy flags, and the largest log-probability difference."""
    out = {k: alone[k] == spread[k] for k in spread if k not in ("loglikelihood",
                                                                 "many_logprobs")}
    out["loglikelihood_greedy"] = ([g for _, g in alone["loglikelihood"]] ==
                                   [g for _, g in spread["loglikelihood"]])
    pairs = [([x for x, _ in alone["loglikelihood"]], [x for x, _ in spread["loglikelihood"]])]
    if "many_logprobs" in spread:
        pairs.append((np.concatenate(alone["many_logprobs"]),
                      np.concatenate(spread["many_logprobs"])))
    out["logprob_error"] = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in pairs)
    return out


def jobs(out: str, *checkpoints: str):
    params = jaxkv.init_params(CONFIG, jax.random.key(0))  # the same on every process
    results = {"process": jax.process_index(), "devices": jax.device_count(),
               "local_devices": jax.local_device_count()}
    spans = meshes()
    for name, mesh in spans.items():
        results[name] = run(params, mesh, every_job=name == "data across processes")
    if jax.process_index() == 0:  # one process's run alone is enough: the others equal it
        with jax.default_device(jax.local_devices()[0]):
            alone = run(params, None)
        for name in spans:
            results[name] = dict(compare(alone, results[name]), answers=results[name])
    return dict(results, loaded=load(out, *checkpoints, mesh=spans["model across processes"]))


def peak_bytes() -> int:
    """This process's peak resident memory (VmHWM: unlike getrusage's ru_maxrss, not inherited
    from the process that started this one)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def load(out: str, *checkpoints: str, mesh=None):
    """Per checkpoint: the loaded leaves equal the ones read alone (each process's shares),
    whether every big leaf is split, the bytes of this process's shares, and the peak memory
    loading added (the first load's: the peak only grows) beside the checkpoint's size on disk.
    mesh: the model across every device unless given."""
    mesh = mesh or make_mesh(1, jax.device_count())
    results = {}
    for path in checkpoints:
        before = peak_bytes()
        params = jaxkv.load(path, mesh=mesh)
        added = peak_bytes() - before
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
                   for f in files)
        whole = jaxkv.load(path)
        same = all(np.array_equal(s.data, np.asarray(w)[s.index])
                   for x, w in zip(jax.tree.leaves(params), jax.tree.leaves(whole))
                   for s in x.addressable_shards)
        shares = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
        results[path] = {"same": same, "added": added, "size": size, "shares": shares,
                         "embed_spec": str(params.embed.sharding.spec)}
        del whole
    return results


if __name__ == "__main__":
    mode, coordinator, count, process_id, out, *rest = sys.argv[1:]
    # The others wait at the end while process 0 runs alone: a shutdown timeout long enough,
    # also when the suite's other worker loads both cores (120 s was exceeded so once, on a
    # 2-core Zen 5, with the suite's other file running beside it).
    start_processes(coordinator, int(count), int(process_id), timeout_s=300)
    results = {"jobs": jobs, "load": load}[mode](out, *rest)
    with open(os.path.join(out, f"process-{process_id}.json"), "w") as f:
        json.dump(results, f)
