"""Weights on 2 MiB pages (Linux, CPU), so that a decode step's stream through them misses the
TLB 512 times less often.

A decode step reads every weight once. On 4 KiB pages that is a page walk every 4 KiB, and in a
virtual machine each walk goes through two page tables. XLA allocates its buffers on ordinary
pages, and with transparent huge pages set to "madvise" (a common default) they stay there.
"""

import ctypes
import functools
import sys

import jax

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman.h; MADV_COLLAPSE since Linux 6.1
HUGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller leaves cost few page walks, and their pages hold other buffers


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def advise(x) -> float:
    """Asks Linux to back the 2 MiB pages that CPU array x touches with huge pages: now
    (MADV_COLLAPSE), or where that is refused, as they are next faulted (MADV_HUGEPAGE). The
    fraction of those pages collapsed; the array's values are untouched either way."""
    libc = _libc()
    if (libc is None or isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array)
            or x.nbytes < MIN_BYTES or any(d.platform != "cpu" for d in x.devices())):
        return 0.0
    done = total = 0
    x.block_until_ready()  # its pages written, not still being filled by a dispatched computation
    for shard in x.addressable_shards:
        if shard.data.nbytes < MIN_BYTES:
            continue
        start = shard.data.unsafe_buffer_pointer()
        for page in range(start // HUGE * HUGE, start + shard.data.nbytes, HUGE):
            address, size = ctypes.c_void_p(page), ctypes.c_size_t(HUGE)
            libc.madvise(address, size, MADV_HUGEPAGE)
            done += libc.madvise(address, size, MADV_COLLAPSE) == 0
            total += 1
    return done / max(total, 1)


def huge_pages(tree):
    """tree, its large CPU arrays moved onto 2 MiB pages where the OS allows (see advise); what
    load, cast and quantize return."""
    for leaf in jax.tree.leaves(tree):
        advise(leaf)
    return tree
