"""Counts how often functions are traced, so tests and benchmarks can assert 'compiled once'."""

import collections

TRACE_COUNTS: collections.Counter = collections.Counter()


def count_trace(name: str) -> None:
    """Call at the top of a function body: it runs once per trace, not once per call."""
    TRACE_COUNTS[name] += 1
