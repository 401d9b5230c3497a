"""CPU tensors backed by 2 MB pages (Linux transparent huge pages) for what every step streams:
the packed weights and the KV cache.

Why: a decode step reads each weight once and, at larger batches, as many bytes of KV cache again
(B=32 at context 256: 400 MB over 30 layers beside 538 MB of weights). With 4 KB pages that is a
page walk every 4 KB, and the hardware prefetcher stops at every page boundary. This machine's
kernel only gives huge pages to memory that asks for them (THP "madvise"), so ask. Where it
cannot (no MADV_HUGEPAGE, THP off) the tensor is plain anonymous memory and nothing else changes.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes in one x86-64 / aarch64 transparent huge page


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor starting on a 2 MB boundary, advised to huge pages."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # Private, not shared, anonymous memory (zero-filled by the OS): THP for shared memory follows
    # another setting.
    arena = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so page faults take 2 MB pages
        except OSError:
            pass  # THP not built into this kernel: 4 KB pages, as torch.zeros would give
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[start:start + nbytes]
    # Fault every page in now (one written byte per 4 KB page), not inside a serving step: the
    # first touch of a 2 MB page costs milliseconds, so a decode step that crossed into new pages
    # of the KV cache spent many times its usual K/V write time; faulting everything up front is
    # paid once, at startup (measured: reports/README.md#engine-measurements).
    tensor[::4096].zero_()
    return tensor.view(dtype).view(shape)
