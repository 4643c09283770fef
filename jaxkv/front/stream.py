"""Streaming: `for text in jaxkv.stream(params, tokenizer, prompt): print(text, end="")`.

The answer is drawn by batching.iter_tokens, compiled calls of a few decode steps each that
hand their new ids back (no host callback), and turned into text pieces as they come, holding
back an incomplete UTF-8 character and text a stop string may still complete. Leaving the loop
early stops the generation.
"""

import numpy as np

from jaxkv.core import checks
from jaxkv.decoding import stops
from jaxkv.decoding.batching import iter_tokens


def stream(params, tokenizer, prompt, max_new_tokens: int = 256, *, stop=(), **options):
    """Text pieces of one prompt's answer as it is drawn. prompt: text (encoded with the
    tokenizer as is: apply a chat template first if wanted) or token ids. Ends at the model's
    end ids (config.end_ids; eos_id= overrides them) or a stop string, neither of them
    yielded, or after max_new_tokens. Options: iter_tokens' (sampling, key, steps, max_len)."""
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt).ids
    elif prompt is None or np.isscalar(prompt):
        raise TypeError(f"prompt must be text or token ids, got {prompt!r} "
                        f"({type(prompt).__name__})")
    ids = checks.token_ids(params.config, prompt, "prompt", 1).tolist()
    eos = options.setdefault("eos_id", list(params.config.end_ids) or None)
    text = Text(tokenizer, eos, stop)
    for new in iter_tokens(params, ids, max_new_tokens, stop=text.stop or None,
                           tokenizer=tokenizer, **options):
        if piece := text.add(new):
            yield piece
    if piece := text.finish():
        yield piece


class Text:
    """An answer's text as its ids arrive: add(ids) and finish() return what may be shown.
    end_ids: None, an id or ids (eos_id's forms), left out of the text."""

    def __init__(self, tokenizer, end_ids=None, stop=()):
        ends = [] if end_ids is None else np.atleast_1d(end_ids).tolist()
        self.tokenizer, self.ends, self.stop = tokenizer, set(ends), stops.texts_of(stop)
        self.hold = max(map(len, self.stop), default=1) - 1  # a stop string may still form
        self.ids, self.sent = [], 0

    def add(self, ids) -> str:
        self.ids += [t for t in ids if t not in self.ends]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        # whole characters, none that a stop string holds or may still complete
        ready = min(len(text) - self.hold, len(stops.cut(text, self.stop).rstrip("\ufffd")))
        return self._send(text, ready)

    def finish(self) -> str:
        text = stops.cut(self.tokenizer.decode(self.ids, skip_special_tokens=True), self.stop)
        return self._send(text, len(text))

    def _send(self, text, ready) -> str:
        piece = text[self.sent: ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return piece
