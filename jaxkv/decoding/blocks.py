"""The host side of a paged cache (jaxkv.ops.PagedKV): which blocks of the pool each row holds,
and which blocks hold prompt text already computed (the prefix cache).

A row takes, when its prompt is admitted, every block its prompt and budget can fill, and gives
them back when it ends: nothing is allocated inside the compiled loops, and a batch costs what
its rows hold. A prompt's full blocks are remembered by their text from the start (a chain of
hashes, one per block) as soon as a row takes them; a later prompt that begins with the same
text reads those blocks and computes only the rest, once the row computing them has written
them (so rows admitted together compute a shared beginning once). Remembered blocks no row
holds are evicted least recently used first when the pool runs out.
"""

import hashlib
from collections import OrderedDict

import numpy as np

from jaxkv.core import checks


class BlockPool:
    """`blocks` blocks of `size` slots; prefix_cache: remember prompts' full blocks."""

    def __init__(self, blocks: int, size: int, prefix_cache: bool):
        self.blocks, self.size, self.prefix_cache = blocks, size, prefix_cache
        # Taken from the end, so a row's fresh blocks ascend: the CPU's attention kernel reads
        # pages in ascending order at the contiguous cache's speed, in descending order slower
        # (docs/performance-log.md, 2026-11-28).
        self.free = list(range(blocks - 1, -1, -1))
        self.refs = [0] * blocks
        self.by_key: dict[bytes, int] = {}  # a prompt's text up to a block's end -> that block
        self.key_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # remembered, no row holds them

    def need(self, tokens: int) -> int:
        return -(-tokens // self.size)

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def take(self, ids, tokens: int):
        """(blocks for a row of `tokens` positions whose prompt is ids, prompt tokens already in
        the first of them), or None while the pool cannot hold it. The prompt's last token is
        always computed (its logits start the answer)."""
        reused = self._remembered(ids) if self.prefix_cache else []
        fresh = self.need(tokens) - len(reused)
        if fresh > self.available() - sum(b in self.idle for b in reused):
            return None
        for b in reused:
            self.idle.pop(b, None)
            self.refs[b] += 1
        blocks = reused + [self._fresh() for _ in range(fresh)]
        self._remember(ids, blocks)
        return blocks, len(reused) * self.size

    def _remember(self, ids, blocks) -> None:
        """The prompt ids goes into blocks: its full blocks can serve later prompts (which wait
        for them to be written: Paging.ready)."""
        if not self.prefix_cache:
            return
        for j, key in enumerate(self._keys(ids, len(ids) // self.size)):
            if key not in self.by_key and blocks[j] not in self.key_of:
                self.by_key[key], self.key_of[blocks[j]] = blocks[j], key

    def give(self, blocks) -> None:
        """A row ended: its blocks go back (remembered ones stay readable until evicted)."""
        for b in reversed(blocks):  # a later row takes them in the order this one had them
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.idle[b] = None
                else:
                    self.free.append(b)

    def grow(self, blocks: int) -> None:
        self.free[:0] = range(blocks - 1, self.blocks - 1, -1)
        self.refs += [0] * (blocks - self.blocks)
        self.blocks = blocks

    def _fresh(self) -> int:
        if self.free:
            b = self.free.pop()
        else:  # the least recently used remembered block no row holds
            b, _ = self.idle.popitem(last=False)
            del self.by_key[self.key_of.pop(b)]
        self.refs[b] = 1
        return b

    def _remembered(self, ids) -> list[int]:
        """Remembered blocks that hold ids' first full blocks (before its last token), in
        order, up to the first that is not."""
        found = []
        for key in self._keys(ids, (len(ids) - 1) // self.size):
            if key not in self.by_key:
                break
            found.append(self.by_key[key])
        return found

    def _keys(self, ids, n: int) -> list[bytes]:
        """The chained hashes of ids' first n blocks: each names all the text before its end."""
        keys, key = [], b""
        ids = np.asarray(ids, np.int32)
        for j in range(n):
            key = hashlib.sha256(key + ids[j * self.size:(j + 1) * self.size].tobytes()).digest()
            keys.append(key)
        return keys


class Paging:
    """A Schedule's paged cache on the host: the pool, each row's blocks and table.

    blocks: the pool's size (see generate_many's cache_tokens); grow: whether it may double when
    a row cannot be admitted (an iterable of prompts without cache_tokens), up to max_blocks."""

    def __init__(self, rows: int, capacity: int, size: int, blocks: int, prefix_cache: bool,
                 grow: bool):
        self.pool = BlockPool(blocks, size, prefix_cache)
        self.per_row = capacity // size
        self.max_blocks = rows * self.per_row
        self.can_grow = grow
        self.held: list[list[int] | None] = [None] * rows
        self.reused = [0] * rows  # how many of the row's first blocks another row computes
        self.writing: dict[int, tuple[int, int]] = {}  # remembered block -> (row, tokens end)

    def table(self, row: int) -> np.ndarray:
        """Row's block table [M]: its blocks, then none (the pool's size)."""
        table = np.full((self.per_row,), self.pool.blocks, np.int32)
        held = self.held[row] or []
        table[:len(held)] = held
        return table

    def take(self, row: int, ids, tokens: int):
        """Tokens of ids already in the row's new blocks, or None while the pool is full."""
        got = self.pool.take(ids, tokens)
        if got is None:
            return None
        (self.held[row], start), size = got, self.pool.size
        self.reused[row] = start // size
        for j in range(self.reused[row], len(ids) // size):
            if self.held[row][j] in self.pool.key_of:
                self.writing[self.held[row][j]] = (row, (j + 1) * size)
        return start

    def ready(self, row: int) -> bool:
        """Whether the blocks the row reads from other rows are written."""
        return not any(b in self.writing for b in self.held[row][:self.reused[row]])

    def wrote(self, row: int, tokens: int) -> None:
        """The row's prompt is computed up to `tokens`: its blocks that end there are written."""
        done = [b for b, (r, end) in self.writing.items() if r == row and end <= tokens]
        for b in done:
            del self.writing[b]

    def give(self, row: int) -> None:
        self.pool.give(self.held[row])
        self.held[row] = None

    def grown(self) -> int | None:
        """The pool's new size after doubling (at most max_blocks), or None if it may not."""
        if not self.can_grow or self.pool.blocks >= self.max_blocks:
            return None
        blocks = min(2 * self.pool.blocks, self.max_blocks)
        self.pool.grow(blocks)
        return blocks


def default_blocks(size: int, needs_tokens: list[int], rows: int) -> int:
    """Blocks for the `rows` largest needs (prompt + budget, in tokens) at once: what the
    longest rows in flight can hold, never rows x capacity unless every prompt needs it."""
    needs = sorted((-(-n // size) for n in needs_tokens), reverse=True)
    return max(1, sum(needs[:rows]))


def paging_for(config, work, budgets, rows: int, capacity: int, block_size, cache_tokens,
               prefix_cache: bool):
    """The blocks.Paging of a Schedule (None: block_size None, or learned positions that whole
    blocks would pass). The pool: cache_tokens / block_size blocks; else, for a list of
    prompts, what its `rows` largest needs hold at once; for an iterable, one row's worth,
    doubling as rows need it. Prompts share blocks unless prefix_cache is False or the model
    has window layers (a ring holds no block of a prompt)."""
    if block_size is None:
        return None
    size = checks.int_arg(block_size, "block_size")
    per_row = -(-capacity // size)
    if config.position == "learned" and per_row * size > config.max_seq_len:
        return None
    if cache_tokens is not None:
        blocks = checks.int_arg(cache_tokens, "cache_tokens") // size
        if blocks < 1:
            raise ValueError(f"cache_tokens ({cache_tokens}) holds no block of {size} tokens")
    elif isinstance(work, list):
        blocks = default_blocks(size, [len(ids) + budgets(i) for i, _, ids in work], rows)
    else:
        blocks = per_row
    share = bool(prefix_cache) and not config.window_layers
    return Paging(rows, per_row * size, size, blocks, share,
                  grow=cache_tokens is None and not isinstance(work, list))
