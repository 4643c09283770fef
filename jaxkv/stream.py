"""Streaming: `for text in jaxkv.stream(params, tokenizer, prompt): print(text, end="")`.

The answer is drawn by batching.iter_tokens, compiled calls of a few decode steps each that
hand their new ids back (no host callback), and turned into text pieces as they come, holding
back an incomplete UTF-8 character. Leaving the loop early stops the generation.
"""

from jaxkv import stops
from jaxkv.batching import iter_tokens


def stream(params, tokenizer, prompt, max_new_tokens: int = 256, *, stop=(), **options):
    """Text pieces of one prompt's answer as it is drawn. prompt: text (encoded with the
    tokenizer as is: apply a chat template first if wanted) or token ids. Ends at the model's
    end ids (config.end_ids; eos_id= overrides them) or a stop string, neither of them
    yielded, or after max_new_tokens. Options: iter_tokens' (sampling, key, steps, max_len)."""
    ids = tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
    eos = options.setdefault("eos_id", list(params.config.end_ids) or None)
    ends = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
    stop = list(stop)
    hold = max(map(len, stop), default=1) - 1  # text a stop string may still complete
    answer, sent = [], 0
    for new in iter_tokens(params, ids, max_new_tokens, stop=stop or None, tokenizer=tokenizer,
                           **options):
        answer += [t for t in new if t not in ends]
        text = tokenizer.decode(answer, skip_special_tokens=True)
        # whole characters, none that a stop string holds or may still complete
        ready = min(len(text) - hold, len(stops.cut(text, stop).rstrip("\ufffd")))
        if ready > sent:
            yield text[sent:ready]
            sent = ready
    text = stops.cut(tokenizer.decode(answer, skip_special_tokens=True), stop)
    if len(text) > sent:
        yield text[sent:]
