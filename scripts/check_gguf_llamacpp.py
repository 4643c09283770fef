"""llama.cpp itself reads the tiny GGUFs the suite writes for gptneox, olmo2, phi3, qwen3moe,
olmoe and Mixtral-as-llama (tests/test_gguf_research_families.py) to the logits jaxkv reads them
to: an outside check of those files' conventions, which transformers' GGUF loader can make for
phi3 only. Needs llama-cpp-python (the bench extra), so it is a script, not a test.

    python scripts/check_gguf_llamacpp.py [--out DIR]

Writes gguf_llamacpp_check.json: each file's largest |logit difference| over 40 positions
and per position (llama.cpp keeps its cache in float16, so ~1e-4 is agreement). Phi-3 with a
sliding window is expected to part at the window: llama.cpp's runtime turns phi3's window off,
jaxkv (and transformers) keep it."""

import argparse
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxkv  # noqa: E402
from bench_checks import cpu_name, results_dir  # noqa: E402 - scripts/
from tests.conftest import random_tokens, save_tiny_models  # noqa: E402
from tests.test_gguf_research_families import ARCHS, tiny_configs, write_gguf  # noqa: E402


class Folders:
    """save_tiny_models' tmp_path_factory, outside pytest."""

    def __init__(self):
        self.root = pathlib.Path(tempfile.mkdtemp())

    def mktemp(self, name):
        path = self.root / name
        path.mkdir()
        return path


def for_llama_cpp(vocab_size: int, arch: str):
    """llama.cpp needs a tokenizer model to load a file; "none" takes the vocabulary's size
    from <arch>.vocab_size (which the llama converter writes already)."""
    def edit(writer):
        writer.add_tokenizer_model("none")
        if arch != "LLAMA":
            writer.add_vocab_size(vocab_size)
    return edit


def main():
    import llama_cpp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokens = random_tokens(3, (40,)).tolist()
    report = {"cpu": cpu_name(), "llama_cpp_python": llama_cpp.__version__, "positions": 40,
              "files": {}}
    for name, (model, directory) in save_tiny_models(tiny_configs(), Folders(), seed=700,
                                                     eager=True).items():
        arch = ARCHS[name]
        path = write_gguf(directory, arch, directory / "m.gguf",
                          for_llama_cpp(model.config.vocab_size, arch))
        ours_TV = np.asarray(jaxkv.forward(jaxkv.load(path), np.array([tokens]))[0])
        llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
        llm.eval(tokens)
        diff_T = np.abs(ours_TV - np.asarray(llm.scores[:len(tokens)])).max(1)
        report["files"][name] = {"arch": arch.lower(), "max_abs_diff": float(diff_T.max()),
                                 "max_abs_logit": float(np.abs(ours_TV).max()),
                                 "per_position": [float(f"{d:.2e}") for d in diff_T]}
        print(f"{name:20s} {arch.lower():9s} max |diff| {diff_T.max():.2e} "
              f"(first 8 positions {diff_T[:8].max():.2e})")
    out = args.out or results_dir("cpu")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gguf_llamacpp_check.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
