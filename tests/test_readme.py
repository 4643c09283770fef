"""Every ```python block of README.md and of each docs/*.md runs as written, so an example
cannot rot (all but the README title's one-line signature of decode_step, which names its
arguments but does not make them).

The blocks under one `#` or `##` heading of one file form one script, named "<file>: <heading>",
run in order in one namespace (later blocks use what earlier ones defined; `###` subsections
stay in their `##` section's script), in a fresh Python process whose working directory is the
repository root: a section that needs 8 host devices sets XLA_FLAGS itself before importing
jax. The processes run with JAX_PLATFORMS=cpu, so that the mesh example finds its 8 simulated
devices on a machine with an accelerator too. Nothing in the code is substituted: the examples
are written small enough to run as they are. Non-python fences (bash, text) are not run. All
sections start at once: most of their time is compiling, which keeps one core busy each; each
loads its model, so the docs keep their examples in few sections.
"""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# Sections whose block is a one-line signature, not an example.
SIGNATURES = {"README.md: jaxkv"}
# What a section's output must contain, where its examples print something checkable.
PRINTS = {"docs/guide.md: Decoding": "ask not what your country can do for you"}


def python_sections(markdown: str) -> dict[str, str]:
    """{heading: its ```python blocks joined in order} for each `#` / `##` heading."""
    sections, heading, fence, block = {}, None, None, []
    for line in markdown.splitlines():
        if line.startswith("```"):
            if fence == "python":
                sections.setdefault(heading, []).append("\n".join(block))
            fence, block = (line[3:].strip(), []) if fence is None else (None, [])
        elif fence is not None:
            block.append(line)
        elif line.startswith(("# ", "## ")):
            heading = line.lstrip("#").strip()
    assert fence is None, "a ``` fence is not closed"
    return {h: "\n\n".join(blocks) for h, blocks in sections.items()}


def all_sections() -> dict[str, str]:
    """{"<file>: <heading>": script} over README.md and docs/*.md."""
    sections = {}
    for name in FILES:
        with open(os.path.join(ROOT, name)) as f:
            for heading, script in python_sections(f.read()).items():
                sections[f"{name}: {heading}"] = script
    return sections


SECTIONS = all_sections()
RUN = sorted(set(SECTIONS) - SIGNATURES)


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """{section: (process, stdout file, stderr file)} for every section, all started at once."""
    folder = tmp_path_factory.mktemp("readme")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    started = {}
    for i, section in enumerate(RUN):
        script, out, err = (folder / f"section{i}{ext}" for ext in (".py", ".out", ".err"))
        script.write_text(SECTIONS[section])
        with open(out, "w") as stdout, open(err, "w") as stderr:
            started[section] = (subprocess.Popen([sys.executable, str(script)], cwd=ROOT,
                                                 env=env, stdout=stdout, stderr=stderr), out, err)
    yield started
    for process, _, _ in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_examples_are_found():
    assert {"README.md: Library example", "docs/guide.md: Decoding",
            "docs/guide.md: Data sets, streaming, chat, command line",
            "docs/guide.md: Running on a mesh (several devices, several hosts)",
            "docs/speculative.md: How it works, with an example"} <= set(RUN)
    assert set(PRINTS) <= set(RUN)
    assert all(SECTIONS[section].strip() for section in RUN)
    assert all(len(SECTIONS[section].strip().splitlines()) == 1 for section in SIGNATURES)


@pytest.mark.parametrize("section", RUN)
def test_readme_section_runs(section, processes):
    process, out, err = processes[section]
    returncode = process.wait(timeout=600)
    assert returncode == 0, f"{section!r} failed:\n{err.read_text()[-3000:]}"
    assert PRINTS.get(section, "") in out.read_text().lower()


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
