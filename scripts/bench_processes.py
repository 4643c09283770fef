"""Loading across processes: the peak memory a process adds while loading its share of a
checkpoint (2 processes, the model axis split across them), against one process loading it
whole, in the same run. Writes <out>.json and <out>.md.

The checkpoint: a random Llama written by transformers (safetensors, float32) and the same
params as a jaxkv.save. Each load runs in fresh processes (tests/processes_check.py load), one
host device each; the figure is the process's peak resident memory after load minus before.

The figure includes what a fresh process sets up on its first load whatever the checkpoint's
size (tensorstore's and the allocator's threads, first transfers: about 10 MB on the 2-core Zen 4,
docs/design-notes.md "Across processes"); "its shares' data" is what the process must hold.

usage: python scripts/bench_processes.py [--layers 32] [--out results/cpu/<machine>/bench_processes]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

import jaxkv
from bench_checks import cpu_name, results_dir  # scripts/

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "processes_check.py")


def checkpoints(folder: str, layers: int) -> dict:
    """{format: path} of one random Llama: vocabulary 4096, width 512, MLP 2048, 8 heads / 4 kv."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048,
                                      num_hidden_layers=layers, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = os.path.join(folder, "hf")
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    saved = os.path.join(folder, "saved")
    jaxkv.save(jaxkv.load(hf), saved)
    return {"safetensors": hf, "jaxkv.save": saved}


def loaded(path: str, processes: int, out: str) -> dict:
    """Process 0's figures for loading path across `processes` processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    runs = [subprocess.Popen([sys.executable, WORKER, "load", coordinator, str(processes),
                              str(i), out, path], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for i in range(processes)]
    if any(p.wait(timeout=600) for p in runs):
        raise RuntimeError(f"a worker loading {path} failed; run it by hand: {WORKER}")
    with open(os.path.join(out, "process-0.json")) as f:
        return json.load(f)[path]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=32,
                    help="32: a checkpoint of about the default model's size (~500 MB)")
    ap.add_argument("--out", default=f"{results_dir()}/bench_processes")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for fmt, path in checkpoints(folder, args.layers).items():
            whole, share = loaded(path, 1, folder), loaded(path, 2, folder)
            rows.append(dict(format=fmt, size=share["size"], whole=whole["added"],
                             share=share["added"], data=share["shares"], same=share["same"],
                             fraction=share["added"] / share["size"]))
    result = dict(cpu=cpu_name(), layers=args.layers, rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Loading a share: {result['cpu']}", "",
             "`python scripts/bench_processes.py`: peak memory a process adds while loading "
             f"(MB); 2 processes split the model axis; {result['layers']} layers.", "",
             "| checkpoint | size MB | one process, whole | each of 2, its share | "
             "its shares' data | share / size | shares equal the whole's |",
             "|---|--:|--:|--:|--:|--:|---|"]
    lines += [f"| {r['format']} | {r['size'] / 1e6:.0f} | {r['whole'] / 1e6:.0f} | "
              f"{r['share'] / 1e6:.0f} | {r['data'] / 1e6:.0f} | {r['fraction']:.2f} | "
              f"{r['same']} |" for r in rows]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
