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

Every such mapping is faulted in afresh, a page at a time: that update took 54.7 million page
faults. So torch is also asked (``THP_MEM_ALLOC_ENABLE``, read at its first CPU allocation) to
align tensors of 2 MiB and more to 2 MiB and advise transparent huge pages for them, where the
kernel allows them (``madvise`` mode or ``always``): one fault per 2 MiB instead of 512. The same
update, one after the other on a quiet 2-core CPU: 205 s and 54.7M faults without, 144 s and
5.2M faults with, resident peak 3.38 and 3.37 GiB. A user's own ``THP_MEM_ALLOC_ENABLE`` is kept.

Faster still, at nearly the same peak: mimalloc (the ``cmeel-mimalloc`` wheel, 0.5 MB) in place of glibc's malloc.
It keeps freed pages for reuse a while (``purge_delay``, 1 s) and fragments less than glibc's arenas, so it needs
neither the threshold nor fresh mappings. The ``localrl`` command re-executes itself once with it preloaded
(``preload_allocator``: a process's allocator cannot change once it runs), and hands its free pages back at each
phase's edge (``collect``). The same SmolLM2-shape update: 124 s against 151 s, resident peak 3.48 against 3.38
GiB; ``bench grpo-step``'s localrl step (4-bit, P=1000, R=100, G=8), interleaved: 4.25-4.76 s against 5.04-5.48 s
(glibc's defaults: 4.80-5.73 s, peak 1.04-1.07 GB against 0.90 GB). ``LOCALRL_ALLOCATOR=glibc`` keeps glibc's
malloc, with the threshold; so does a process that imports localrl rather than running the command.

mimalloc runs without transparent huge pages (``MIMALLOC_ALLOW_THP=0``, unless the user set it): with the kernel's
``defrag`` at ``madvise`` (the usual setting), a fault in a region advised for huge pages may compact memory before it
returns, and mimalloc's freed pages are faulted in again. On a 2-core Xeon with AMX (2026-12-07), one GRPO step of
SmolLM2-135M's shape in bfloat16 (``bench utilisation``): completion forward 3.10 s with huge pages against 1.05 s
without, the whole step 12.2 against 9.8 s, resident peak 2.94 against 2.91 GB (glibc's defaults: 0.85 s, 9.5 s).
mimalloc applies that option as a ``prctl`` the whole process and its children inherit, so the re-executed
process allows huge pages again at once where it had them before (mimalloc, having advised nothing, stays off them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import sys
from contextlib import contextmanager

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20
REUSE_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its adaptive threshold
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's own switch (c10/core/impl/alloc_cpu.cpp)
ALLOCATOR_ENV = "LOCALRL_ALLOCATOR"  # "glibc": keep the C library's malloc
PRELOADED_ENV = "LOCALRL_PRELOADED"  # in the re-executed process only: the LD_PRELOAD it had before ("" none)
MIMALLOC_THP_ENV = "MIMALLOC_ALLOW_THP"  # mimalloc's own option, read when it starts
THP_SET_ENV = "LOCALRL_SET_MIMALLOC_THP"  # in the re-executed process only: localrl, not the user, set the option
# ("1": huge pages were allowed before, so allow them again; "0": they were off already, for the process and its parent)
PR_SET_THP_DISABLE, PR_GET_THP_DISABLE = 41, 42  # prctl(2)

_done = False
_libc = None  # glibc, once it took the threshold
_mimalloc = None  # mimalloc, when this process runs on it


def mimalloc_library() -> str | None:
    """The mimalloc shared library the ``cmeel-mimalloc`` wheel installed, if it did."""
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(str(f.locate()) for f in files if f.name.startswith("libmimalloc.so"))
    return next((path for path in found if os.path.isfile(path)), None)


def running_on_mimalloc() -> bool:
    try:
        ctypes.CDLL(None).mi_collect  # noqa: B018 - resolvable only where mimalloc was loaded into the process
    except AttributeError:
        return False
    return True


def preload_allocator() -> None:
    """For the ``localrl`` command, before anything else: run this process again, once, with mimalloc preloaded
    (same pid, arguments and environment). Nothing happens under ``LOCALRL_ALLOCATOR=glibc``, where the wheel is
    missing, or in the process that was re-executed, which takes the preload out of its environment again so the
    programs it starts (llama.cpp's server, the sandbox, git) run on their own allocator."""
    if PRELOADED_ENV in os.environ:
        before = os.environ.pop(PRELOADED_ENV)
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        if THP_SET_ENV in os.environ:
            os.environ.pop(MIMALLOC_THP_ENV, None)
            if os.environ.pop(THP_SET_ENV) == "1":
                _huge_pages(allow=True)
        return
    choice = os.environ.get(ALLOCATOR_ENV, "mimalloc")
    if choice not in ("mimalloc", "glibc"):
        print(f"localrl: warning: {ALLOCATOR_ENV}={choice!r} is neither mimalloc nor glibc; running on glibc's malloc",
              file=sys.stderr)
    if choice != "mimalloc" or running_on_mimalloc():
        return
    library = mimalloc_library()
    if library is None or not getattr(sys, "orig_argv", None) or any(c in library for c in " :"):
        return  # (LD_PRELOAD splits its list at spaces and colons)
    before = os.environ.get("LD_PRELOAD", "")
    env = {**os.environ, "LD_PRELOAD": f"{library} {before}".strip(), PRELOADED_ENV: before}
    if MIMALLOC_THP_ENV not in os.environ:
        env |= {MIMALLOC_THP_ENV: "0", THP_SET_ENV: "1" if _huge_pages() else "0"}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:  # then glibc's malloc, with the threshold
        pass


def _huge_pages(allow: bool = False) -> bool:
    """Whether this process may have transparent huge pages (its ``prctl`` flag, which children inherit);
    ``allow=True`` first undoes ``MIMALLOC_ALLOW_THP=0``'s ``prctl``: the kernel's own policy again, for this
    process's other allocations and for the programs it starts. False where there is no such flag."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        if allow:
            prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0)
        return prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def return_freed_memory() -> bool:
    """Make freed tensor memory leave the process (once a process, before torch's first CPU tensor): on mimalloc,
    at each ``collect``; on glibc, at once (the 1 MiB threshold), with large tensors faulted in on huge pages.
    Whether either took."""
    global _done, _libc, _mimalloc
    if _done:
        return True
    if running_on_mimalloc():
        _done, _mimalloc = True, ctypes.CDLL(None)
        return True
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.malloc_trim:
            _done, _libc = True, libc
    except (OSError, AttributeError):  # not glibc
        pass
    return _done


def collect() -> None:
    """At a phase's edge (and before a phase's resident growth is measured): hand the allocator's free pages back
    to the operating system now (mimalloc would keep them a second for reuse; glibc's heap keeps what lies below
    its top)."""
    if _mimalloc is not None or running_on_mimalloc():
        ctypes.CDLL(None).mi_collect(True)
        return
    libc = _libc
    try:
        libc = libc or ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextmanager
def reusing_heap():
    """Within: blocks under 32 MiB come from the heap and are reused, as under glibc's defaults; on leaving, the
    1 MiB threshold again and the heap's free pages handed back (``malloc_trim``). For decoding, which allocates
    the same sizes token after token, so that its free blocks fit again and the heap does not fragment: each
    token's fresh mappings cost the rollout at the bench grpo-step shape (4-bit, P=1000, R=100, G=8) 5.78 s
    against 3.96 s this way, resident peak 568 against 574 MiB, the same resident set after it. On mimalloc,
    which reuses blocks anyway, the phase before's free pages are handed back on entering and the rollout's on
    leaving. Where neither was set up (not a CLI process), nothing changes."""
    if _mimalloc is not None:
        collect()
        try:
            yield
        finally:
            collect()
        return
    libc = _libc
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, REUSE_THRESHOLD_BYTES)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.malloc_trim(0)
