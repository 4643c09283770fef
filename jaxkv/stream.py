"""Streaming: `for text in jaxkv.stream(params, tokenizer, prompt): print(text, end="")`.

The compiled generate loop runs in a thread and hands each token out through its on_token
callback; the iterator turns the ids into text pieces as they come (holding back an incomplete
UTF-8 character, and text that may be the start of a stop string). Leaving the loop early
stops the generation at its next token.
"""

import queue
import threading

from jaxkv import stops
from jaxkv.generate import generate

_END = object()


class _Stopped(Exception):
    """Raised in on_token once the reader has gone: ends the compiled loop."""


def stream(params, tokenizer, prompt, max_new_tokens: int = 256, *, stop=(), **options):
    """Text pieces of one prompt's answer as it is drawn. prompt: text (encoded with the
    tokenizer as is: apply a chat template first if wanted) or token ids. Ends at the model's
    end ids (config.end_ids; eos_id= overrides them), at a stop string (not yielded), or after
    max_new_tokens. Options: generate's."""
    ids = tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
    options.setdefault("eos_id", list(params.config.end_ids) or None)
    ends = set(options["eos_id"] if isinstance(options["eos_id"], (list, tuple)) else
               [] if options["eos_id"] is None else [options["eos_id"]])
    tokens, reader_gone = queue.Queue(), threading.Event()

    def on_token(token_B):
        if reader_gone.is_set():
            raise _Stopped
        tokens.put(int(token_B[0]))

    def run():
        try:
            generate(params, [ids], max_new_tokens, on_token=on_token, **options)
        except _Stopped:
            pass
        except BaseException as e:  # handed to the reader
            tokens.put(e)
        tokens.put(_END)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield from _texts(tokens, tokenizer, ends, list(stop))
    finally:
        reader_gone.set()


def _texts(tokens, tokenizer, ends, stop_texts):
    """Text pieces from a queue of ids (ending at _END, an end id, or a stop string)."""
    answer, sent = [], 0
    hold = max(map(len, stop_texts), default=1) - 1  # a stop string may still be forming
    while (token := tokens.get()) is not _END:
        if isinstance(token, BaseException):
            raise token
        if token in ends:
            break
        answer.append(token)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        cut = stops.cut(text, stop_texts)
        if len(cut) < len(text):
            yield cut[sent:]
            return
        ready = min(len(text) - hold, len(text.rstrip("\ufffd")))  # whole characters only
        if ready > sent:
            yield text[sent:ready]
            sent = ready
    text = tokenizer.decode(answer, skip_special_tokens=True)
    if len(text) > sent:
        yield text[sent:]
