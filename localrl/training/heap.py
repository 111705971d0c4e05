"""The C heap under torch's CPU tensors: freed memory goes back to the operating system.

glibc's malloc serves a large allocation with its own mmap and unmaps it on free, but only
above a threshold that it raises, by default, to the size of each such block freed (up to
32 MiB). After the first few large tensors are freed, every tensor under 32 MiB comes from
the heap's arenas instead, and a training step's thousands of short-lived activations, logit
chunks and gradients leave those arenas fragmented: the memory is free to malloc but stays
resident. Measured on one GRPO update of SmolLM2-135M's shape (32 prompts x 8 completions,
110 + 48 tokens, activation checkpointing): 2.35 GiB of live tensors at the peak, 13.9 GiB
resident with glibc's defaults, 2.47 GiB with the threshold fixed at 1 MiB (and 9% faster).
A lower threshold keeps the resident set closer still to the live tensors when they are small
(micro-batches of a few completions: 1.19 GiB at 64 KiB against 1.48 at 1 MiB, for a 1.16 GiB
prediction) but maps and zeroes fresh pages for each of them: that update took 1.6x as long.
The planner leaves room for the difference instead (memory.PLAN_MARGIN).

Fixing the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``) also turns off its adjustment.
Allocations of 1 MiB and more then map and unmap their own pages; smaller ones, far fewer
bytes, stay on the heap. Other C libraries (musl) have no such threshold: nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20

_done = False


def return_freed_memory() -> bool:
    """Make freed tensor memory leave the process (once a process); whether the C library took it."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc
        _done = False
    return _done

