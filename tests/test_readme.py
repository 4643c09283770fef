"""Every ```python block of README.md and of each docs/*.md runs as written, alone, so an
example cannot rot and none leans on another (all but the README title's one-line signature of
decode_step, which names its arguments but does not make them).

Each block runs by itself in a fresh Python process, as a reader pasting just that block would
run it: a name it uses but does not make (a model loaded by an earlier block) is a NameError.
A block is named "<file>: <heading>" after the nearest heading above it, with " (2)", " (3)"
for a heading's later blocks. The working directory is the repository root; a block that needs
8 host devices sets XLA_FLAGS itself before importing jax. The processes run with
JAX_PLATFORMS=cpu, so that the mesh example finds its 8 simulated devices on a machine with an
accelerator too. Nothing in the code is substituted: the examples are written small enough to
run as they are. Non-python fences (bash, text, yaml) are not run. Blocks run WINDOW at a time,
in the order the tests ask for them (most of their time is compiling, one core each; all of
them at once ran a 24 GiB machine out of memory: the mesh example alone holds 7 GB); each loads
its model, so the docs keep their examples few.
"""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# Blocks that are a one-line signature, not an example.
SIGNATURES = {"README.md: jaxkv"}
# What a block's output must contain, where its example prints something checkable.
PRINTS = {"docs/guide.md: Speech (Whisper)": "ask not what your country can do for you",
          "docs/guide.md: Reading and editing activations (hooks) (2)": "layer  0:  1.00 restored"}


def python_blocks(markdown: str) -> dict[str, str]:
    """{name: code} of each ```python block, named after the nearest heading above it."""
    blocks, heading, fence, lines = {}, None, None, []
    for line in markdown.splitlines():
        if line.startswith("```"):
            if fence == "python":
                name, n = heading, 1
                while name in blocks:
                    n += 1
                    name = f"{heading} ({n})"
                blocks[name] = "\n".join(lines)
            fence, lines = (line[3:].strip(), []) if fence is None else (None, [])
        elif fence is not None:
            lines.append(line)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    assert fence is None, "a ``` fence is not closed"
    return blocks


def all_blocks() -> dict[str, str]:
    """{"<file>: <heading>": code} over README.md and docs/*.md."""
    blocks = {}
    for name in FILES:
        with open(os.path.join(ROOT, name)) as f:
            for heading, code in python_blocks(f.read()).items():
                blocks[f"{name}: {heading}"] = code
    return blocks


BLOCKS = all_blocks()
RUN = sorted(set(BLOCKS) - SIGNATURES)


WINDOW = 4  # blocks running at once


class Blocks:
    """Each block's process, started in RUN's order, at most WINDOW ahead of the one waited
    for: blocks[name] -> (process, stdout file, stderr file)."""

    def __init__(self, folder):
        self.folder, self.started = folder, {}
        self.env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")

    def __getitem__(self, block):
        for ahead in RUN[: RUN.index(block) + WINDOW]:
            if ahead not in self.started:
                self.start(ahead)
        return self.started[block]

    def start(self, block):
        i = RUN.index(block)
        script, out, err = (self.folder / f"block{i}{ext}" for ext in (".py", ".out", ".err"))
        script.write_text(BLOCKS[block])
        with open(out, "w") as stdout, open(err, "w") as stderr:
            self.started[block] = (subprocess.Popen([sys.executable, str(script)], cwd=ROOT,
                                                    env=self.env, stdout=stdout, stderr=stderr),
                                   out, err)


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """The blocks' processes (Blocks), those left running killed at the end."""
    blocks = Blocks(tmp_path_factory.mktemp("readme"))
    yield blocks
    for process, _, _ in blocks.started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_examples_are_found():
    assert {"README.md: Library example", "docs/guide.md: Driving the step yourself",
            "docs/guide.md: Forests, branches and beams (MultiDecode)",
            "docs/guide.md: Continuous batching",
            "docs/guide.md: Scoring: log-likelihoods and lm-evaluation-harness",
            "docs/guide.md: Running on a mesh (several devices, several hosts)",
            "docs/speculative.md: How it works, with an example"} <= set(RUN)
    assert set(PRINTS) <= set(RUN)
    assert all(BLOCKS[block].strip() for block in RUN)
    assert all(len(BLOCKS[block].strip().splitlines()) == 1 for block in SIGNATURES)


def test_blocks_are_split_and_named_by_their_nearest_heading():
    """Two blocks under one heading are two runs; a ### heading names its own blocks."""
    markdown = ("# T\n```python\na = 1\n```\n## S\n### U\n```python\nb = 2\n```\n"
                "```bash\nls\n```\n```python\nc = 3\n```\n")
    assert python_blocks(markdown) == {"T": "a = 1", "U": "b = 2", "U (2)": "c = 3"}


@pytest.mark.parametrize("block", RUN)
def test_readme_block_runs_alone(block, processes):
    process, out, err = processes[block]
    returncode = process.wait(timeout=600)
    assert returncode == 0, f"{block!r} failed alone:\n{err.read_text()[-3000:]}"
    assert PRINTS.get(block, "") in out.read_text().lower()


def test_every_dotted_name_in_the_docs_imports_as_written():
    """Each dotted name README.md and docs/ show (`jaxkv.chat.Chat`, `jaxkv.lm_eval`,
    `jaxkv.core.decoder.prefill_padded`) is a module that imports by that name, or a name that
    `from <module> import <name>` gives: short paths (jaxkv.chat) included, not only as
    attributes of jaxkv."""
    import importlib
    import re

    names = set()
    for file in FILES:
        with open(os.path.join(ROOT, file)) as f:
            names |= set(re.findall(r"(?<![\w./-])jaxkv(?:\.[A-Za-z_]\w*)+", f.read()))
    assert "jaxkv.lm_eval.JaxkvLM" in names and "jaxkv.chat.Chat" in names
    missing = []
    for name in sorted(names):
        parent, _, last = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ImportError:
            try:
                getattr(importlib.import_module(parent), last)
            except (ImportError, AttributeError):
                missing.append(name)
    assert not missing, missing


def test_the_layers_are_attributes_after_import_jaxkv_alone():
    """`import jaxkv` then jaxkv.core.decoder.prefill_padded (as the docs write it) works in a
    fresh interpreter, though jaxkv imports its names only when first used."""
    code = ("import jaxkv; jaxkv.core.decoder.prefill_padded; jaxkv.decoding.batching.Schedule; "
            "jaxkv.ops.arrays; jaxkv.formats.gguf; jaxkv.models.llama; jaxkv.front.cli")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
