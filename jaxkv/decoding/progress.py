"""The progress line of a batch of prompts on stderr: prompts done, tokens drawn, the rate over
the last WINDOW_S seconds and the time left, redrawn in place as tokens come.

The rate's clock starts at the first tokens, so the wait before them (compiling, or reading the
compile cache, and the first prefills) is said once on its own line instead of diluting the
rate and the time left.
"""

import collections
import sys
import time

import jax

WINDOW_S = 15.0  # the rate shown is over this many recent seconds
REDRAW_S = 0.25  # the line is redrawn at most this often
FIRST_STEPS = 8  # decode steps per call to start from, while the line is on


class Progress:
    """Counts prompts and tokens; draws them when on (else it only counts)."""

    def __init__(self, total: int | None, on: bool, clock=time.perf_counter, out=None):
        """total: how many prompts (None: not known); out: the stream (default: sys.stderr at
        each write)."""
        self.total, self.on, self.clock, self.out = total, on, clock, out
        # tokens counted as they come, by this process alone: processes of one mesh must run
        # the same programs, so none may cut its decode calls or fetch at its own times
        self.live = on and jax.process_count() == 1
        self.done, self.ended_tokens, self.drawing = 0, 0, 0
        self.began, self.drawn_at = clock(), None
        self.first = None  # (time, tokens) when the first tokens were seen: the rate's start
        self.window = collections.deque()  # (time, tokens): the recent samples of the rate
        self.width, self.most_steps, self.call_at = 0, FIRST_STEPS, None

    @property
    def tokens(self) -> int:
        return self.ended_tokens + self.drawing

    def steps(self, most: int) -> int:
        """Decode steps for the next call, at most `most`. When live, about as many as take
        REDRAW_S (twice as many after a call that took less than half of it, half as many
        after one that took longer), so the line moves while long answers are drawn, not only
        when one ends."""
        if not self.live:
            return most
        now = self.clock()
        if self.call_at is not None:
            took = now - self.call_at
            if took < REDRAW_S / 2:
                self.most_steps = min(self.most_steps * 2, max(most, FIRST_STEPS))
            elif took > REDRAW_S:
                self.most_steps = max(1, self.most_steps // 2)
        self.call_at = now
        return min(most, self.most_steps)

    def ended(self, tokens: int):
        """An answer of `tokens` tokens ended (those still being drawn, as last counted, less
        them: at most what the answer held then, so no token counts twice)."""
        self.done, self.ended_tokens = self.done + 1, self.ended_tokens + tokens
        self.drawing = max(0, self.drawing - tokens)

    def tick(self, drawing):
        """Redraws the line when on and REDRAW_S have passed since it last was; drawing() ->
        the tokens of the answers not ended yet (asked only then, and only when live)."""
        if self.on and (self.drawn_at is None or self.clock() - self.drawn_at >= REDRAW_S):
            self.show(drawing() if self.live else 0)

    def show(self, drawing: int):
        """Redraws the line; drawing: the tokens of the answers not ended yet."""
        now = self.drawn_at = self.clock()
        self.drawing = drawing
        if self.first is None and self.tokens:
            self.first = (now, self.tokens)
            self._say(f"[first tokens after {now - self.began:.1f} s, compiling included]")
        if self.first is None:
            return
        self.window.append((now, self.tokens))
        while len(self.window) > 2 and self.window[1][0] <= now - WINDOW_S:
            self.window.popleft()
        line = self._count()
        rate = self.rate()
        line += "" if rate is None else f", {rate:.1f} tokens/s"
        eta = self.eta(rate)
        self._write(self._padded(line + ("" if eta is None else f", ETA {eta:.0f} s")))

    def close(self):
        """The last line, its rate over the whole run since the first tokens, ended by a
        newline; nothing when off or when no token came. Once: the line is off after."""
        if not self.on or self.first is None and not self.ended_tokens:
            return
        self.on = False
        now = self.clock()
        t0, n0 = self.first or (now, 0)
        line = self._count()
        if now - t0 >= REDRAW_S:  # a rate over less is noise
            line += f" in {now - t0:.1f} s, {(self.tokens - n0) / (now - t0):.1f} tokens/s"
        self._say(line)

    def rate(self) -> float | None:
        """Tokens per second over the recent window (None until two samples span time)."""
        (t0, n0), (t1, n1) = self.window[0], self.window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def eta(self, rate: float | None) -> float | None:
        """Seconds left: the tokens the prompts not ended will draw (as many as the ended
        answers drew on average, less those drawn already), at the recent rate."""
        if not self.total or not self.done or not rate:
            return None
        left = self.ended_tokens / self.done * (self.total - self.done) - self.drawing
        return max(0.0, left) / rate

    def _count(self) -> str:
        total = f"/{self.total}" if self.total else ""
        return f"{self.done}{total} prompts, {self.tokens} tokens"

    def _padded(self, line: str) -> str:
        """\\r, then line padded with spaces over what a longer line before it left."""
        self.width = max(self.width, len(line))
        return "\r" + line.ljust(self.width)

    def _say(self, line: str):
        """line in place of the progress line, then a newline: the next line starts clean."""
        self._write(self._padded(line) + "\n")
        self.width = 0

    def _write(self, text: str):
        out = self.out or sys.stderr
        out.write(text)
        out.flush()
