"""A conversation whose KV cache is kept between turns.

Each turn renders the whole conversation with the chat template and tokenizes it, as a fresh
run would; the cache already holds the ids the last turn ended with (its prompt and answer), so
only the ids after the longest common prefix are prefilled. The answer equals a fresh run's over
the whole conversation.
"""

from jaxkv.decoding.batching import Schedule
from jaxkv.decoding.stops import cut
from jaxkv.formats.tokenizer import render_chat
from jaxkv.front.stream import Text


class Chat:
    """chat = Chat(params, tokenizer, template); for text in chat.say("Hi"): print(text)."""

    def __init__(self, params, tokenizer, template: str, *, system: str | None = None,
                 max_len: int | None = None, max_new_tokens: int = 256, stop=(), **options):
        c = params.config
        self.params, self.tokenizer, self.template = params, tokenizer, template
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        self.max_new_tokens, self.stop = max_new_tokens, list(stop)
        max_len = max_len or min(c.max_seq_len, 4096)
        self.eos_id = options.setdefault("eos_id", list(c.end_ids) or None)
        self.schedule = Schedule(params, [], max_new_tokens, 1, max_len=max_len,
                                 stop=self.stop or None, tokenizer=tokenizer, **options)
        self.cached = []  # the ids the cache holds, position by position
        self.prefilled = []  # per turn: (ids prefilled, ids of the conversation)

    def say(self, text: str):
        """The assistant's answer to text, in pieces as it is drawn."""
        self.messages.append({"role": "user", "content": text})
        ids = self.tokenizer.encode(self.render()).ids
        start = self.reusable(ids)
        self.prefilled.append((len(ids) - start, len(ids)))
        s = self.schedule
        s.serving[0] = [len(self.prefilled) - 1, s.checked(len(self.prefilled) - 1, ids), start,
                        self.max_new_tokens]
        answer, shown = [], Text(self.tokenizer, self.eos_id, self.stop)
        for new in s.stream(1):
            answer += new
            yield shown.add(new)
        yield shown.finish()
        self.cached = ids + answer[:-1]  # the last id drawn was never run through the model
        reply = self.tokenizer.decode([t for t in answer if t not in shown.ends],
                                      skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": cut(reply, self.stop)})

    def render(self) -> str:
        return render_chat(self.template, self.params.config, self.tokenizer, self.messages)

    def reusable(self, ids) -> int:
        """How many leading ids the cache holds already (at least one id is run again, for the
        next token's logits; a sliding-window model restarts unless it only goes forward)."""
        n = 0
        while n < min(len(ids), len(self.cached)) and ids[n] == self.cached[n]:
            n += 1
        n = min(n, len(ids) - 1)
        if self.params.config.sliding_window is not None and n < len(self.cached):
            n = 0  # its ring has dropped the positions it would go back to
        return n
