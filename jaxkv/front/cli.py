"""The command line: `jaxkv generate "PROMPT"` streams a model's answer to the terminal,
`jaxkv generate --input prompts.jsonl --output answers.jsonl` answers a data set (resumable),
`jaxkv chat` holds a conversation, and `jaxkv transcribe AUDIO` prints what a recording says.

Compiled programs are kept in JAX's persistent compilation cache (--compile-cache), so a second
run of the same model starts in a fraction of the first run's time.

A user's mistake (a missing or broken model, an impossible setting, a run that cannot fit in
memory) ends with one line on stderr, "jaxkv: ...", and exit code 1, before any compiling.
"""

import contextlib
import math
import os
import sys
import time

from jaxkv.formats.locate import default_model, default_whisper, resolve
from jaxkv.front.flags import parser
from jaxkv.front.processes import join_processes
from jaxkv.front.report import Compiles, since_start, status

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
        (args.min_p is not None and not 0 <= args.min_p <= 1,
         f"--min-p must be in [0, 1], got {args.min_p}"),
        (args.repetition_penalty is not None and not 0 < args.repetition_penalty < math.inf,
         f"--repetition-penalty must be > 0, got {args.repetition_penalty}"),
        (args.batch_size < 1, f"--batch-size must be at least 1, got {args.batch_size}"),
        (any(not s for s in args.stop), "--stop must not be empty"),
        (getattr(args, "logprobs", None) is not None and args.logprobs < 0,
         f"--logprobs must be at least 0, got {getattr(args, 'logprobs', None)}"),
        (getattr(args, "logprobs", None) is not None and not getattr(args, "input", None),
         "--logprobs is written into --output's lines: it needs --input"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)
    if getattr(args, "json_schema", None) is not None:  # (read as JSON before the model loads)
        from jaxkv.front import jsonl

        jsonl.form_of(args)


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


def load_model(path: str, mesh=None):
    """(params, tokenizer) of a model path (on mesh, each process reading its share); a file
    that cannot be read is an error naming it."""
    from jaxkv.formats.load import load
    from jaxkv.formats.tokenizer import load_tokenizer

    try:
        params = load(path, mesh=mesh)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot load the model: {_naming(path, e)}") from e
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:  # `tokenizers` reports a malformed tokenizer.json as a bare Exception
        if type(e) is not Exception and not isinstance(e, (ValueError, OSError)):
            raise
        raise ValueError(f"cannot load the tokenizer: {_naming(path, e)}") from e
    return params, tokenizer


def kv_cache_bytes(config, batch: int, capacity: int, dtype) -> int:
    """Bytes of every layer's K and V: 2 x B x K x H x itemsize x the slots of each layer
    (capacity, or the window in a sliding-window layer)."""
    import numpy as np

    from jaxkv.core.cache import slots

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

@contextlib.contextmanager
def compile_cache(directory: str):
    """JAX's persistent compilation cache in directory while a command runs ('off': none); the
    settings it found are restored after, so main called from Python (a notebook, the tests)
    leaves later compiles of the process as they were."""
    if directory == "off":
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    os.makedirs(directory, exist_ok=True)
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    found = [getattr(jax.config, name) for name in names]
    for name, value in zip(names, (directory, 0)):  # 0 s: small programs add up
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # opened again, at the next compile, from these settings
    try:
        yield
    finally:
        for name, value in zip(names, found):
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def prompt_ids(path, config, tokenizer, prompt: str, use_chat: bool) -> list[int]:
    from jaxkv.formats.tokenizer import chat_template, render_chat

    template = chat_template(path) if use_chat else None
    if template:
        prompt = render_chat(template, config, tokenizer, [{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def sampling_options(args) -> dict:
    """iter_many's options from the flags."""
    import jax

    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                key=jax.random.key(args.seed))


def start(args, mesh=None):
    """(path, params, tokenizer, seconds it took) after the flags are checked and the model
    loaded (cast to --dtype; on mesh)."""
    from jaxkv.core.params import cast

    check_generate_args(args)
    path = model_path(args.model, default_model)
    t0 = time.perf_counter()
    status(f"loading {path}")
    params, tokenizer = load_model(path, mesh)
    if args.dtype != "float32":
        params = cast(params, args.dtype)
    return path, params, tokenizer, time.perf_counter() - t0


def run_generate(args) -> None:
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give a PROMPT or --input FILE (with --output FILE), not both")
    if (args.input is None) != (args.output is None):
        raise ValueError("--input and --output go together")
    check_exists(args.input, "--input")
    if args.input is not None:  # the requests, and the answers there already: before loading
        from jaxkv.front import jsonl

        options = jsonl.flag_options(args, model_path(args.model, default_model))
        total, done = jsonl.check_job(args.input, args.output, args.max_new_tokens, **options)
        if done:
            status(f"{done} of {total} already in {args.output}; answering {total - done}")
    mesh = join_processes(args)
    path, params, tokenizer, load_s = start(args, mesh)
    if args.input is not None:
        return run_file(args, path, params, tokenizer, mesh)
    ids = prompt_ids(path, params.config, tokenizer, args.prompt, not args.no_chat)
    stream_answer(args, params, tokenizer, ids, load_s)


def stream_answer(args, params, tokenizer, ids, load_s=0.0) -> list[int]:
    """Prints one prompt's answer as it is drawn (on Ctrl-C, all drawn so far), then a line
    of figures; returns its ids."""
    from jaxkv.decoding.batching import iter_tokens
    from jaxkv.decoding.prompts import cache_capacity
    from jaxkv.front.stream import Text

    from jaxkv.front import jsonl

    ends = list(params.config.end_ids)
    check_memory(params, 1, cache_capacity(params.config, [ids], args.max_new_tokens))
    constraint = jsonl.constraint_of(jsonl.form_of(args), tokenizer, "jaxkv generate")
    status(f"compiling (or reading the compile cache) and prefilling {len(ids)} tokens")
    text, answer, first = Text(tokenizer, ends, args.stop), [], None
    began = time.perf_counter()
    try:
        with Compiles() as compiles:
            for new in iter_tokens(params, ids, args.max_new_tokens, eos_id=ends or None,
                                   stop=args.stop or None, tokenizer=tokenizer,
                                   constraint=constraint, **sampling_options(args)):
                first = first if answer else (time.perf_counter(), since_start())
                answer += new
                show(text.add(new))
    except KeyboardInterrupt:
        show(text.finish())
        raise
    show(text.finish() + "\n")
    n, (first_at, first_s) = len(answer), first or (time.perf_counter(), since_start())
    rate = (n - 1) / (time.perf_counter() - first_at) if n > 1 else float("nan")
    status(f"{n} tokens, {rate:.1f} tokens/s; time to first token {first_s:.1f} s from the "
           f"command's start (load {load_s:.1f} s, compiling and prefilling the "
           f"{len(ids)}-token prompt {first_at - began:.1f} s); {compiles.said()}")
    return answer


def show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_file(args, path, params, tokenizer, mesh=None) -> None:
    """--input / --output: every request answered once, appended as it ends."""
    from jaxkv.front import jsonl

    def encode(text):
        return prompt_ids(path, params.config, tokenizer, text, not args.no_chat)

    status(f"answering {args.input} into {args.output}, {args.batch_size} rows at a time; "
           "compiling (or reading the compile cache) before the first answers")
    n = jsonl.answer_file(params, tokenizer, encode, args.input, args.output, args.max_new_tokens,
                          stop_ids=list(params.config.end_ids), batch_size=args.batch_size,
                          progress=sys.stderr.isatty(), prefix_cache=not args.no_prefix_cache,
                          mesh=mesh, **jsonl.flag_options(args, path))
    status(f"{n} answered, {args.output} complete")


def run_chat(args) -> None:
    """Turns read from stdin until EOF or /exit; the cache is kept between them."""
    from jaxkv.formats.tokenizer import chat_template
    from jaxkv.front.chat import Chat

    path, params, tokenizer, _ = start(args)
    template = chat_template(path)
    if template is None:
        raise ValueError(f"{path} has no chat template; use `jaxkv generate --no-chat`")
    chat = Chat(params, tokenizer, template, system=args.system,
                max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling_options(args))
    check_memory(params, 1, chat.schedule.capacity)
    status("type a message, then Enter; Ctrl-C stops an answer; Ctrl-D or /exit ends the chat")
    while (line := read_turn()) is not None:
        say_turn(chat, line)


def say_turn(chat, line: str) -> None:
    """One turn: the answer on stdout, then on stderr what it prefilled and compiled. A turn
    refused, or stopped by Ctrl-C, is left out of the conversation, which goes on."""
    began = time.perf_counter()
    if not chat.prefilled:
        status("compiling (or reading the compile cache) for the first turn")
    try:
        with Compiles() as compiles, contextlib.closing(chat.say(line)) as pieces:
            for piece in pieces:
                show(piece)
    except ValueError as e:
        print(f"jaxkv: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return
    except KeyboardInterrupt:
        show("\n")
        status("answer stopped; the conversation goes on without this turn")
        return
    show("\n")  # the answer's line ends before the figures
    new, total = chat.prefilled[-1]
    status(f"prefilled {new} of the conversation's {total} tokens; "
           f"{time.perf_counter() - began:.1f} s; {compiles.said()}")


def read_turn() -> str | None:
    """The next message; None at /exit, Ctrl-D or Ctrl-C (the chat ends quietly)."""
    try:
        line = input("\n> ")
    except (EOFError, KeyboardInterrupt):
        show("\n")  # the shell's prompt on a line of its own
        return None
    return None if line.strip() == "/exit" else line


def read_audio(path: str):
    """16 kHz samples of an audio file; a file soundfile cannot read is an error naming it."""
    import soundfile

    from jaxkv.formats.audio import load_audio

    check_exists(path, "audio file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"audio file {path!r} is a folder; give an audio file")
    try:
        return load_audio(path)
    except soundfile.SoundFileError as e:
        raise ValueError(f"cannot read the audio file: {_naming(path, e)}") from e


def run_transcribe(args) -> None:
    from jaxkv.front.transcribe import transcribe

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    audio = read_audio(args.audio)
    params, tokenizer = load_model(model_path(args.model, default_whisper))
    print(transcribe(params, tokenizer, [audio], args.max_new_tokens)[0])


def run_eval(args) -> None:
    """The harness's table on stdout (and its results as JSON with --output): across processes,
    every one evaluates (the work spread over --mesh), process 0 prints and writes."""
    from jaxkv.front.jsonl import writable
    writable(args.output, "--output")  # before the evaluation: its results are not lost
    try:
        from jaxkv.front import lm_eval as harness
    except ImportError as e:
        raise ValueError(f"jaxkv eval needs lm-evaluation-harness ({e}): pip install "
                         f"'jaxkv[eval]'") from e
    results = harness.evaluate(model_path(args.model, default_model), args.tasks.split(","),
                               include_path=args.include_path, num_fewshot=args.num_fewshot,
                               limit=args.limit, batch_size=args.batch_size, dtype=args.dtype,
                               seed=args.seed, mesh=join_processes(args))
    harness.report(results, args.output)


def main(argv=None) -> None:
    """Runs a command; a user's mistake exits with code 1 and one line on stderr, no traceback
    (argparse's usage errors keep their code 2); Ctrl-C is one line, "interrupted" and what
    was kept, and exit code 130 (a shell's code for SIGINT)."""
    args = parser().parse_args(argv)
    try:
        with compile_cache(getattr(args, "compile_cache", "off")):  # (generate and chat's flag)
            COMMANDS[args.command](args)
    except (ValueError, OSError, MemoryError) as e:
        message = " ".join(str(e).split())  # one line, whatever the message held
        raise SystemExit(f"jaxkv: {message}") from e
    except KeyboardInterrupt as e:  # a newline first: a progress line or the answer may be open
        print("\ninterrupted" + (f": {e}" if e.args else ""), file=sys.stderr, flush=True)
        raise SystemExit(130) from None


COMMANDS = {"generate": run_generate, "chat": run_chat, "transcribe": run_transcribe,
            "eval": run_eval}


if __name__ == "__main__":
    main()
