"""averaging.allreduce.buffers: large float32 buffers come back to a pool when their last view dies
and are reused from there, never while anything still views them."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch

import averaging.allreduce.buffers as buffers
from averaging.allreduce.buffers import clear_pool, empty_float32, pooled_bytes

MIB = 1024 * 1024
LARGE = 3 * MIB // 4  # elements: 3 MiB, pooled


@pytest.fixture(autouse=True)
def _empty_pool() -> Iterator[None]:
    gc.collect()
    clear_pool()
    yield
    gc.collect()
    clear_pool()


def test_small_buffers_are_plain_tensors_and_large_ones_float32_views() -> None:
    small = empty_float32(1000)
    assert small.shape == (1000,) and small.dtype == torch.float32
    large = empty_float32(LARGE + 5)  # rounded up to 4 MiB behind the scenes
    assert large.shape == (LARGE + 5,) and large.dtype == torch.float32
    assert large.is_contiguous()
    large.fill_(2.0)
    assert float(large.sum()) == 2.0 * (LARGE + 5)
    del small, large
    gc.collect()
    assert pooled_bytes() == 4 * MIB


def test_a_buffer_is_reused_only_after_its_last_view_died() -> None:
    first = empty_float32(LARGE)
    address = first.data_ptr()
    view = first[10:20]
    del first
    gc.collect()
    assert pooled_bytes() == 0  # the view still holds it
    second = empty_float32(LARGE)
    assert second.data_ptr() != address
    second.fill_(7.0)
    view.fill_(1.0)
    assert float(second.sum()) == 7.0 * LARGE  # no sharing
    del view
    gc.collect()
    assert pooled_bytes() == 3 * MIB
    third = empty_float32(LARGE - 100)  # the same rounded size
    assert third.data_ptr() == address
    assert pooled_bytes() == 0


def test_the_pool_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "MAX_POOLED_BYTES", 10 * MIB)
    held = [empty_float32(LARGE) for _ in range(6)]
    del held
    gc.collect()
    assert pooled_bytes() == 3 * 3 * MIB  # at most 10 MiB: three of 3 MiB
    held = [empty_float32(MIB // 4) for _ in range(6)]  # 1 MiB each: room for one
    del held
    gc.collect()
    assert pooled_bytes() == 10 * MIB
    monkeypatch.setattr(buffers, "MAX_POOLED_BYTES", 512 * MIB)
    held = [empty_float32(MIB // 4) for _ in range(8)]
    del held
    gc.collect()
    assert pooled_bytes() == 9 * MIB + buffers.MAX_POOLED_PER_SIZE * MIB


def test_buffers_dropped_in_other_threads_come_back() -> None:
    tensors = [empty_float32(LARGE) for _ in range(4)]
    addresses = {t.data_ptr() for t in tensors}

    def drop(tensor: list[torch.Tensor]) -> None:
        tensor.clear()

    threads = [threading.Thread(target=drop, args=([t],)) for t in tensors]
    del tensors
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    gc.collect()
    assert pooled_bytes() == 4 * 3 * MIB
    again = [empty_float32(LARGE) for _ in range(4)]
    assert {t.data_ptr() for t in again} == addresses
