import mmap
import os
import threading

import pytest
import torch

from hf_cpt.numerics import scratch


@pytest.fixture(autouse=True)
def _fresh_buffers():
    scratch.release()
    yield
    scratch.release()


def test_a_role_reuses_its_buffer_and_grows_it_when_a_larger_tensor_is_asked_for():
    first = scratch.take("input", (4, 6), torch.float32)
    assert first.shape == (4, 6) and first.dtype == torch.float32 and first.is_contiguous()
    smaller = scratch.take("input", (3, 5), torch.float32)
    assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (3, 5)
    assert scratch.held_bytes() == 24 * 4
    larger = scratch.take("input", (10, 10), torch.float32)
    assert larger.shape == (10, 10) and scratch.held_bytes() == 100 * 4  # the smaller buffer was dropped
    other_role = scratch.take("error", (10, 10), torch.float32)
    other_dtype = scratch.take("input", (10, 10), torch.float64)
    pointers = {larger.data_ptr(), other_role.data_ptr(), other_dtype.data_ptr()}
    assert len(pointers) == 3 and scratch.held_bytes() == 100 * 4 * 2 + 100 * 8
    scratch.release()
    assert scratch.held_bytes() == 0


def test_each_thread_has_its_own_buffers():
    mine = scratch.take("input", (8,), torch.float32)
    theirs = {}

    def other() -> None:
        theirs["pointer"] = scratch.take("input", (8,), torch.float32).data_ptr()
        theirs["held"] = scratch.held_bytes()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert theirs["pointer"] != mine.data_ptr() and theirs["held"] == 32


def test_a_buffer_first_taken_under_inference_mode_serves_training():
    with torch.inference_mode():
        buffer = scratch.take("input", (5,), torch.float32)
    assert not buffer.is_inference()
    buffer.fill_(1.0)  # written outside inference mode, as a backward writes it
    assert buffer.sum().item() == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_its_own_copy_of_the_pages():
    buffer = scratch.take("input", (4,), torch.float32)
    buffer.fill_(2.0)
    child = os.fork()
    if child == 0:  # a DataLoader worker, say: its writes must not reach the parent's buffer
        buffer[0] = 5.0
        os._exit(0)
    os.waitpid(child, 0)
    assert buffer.tolist() == [2.0, 2.0, 2.0, 2.0]


def _resident_kib(pointer: int) -> int:
    """Resident KiB of the mapping that holds address ``pointer`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= pointer < high
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the buffer")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_role_handed_back_leaves_the_resident_set_and_serves_again_from_another_thread():
    error = scratch.take("error", (1024, 1024), torch.float32)
    kept = scratch.take("input", (1024, 1024), torch.float32)
    error.fill_(1.0)
    kept.fill_(1.0)
    before = _resident_kib(error.data_ptr())  # the kernel may merge the two mappings into one area
    assert before >= 4096
    hand_back = scratch.hand_back_later("error")
    thread = threading.Thread(target=hand_back)  # the engine may run a backward's end callbacks on another thread
    thread.start()
    thread.join()
    assert before - _resident_kib(error.data_ptr()) >= 4096 and _resident_kib(kept.data_ptr()) >= 4096
    assert kept.sum().item() == 1024 * 1024  # only that role's pages went
    again = scratch.take("error", (1024, 1024), torch.float32)
    assert again.data_ptr() == error.data_ptr()  # the same buffer, paged in again when written
    again.fill_(3.0)
    assert again.sum().item() == 3 * 1024 * 1024 and _resident_kib(again.data_ptr()) >= before


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_hand_back_keeps_the_first_bytes_asked_for_rounded_up_to_a_page():
    error = scratch.take("error", (1024, 1024), torch.float32)
    error.fill_(1.0)
    before = _resident_kib(error.data_ptr())
    keep = 1024 * 1024 + 1  # one byte into the next page: that page stays too
    scratch.hand_back_later("error", keep)()
    page = mmap.PAGESIZE
    kept_values = -(-keep // page) * page // 4
    handed_back = (4 * 1024 * 1024 - kept_values * 4) // 1024
    assert abs(before - _resident_kib(error.data_ptr()) - handed_back) <= 8  # KiB; the mapping's own pages aside
    flat = error.flatten()
    assert flat[:kept_values].eq(1.0).all() and flat[kept_values:].eq(0.0).all()  # the rest reads as zeros
    scratch.hand_back_later("error", 8 * 1024 * 1024)()  # more than the buffer holds: nothing to hand back
    assert flat[:kept_values].eq(1.0).all()
