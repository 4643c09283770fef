"""Chat keeps its KV cache between turns: a new turn prefills only its own ids, and its answer
equals a fresh run over the whole conversation."""

import pytest

import jaxkv
from jaxkv.front.chat import Chat
from tests.conftest import char_tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_turns_reuse_the_cache_and_answer_as_a_fresh_run(llama):
    tokenizer = char_tokenizer(llama.config.vocab_size)
    chat = Chat(llama, tokenizer, TEMPLATE, system="Be brief.", max_new_tokens=8, max_len=128,
                eos_id=None)
    first = "".join(chat.say("Hi there"))
    second = "".join(chat.say("And then?"))
    assert chat.messages[-1] == {"role": "assistant", "content": second}
    whole = tokenizer.encode(jaxkv.apply_chat_template(TEMPLATE, chat.messages[:-1])).ids
    fresh = sum(jaxkv.iter_tokens(llama, whole, 8, max_len=128), [])
    assert second == tokenizer.decode(fresh) and first
    (n1, total1), (n2, total2) = chat.prefilled
    assert n1 == total1 and n2 == total2 - (total1 + 7)  # the first prompt and answer reused
    assert n2 == 1 + len("|<user>And then?|<assistant>")  # the answer's last id was not run


def test_window_model_restarts_when_it_would_go_back(llama):
    """reusable(): a sliding-window cache cannot go back, so a turn that rewrites earlier ids
    prefills from the start."""
    window = llama.replace(config=llama.config.__class__(**{
        **llama.config.__dict__, "sliding_window": 16, "window_layers": (0,)}))
    chat = Chat(window, char_tokenizer(97), TEMPLATE, max_new_tokens=4, max_len=64)
    chat.cached = [1, 2, 3, 4]
    assert chat.reusable([1, 2, 3, 4, 5]) == 4 and chat.reusable([1, 2, 9, 9, 9]) == 0
    plain = Chat(llama, char_tokenizer(97), TEMPLATE, max_new_tokens=4, max_len=64)
    plain.cached = [1, 2, 3, 4]
    assert plain.reusable([1, 2, 9, 9, 9]) == 2 and plain.reusable([1, 2]) == 1


def test_a_refused_turn_leaves_the_conversation_as_it_was(llama):
    """A turn too long for the cache is refused before anything changes; the next turn answers
    as if the refused one had never been said."""
    tokenizer = char_tokenizer(llama.config.vocab_size)
    chat = Chat(llama, tokenizer, TEMPLATE, max_new_tokens=4, max_len=64, eos_id=None)
    first = "".join(chat.say("Hi"))
    kept = (list(chat.messages), list(chat.cached), list(chat.prefilled))
    with pytest.raises(ValueError, match=r"the conversation at turn 2: \d+ tokens \+ "
                                         r"max_new_tokens 4 = \d+ positions, more than the "
                                         r"chat's 64 positions \(max_len\)"):
        list(chat.say("x" * 80))
    assert (chat.messages, chat.cached, chat.prefilled) == kept
    second = "".join(chat.say("Ok"))
    whole = tokenizer.encode(jaxkv.apply_chat_template(TEMPLATE, chat.messages[:-1])).ids
    assert second == tokenizer.decode(sum(jaxkv.iter_tokens(llama, whole, 4, max_len=64), []))
    assert first and [m["role"] for m in chat.messages] == ["user", "assistant"] * 2


def test_a_template_must_be_given(llama):
    with pytest.raises(ValueError, match="template must be the model's Jinja chat template"):
        Chat(llama, char_tokenizer(97), None)


def test_an_interrupted_turn_leaves_the_conversation_as_it_was(llama):
    """Ctrl-C while a compiled call holds the cache (donated, so deleted once the call began):
    the turn is left out, a fresh cache is made, and the next turn answers as a fresh run."""
    import jax

    tokenizer = char_tokenizer(llama.config.vocab_size)
    chat = Chat(llama, tokenizer, TEMPLATE, max_new_tokens=4, max_len=64, eos_id=None)
    "".join(chat.say("Hi"))
    kept = (list(chat.messages), list(chat.prefilled))

    def interrupted(steps):
        jax.tree.map(lambda x: x.delete(), chat.schedule.rows)
        raise KeyboardInterrupt

    chat.schedule.decode = interrupted
    with pytest.raises(KeyboardInterrupt):
        "".join(chat.say("Tell me more"))
    assert (chat.messages, chat.prefilled) == kept and chat.cached == []
    second = "".join(chat.say("Ok"))
    whole = tokenizer.encode(jaxkv.apply_chat_template(TEMPLATE, chat.messages[:-1])).ids
    assert second == tokenizer.decode(sum(jaxkv.iter_tokens(llama, whole, 4, max_len=64), []))
    assert chat.prefilled[-1][0] == len(whole)  # all of it prefilled again
