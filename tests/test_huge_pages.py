"""CPU tensors on 2 MB pages (engine/huge_pages.py): zeros, aligned, advised to the kernel."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from specplan.engine import ModelConfig
from specplan.engine.model.huge_pages import HUGE_PAGE, huge_page_zeros
from specplan.engine.model_runner import allocate_kv_cache


def _smaps_field(address: int, field: str) -> list[str]:
    """A field (e.g. "VmFlags:", "Rss:") of the mapping of this process that holds ``address``
    (/proc/self/smaps), split into words."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == field:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps_field(address, "VmFlags:")


def test_huge_page_zeros_is_zero_aligned_and_writable():
    t = huge_page_zeros((3, 1000, 7), torch.float32)
    assert t.shape == (3, 1000, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(t) == 0
    t[2, 999, 6] = 5.0
    assert t.sum() == 5.0
    assert huge_page_zeros((4,), torch.float64).tolist() == [0.0] * 4


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="transparent huge pages are a Linux feature")
def test_huge_page_zeros_is_advised_to_huge_pages():
    t = huge_page_zeros((HUGE_PAGE // 4,), torch.float32)
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE, whether or not the OS found free 2 MB pages
    assert "hg" not in _vm_flags(torch.zeros(HUGE_PAGE // 4).data_ptr())


def test_cpu_kv_cache_sits_on_huge_pages():
    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=128,
                         tie_word_embeddings=True, qkv_bias=False, rope_inv_freq=(1.0,) * 4)
    kv = allocate_kv_cache(config, 5, 16, torch.float32, torch.device("cpu"))
    assert kv.shape == (2, 2, 5, 16, 2, 8) and kv.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(kv) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_huge_page_zeros_are_resident_before_first_use():
    """Every page is faulted in when the tensor is made: a first touch inside a serving step cost
    2-5 ms per 2 MB page here."""
    nbytes = 8 * HUGE_PAGE
    t = huge_page_zeros((nbytes // 4,), torch.float32)
    rss_kb = int(_smaps_field(t.data_ptr(), "Rss:")[0])
    assert rss_kb * 1024 >= nbytes  # untouched anonymous memory would read 0 kB
