"""model/memory_pool.MemoryPool hands out memory again only when no array, view, tensor or
buffer export refers to what it handed out before, and the build's pools leave the packages as
they were (tests/test_build.py has the build side)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ane_spec.model import memory_pool
from ane_spec.model.memory_pool import MemoryPool

MB = 1 << 20


def _shares(a: np.ndarray, b: np.ndarray) -> bool:
    return np.shares_memory(a, b)


@pytest.mark.parametrize("holder", ["array", "view", "view-of-view", "tensor", "memoryview",
                                    "reshaped"])
def test_memory_is_not_reused_while_anything_refers_to_it(holder: str) -> None:
    pool = MemoryPool()
    a = pool.empty((4, MB), np.int8)
    a[:] = 7
    held = {"array": lambda: a, "view": lambda: a[1:3], "view-of-view": lambda: a[1:3][:, 5:],
            "tensor": lambda: torch.from_numpy(a), "memoryview": lambda: memoryview(a),
            "reshaped": lambda: a.reshape(-1)}[holder]()
    del a
    b = pool.empty((4, MB), np.int8)
    b[:] = 1
    assert np.asarray(held).min() == 7   # untouched by the second hand-out
    assert pool.pooled_bytes() == 8 * MB
    del held
    c = pool.empty((4, MB), np.int8)
    assert pool.pooled_bytes() == 8 * MB and not _shares(c, b)   # the first buffer, again


def test_the_smallest_free_buffer_that_holds_it_is_taken() -> None:
    pool = MemoryPool()
    big, small = pool.empty((8, MB), np.uint8), pool.empty((2, MB), np.uint8)
    big_at, small_at = big.__array_interface__["data"][0], small.__array_interface__["data"][0]
    del big, small
    again = pool.empty((MB,), np.float16)   # 2 MB: the small one
    assert again.__array_interface__["data"][0] == small_at
    wider = pool.empty((3, MB), np.uint8)   # over the small one's size: the big one
    assert wider.__array_interface__["data"][0] == big_at
    assert pool.pooled_bytes() == 10 * MB
    assert again.dtype == np.float16 and again.shape == (MB,) and again.flags.writeable


def test_small_arrays_are_not_pooled() -> None:
    pool = MemoryPool()
    a = pool.empty((memory_pool.MIN_POOLED_BYTES // 4 - 1,), np.float32)
    assert pool.pooled_bytes() == 0 and a.flags.owndata


def test_trim_drops_only_free_buffers() -> None:
    pool = MemoryPool()
    kept = pool.empty((2, MB), np.int8)
    pool.empty((3, MB), np.int8)   # dropped at once
    pool.trim()
    assert pool.pooled_bytes() == 2 * MB
    kept[:] = 3
    assert pool.empty((2, MB), np.int8) is not None and pool.pooled_bytes() == 4 * MB


def test_threads_never_get_memory_another_still_holds() -> None:
    pool = MemoryPool()
    errors: list[str] = []

    def work(k: int) -> None:
        for _ in range(40):
            a = pool.empty((MB,), np.int8)
            a[:] = k
            for _ in range(3):   # another thread writing into it would show here
                if not (a == k).all():
                    errors.append(f"thread {k}: its array changed under it")
            del a

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.pooled_bytes() <= 4 * MB   # and reused: at most one buffer per thread
