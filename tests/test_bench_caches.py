import pytest

from specplan.bench.caches import CacheSweep


def test_cache_sweep_reads_its_buffer_and_refuses_a_negative_size():
    sweep = CacheSweep(1)
    assert sweep._buffer is not None and sweep._buffer.nbytes == 2**20
    sweep.sweep()
    CacheSweep(0).sweep()  # nothing to read
    with pytest.raises(ValueError, match="mib"):
        CacheSweep(-1)
