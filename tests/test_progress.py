"""The progress line: the wait for the first tokens said apart from the rate, tokens counted as
they come, the rate over recent seconds, each line drawn over the whole last one, a final
newline; nothing at all when off."""

import io

import pytest

import jaxkv
from jaxkv.decoding import progress as progress_lib
from jaxkv.decoding.progress import Progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def bar(total=12, on=True):
    clock, out = Clock(), io.StringIO()
    return Progress(total, on, clock=clock, out=out), clock, out


def last_line(out) -> str:
    return out.getvalue().split("\r")[-1]


def test_the_wait_before_the_first_tokens_is_said_apart():
    """33 s of compiling, then 10 tokens a second: the rate and the time left are the
    decoding's, not diluted by the compile (was `1/12 prompts, 0.3 tokens/s, ETA 351 s`)."""
    b, clock, out = bar(total=12)
    clock.now = 33.0
    b.tick(lambda: 16)
    assert "[first tokens after 33.0 s, compiling included]\n" in out.getvalue()
    clock.now = 35.0
    b.ended(20)
    b.tick(lambda: 16)
    assert last_line(out).rstrip() == "1/12 prompts, 36 tokens, 10.0 tokens/s, ETA 20 s"
    clock.now = 37.0
    b.ended(24)
    b.close()
    assert out.getvalue().endswith("\n")
    assert last_line(out).rstrip() == "2/12 prompts, 44 tokens in 4.0 s, 7.0 tokens/s"


def test_the_rate_is_over_recent_seconds():
    """A slow start, then 100 tokens a second: after a window the rate is the recent one."""
    b, clock, out = bar(total=None)
    drawn = 0
    for second in range(1, 41):
        clock.now, drawn = float(second), drawn + (1 if second <= 20 else 100)
        b.tick(lambda: drawn)
    assert b.rate() == pytest.approx(100.0)
    assert last_line(out).rstrip() == f"0 prompts, {drawn} tokens, 100.0 tokens/s"


def test_a_shorter_line_covers_the_longer_one_before_it():
    """(was `7/7 prompts, 9.2 tokens/s, ETA 0 sss`)."""
    b, clock, out = bar()
    clock.now = 1.0
    b.tick(lambda: 100000)
    clock.now = 2.0
    b.tick(lambda: 200000)
    long = out.getvalue().split("\r")[-1]
    clock.now = 3.0
    b.tick(lambda: 5)  # fewer digits (a new prompt's answer)
    short = last_line(out)
    assert len(short) == len(long) and short.rstrip() != short


def test_the_line_is_drawn_at_most_every_redraw_s():
    b, clock, out = bar()
    asked = []
    for t in (1.0, 1.1, 1.2, 1.3):
        clock.now = t
        b.tick(lambda: asked.append(t) or 8)
    assert asked == [1.0, 1.3]


def test_off_it_draws_nothing_and_leaves_the_decode_calls_whole():
    b, clock, out = bar(on=False)
    b.tick(lambda: pytest.fail("fetched while off"))
    b.ended(5)
    b.close()
    assert out.getvalue() == "" and b.steps(256) == 256


def test_decode_calls_take_about_redraw_s():
    """Calls quicker than half of REDRAW_S double the steps (up to the caller's most), slower
    ones halve them."""
    b, clock, _ = bar()
    assert b.steps(256) == progress_lib.FIRST_STEPS
    for _ in range(10):
        clock.now += 0.01
        b.steps(256)
    assert b.steps(256) == 256
    clock.now += 1.0
    assert b.steps(256) == 128
    clock.now += 0.01
    assert b.steps(8) == 8  # during an admission: the caller's own limit


def test_iter_many_counts_tokens_before_an_answer_ends(llama, capsys, monkeypatch):
    """One long answer: the line shows its tokens while it is drawn, and ends with a newline;
    the answer is the one drawn without the line."""
    monkeypatch.setattr(progress_lib, "REDRAW_S", 0.0)
    quiet = jaxkv.generate_many(llama, [[1, 2, 3]], 24)
    shown = jaxkv.generate_many(llama, [[1, 2, 3]], 24, progress=True)
    err = capsys.readouterr().err
    assert shown == quiet and err.endswith("\n")
    counts = {line.split(" tokens")[0] for line in err.split("\r") if line.startswith("0/1")}
    assert len(counts) > 1  # several counts before the prompt ended


def test_an_interrupted_run_ends_its_line(llama, capsys, monkeypatch):
    """Ctrl-C while decoding: the line shows where it got, then a newline, so the message
    after it starts on a line of its own (was: on the progress line)."""
    from jaxkv.decoding import batching

    monkeypatch.setattr(progress_lib, "REDRAW_S", 0.0)
    real, calls = batching.Schedule.decode, []

    def decode(schedule, steps):
        calls.append(steps)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(schedule, steps)

    monkeypatch.setattr(batching.Schedule, "decode", decode)
    with pytest.raises(KeyboardInterrupt):
        jaxkv.generate_many(llama, [[1, 2, 3]], 24, progress=True)
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.split("\r")[-1].startswith("0/1 prompts, ")
    assert int(err.split("\r")[-1].split()[2]) > 0  # the tokens drawn before Ctrl-C
