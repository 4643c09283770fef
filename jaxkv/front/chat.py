"""A conversation whose KV cache is kept between turns.

Each turn renders the whole conversation with the chat template and tokenizes it, as a fresh
run would; the cache already holds the ids the last turn ended with (its prompt and answer), so
only the ids after the longest common prefix are prefilled. The answer equals a fresh run's over
the whole conversation.
"""

import jax

from jaxkv.decoding.batching import Schedule
from jaxkv.decoding.stops import cut, texts_of
from jaxkv.formats.tokenizer import render_chat
from jaxkv.front.stream import Text


class Chat:
    """chat = Chat(params, tokenizer, template); for text in chat.say("Hi"): print(text)."""

    def __init__(self, params, tokenizer, template: str, *, system: str | None = None,
                 max_len: int | None = None, max_new_tokens: int = 256, stop=(), **options):
        c = params.config
        if not isinstance(template, str) or not template.strip():
            raise ValueError(f"Chat: template must be the model's Jinja chat template (a "
                             f"string; jaxkv.chat_template(path) reads it), got {template!r:.60}")
        self.params, self.tokenizer, self.template = params, tokenizer, template
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        self.max_new_tokens, self.stop = max_new_tokens, texts_of(stop)
        held = "max_len" if max_len else "its default cache"
        max_len = max_len or min(c.max_seq_len, 4096)
        self.eos_id = options.setdefault("eos_id", list(c.end_ids) or None)
        self.new_schedule = lambda: Schedule(
            params, [], max_new_tokens, 1, max_len=max_len, block_size=None,
            stop=self.stop or None, tokenizer=tokenizer,
            limit=f"the chat's {max_len} positions ({held})", **options)
        self.schedule = self.new_schedule()
        self.cached = []  # the ids the cache holds, position by position
        self.prefilled = []  # per turn: (ids prefilled, ids of the conversation)

    def say(self, text: str):
        """The assistant's answer to text, in pieces as it is drawn. The turn joins the
        conversation once answered: a turn refused (too long, say) or broken off leaves it as
        it was."""
        if not isinstance(text, str):
            raise TypeError(f"Chat.say: text must be a string, got {type(text).__name__}")
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.tokenizer.encode(self.render(messages)).ids
        s, turn = self.schedule, len(self.prefilled)
        checked = s.checked(turn, ids, f"the conversation at turn {turn + 1}")
        start = self.reusable(ids)
        self.cached = ids[:start]  # what the cache surely holds once the prefill begins
        s.serve(0, turn, checked, start)
        answer, shown = [], Text(self.tokenizer, self.eos_id, self.stop)
        try:
            for new in s.stream(1):
                answer += new
                yield shown.add(new)
        except KeyboardInterrupt:
            self.mend()
            raise
        yield shown.finish()
        self.cached = ids + answer[:-1]  # the last id drawn was never run through the model
        reply = self.tokenizer.decode([t for t in answer if t not in shown.ends],
                                      skip_special_tokens=True)
        self.messages = [*messages, {"role": "assistant", "content": cut(reply, self.stop)}]
        self.prefilled.append((len(ids) - start, len(ids)))

    def mend(self) -> None:
        """After a turn broken off by Ctrl-C: if the cache had been handed to a call that never
        returned (donated, so deleted), a fresh one, and the next turn prefills it all."""
        if any(x.is_deleted() for x in jax.tree.leaves(self.schedule.rows)
               if isinstance(x, jax.Array)):
            self.schedule, self.cached = self.new_schedule(), []

    def render(self, messages=None) -> str:
        """The conversation (or `messages`) as the template writes it for the next turn."""
        return render_chat(self.template, self.params.config, self.tokenizer,
                           self.messages if messages is None else messages)

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
