import os
import threading

import pytest
import torch
from torch import nn

from hf_cpt.numerics import scratch

from .helpers import mapped_alone


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


def _mapping(pointer: int) -> tuple[int, dict[str, str]]:
    """(the start address, the fields) of the /proc/self/smaps entry for the mapping that holds address ``pointer``."""
    start, fields = None, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if start is not None:
                    break
                low, high = (int(part, 16) for part in head.split("-"))
                start = low if low <= pointer < high else None
            elif start is not None:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    if start is None:
        raise AssertionError("no mapping holds the buffer")
    return start, fields


def _mapping_field(pointer: int, field: str) -> str:
    """A field of /proc/self/smaps for the mapping that holds address ``pointer``."""
    return _mapping(pointer)[1][field]


def _resident_kib(pointer: int) -> int:
    return int(_mapping_field(pointer, "Rss").split()[0])


def _resident_kib_of(*pointers: int) -> int:
    """Resident KiB of the mappings that hold ``pointers``, each counted once (the kernel merges adjacent anonymous
    mappings of the same flags into one area, whichever thread made them)."""
    areas = dict(_mapping(pointer) for pointer in pointers)
    return sum(int(fields["Rss"].split()[0]) for fields in areas.values())


@pytest.mark.skipif(not scratch.huge_pages(), reason="needs transparent huge pages (Linux)")
def test_handed_back_buffers_leave_the_resident_set_read_as_zeros_and_serve_again():
    error = scratch.take("error", (1024, 1024), torch.float32)
    kept = scratch.take("input", (1024, 1024), torch.float32)
    assert "hg" in _mapping_field(error.data_ptr(), "VmFlags").split()  # asked for huge pages
    error.fill_(1.0)
    kept.fill_(1.0)
    others = []
    thread = threading.Thread(target=lambda: others.append(scratch.take("error", (1024, 1024), torch.float32)))
    thread.start()
    thread.join()
    others[0].fill_(2.0)  # another thread's buffer: not this thread's to hand back
    pointers = (error.data_ptr(), kept.data_ptr(), others[0].data_ptr())
    before = _resident_kib_of(*pointers)
    assert before >= 3 * 4096 - 64
    scratch.hand_back()
    after = _resident_kib_of(*pointers)
    assert before - after >= 2 * 4096 - 64  # both roles' pages went (KiB; the mappings' own pages aside)
    assert after >= 4096 - 64  # the other thread's stayed
    assert error.eq(0.0).all() and kept.eq(0.0).all()
    assert others[0].eq(2.0).all()
    again = scratch.take("error", (1024, 1024), torch.float32)
    assert again.data_ptr() == error.data_ptr()  # the same buffer, paged in again when written
    again.fill_(3.0)
    assert again.sum().item() == 3 * 1024 * 1024 and _resident_kib(again.data_ptr()) >= 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_without_huge_pages_the_buffers_stay_resident(monkeypatch):
    monkeypatch.setattr(scratch, "huge_pages", lambda: False)
    buffer = scratch.take("error", (1024, 1024), torch.float32)
    buffer.fill_(1.0)
    before = _resident_kib(buffer.data_ptr())
    scratch.hand_back()
    assert _resident_kib(buffer.data_ptr()) >= before >= 4096 and buffer.eq(1.0).all()


def test_hand_back_if_idle_hands_back_once_per_mark_on_the_marking_thread(monkeypatch):
    handed_back = []
    hand_back = scratch.hand_back
    monkeypatch.setattr(scratch, "hand_back", lambda: handed_back.append(1) or hand_back())
    scratch.take("error", (64, 64), torch.float32).fill_(1.0)
    assert scratch.hand_back_if_idle() is False and handed_back == []  # never marked
    scratch.mark_idle()
    thread = threading.Thread(target=lambda: handed_back.append(scratch.hand_back_if_idle()))
    thread.start()
    thread.join()
    assert handed_back == [False]  # another thread's mark is not this one's
    assert scratch.hand_back_if_idle() is True and scratch.hand_back_if_idle() is False
    assert handed_back == [False, 1]
    scratch.mark_idle()
    hand_back()  # a hand-back by other means clears the mark, as does `release`
    assert scratch.hand_back_if_idle() is False
    scratch.mark_idle()
    scratch.release()
    assert scratch.hand_back_if_idle() is False and handed_back == [False, 1]


def test_holds_tells_a_buffers_tensor_from_any_other():
    taken = scratch.take("input", (64, 64), torch.float32)
    assert scratch.holds(taken) and scratch.holds(taken[10:])  # a view inside it too
    assert not scratch.holds(torch.empty(64, 64)) and not scratch.holds(taken.clone())


def _advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping that starts at ``t``'s memory was advised to use transparent huge pages (its VmFlags)."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    def holds(line: str) -> bool:  # a mapping's first line: "start-end perms ..."; the kernel may merge neighbours
        bounds = line.split()[0].split("-") if line and not line.endswith(":") and "-" in line.split()[0] else None
        return bounds is not None and int(bounds[0], 16) <= t.data_ptr() < int(bounds[1], 16)

    start = next(i for i, line in enumerate(lines) if holds(line))
    flags = next(line for line in lines[start + 1:] if line.startswith("VmFlags:"))
    return "hg" in flags.split()


def _mapped_at(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        return any(int(start, 16) <= address < int(end, 16)
                   for start, end in (line.split()[0].split("-") for line in maps))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_a_large_kept_tensor_has_a_mapping_of_its_own_where_asked_unmapped_when_freed(monkeypatch):
    monkeypatch.delenv(scratch.OWN_MAPPING_VARIABLE, raising=False)
    assert not mapped_alone(scratch.kept((2048, 768), torch.uint8))  # by default: torch's allocator
    size = scratch.SUGGESTED_OWN_MAPPING_BYTES
    monkeypatch.setenv(scratch.OWN_MAPPING_VARIABLE, str(size))
    large = scratch.kept((2048, 768), torch.uint8)  # 1.5 MiB: a BERT-base layer's input codes at 2048 tokens
    assert large.shape == (2048, 768) and large.dtype == torch.uint8 and large.is_contiguous()
    assert mapped_alone(large) and not scratch.holds(large)
    assert not _advised_huge(large)  # 4 KiB pages: a fresh mapping in every step (the reused buffers' are huge)
    if scratch.huge_pages():
        assert _advised_huge(scratch.take("input", (1 << 22,), torch.float32))
    large.fill_(7)
    assert int(large.sum()) == 7 * 2048 * 768
    address = large.data_ptr()
    del large
    assert not _mapped_at(address)  # back to the system with the tensor
    small = scratch.kept((size - 1,), torch.uint8)
    assert not mapped_alone(small)  # torch's allocator
    assert mapped_alone(scratch.kept((size // 4,), torch.float32))  # counted in bytes


def test_the_environment_sets_the_size_of_own_mappings_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(scratch.OWN_MAPPING_VARIABLE, "0")
    assert scratch.own_mapping_bytes() == 0
    if os.path.exists("/proc/self/maps"):
        assert not mapped_alone(scratch.kept((1 << 22,), torch.uint8))  # none: torch's allocator serves all
    monkeypatch.setenv(scratch.OWN_MAPPING_VARIABLE, "4096")
    assert scratch.own_mapping_bytes() == 4096
    for bad in ("a lot", "-1"):
        monkeypatch.setenv(scratch.OWN_MAPPING_VARIABLE, bad)
        with pytest.raises(ValueError, match=scratch.OWN_MAPPING_VARIABLE):
            scratch.own_mapping_bytes()


def test_a_refused_mapping_falls_back_to_torchs_allocator(monkeypatch):
    monkeypatch.setenv(scratch.OWN_MAPPING_VARIABLE, "4096")

    def refused(numel, dtype, huge=True):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(scratch, "_mapped", refused)
    t = scratch.kept((1 << 20,), torch.uint8)
    assert t.shape == (1 << 20,) and t.dtype == torch.uint8 and t.is_contiguous()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_a_handed_on_block_has_a_mapping_of_its_own_that_waits_for_the_next_of_its_size_once_freed():
    large = scratch.handed_on((256, 1024), torch.float32)  # 1 MiB
    assert large.shape == (256, 1024) and large.dtype == torch.float32 and large.is_contiguous()
    assert large._base is None  # not a view: an autograd function may return it, a caller edit it in place
    assert mapped_alone(large) and not scratch.holds(large)
    assert not _advised_huge(large)  # 4 KiB pages, like the kept codes'
    large.fill_(2.0)
    assert float(large.sum()) == 2.0 * 256 * 1024
    address = large.data_ptr()
    view = large[3:]
    del large
    assert scratch.idle_block_bytes() == 0  # a view holds the block
    del view
    assert _mapped_at(address) and scratch.idle_block_bytes() == 1 << 20  # idle, resident, for the next of its size
    again = scratch.handed_on((1024, 256), torch.float32)
    assert again.data_ptr() == address and scratch.idle_block_bytes() == 0
    other = scratch.handed_on((512, 512), torch.float32)
    other_address = other.data_ptr()
    del again, other  # one idle block per size: the second freed goes back to the system
    assert scratch.idle_block_bytes() == 1 << 20 and _mapped_at(address) != _mapped_at(other_address)
    scratch.release_idle_blocks()
    assert scratch.idle_block_bytes() == 0 and not _mapped_at(address) and not _mapped_at(other_address)
    sizes = [(1 << 20) + 4096 * i for i in range(scratch.IDLE_SIZES + 3)]  # shapes that change from batch to batch
    for size in sizes:
        scratch.handed_on((size,), torch.uint8)  # freed at once
    assert scratch.idle_block_bytes() == sum(sizes[-scratch.IDLE_SIZES:])  # the sizes freed last
    scratch.release_idle_blocks()
    assert not mapped_alone(scratch.handed_on((scratch.HANDED_ON_MAPPING_BYTES // 4 - 1,), torch.float32))
    assert mapped_alone(scratch.handed_on((scratch.HANDED_ON_MAPPING_BYTES // 2,), torch.bfloat16))  # in bytes


def _freed_in_a_backward(blocks: list) -> None:
    """Drop ``blocks``' references while a backward runs (in a hook on one of its gradients)."""
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: blocks.clear())
    y.sum().backward()
    assert not blocks


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_an_owner_whose_block_outlived_its_forward_gets_the_next_from_the_heap_until_one_is_freed_within_it():
    owner = nn.Linear(1, 1)  # the module making the blocks
    shape = (256, 1024)  # 1 MiB
    first = scratch.handed_on(shape, torch.float32, owner)
    assert mapped_alone(first)
    del first  # freed within the pass that made it: the next one is mapped too
    held = [scratch.handed_on(shape, torch.float32, owner)]
    assert mapped_alone(held[0])
    other = scratch.handed_on(shape, torch.float32, nn.Linear(1, 1))  # another owner learns on its own
    _freed_in_a_backward(held)  # kept for a backward: the next one comes from the heap
    held = [scratch.handed_on(shape, torch.float32, owner)]
    assert not mapped_alone(held[0]) and held[0].is_contiguous() and held[0].shape == shape
    held[0].fill_(3.0)  # its memory is its own: written and read back whole
    assert held[0].sum().item() == 3.0 * held[0].numel()
    assert mapped_alone(other) and mapped_alone(scratch.handed_on(shape, torch.float32))  # no owner: mapped
    _freed_in_a_backward(held)  # a heap block is watched the same way
    assert not mapped_alone(scratch.handed_on(shape, torch.float32, owner))  # freed at once, outside a backward:
    assert mapped_alone(scratch.handed_on(shape, torch.float32, owner))  # the one after it is mapped again


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_a_block_made_in_a_backward_teaches_its_owner_nothing():
    owner = nn.Linear(1, 1)
    made = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: made.append(scratch.handed_on((256, 1024), torch.float32, owner)))
    y.sum().backward()
    _freed_in_a_backward(made)  # a gradient made in a backward and freed in one is not kept across a pass
    assert mapped_alone(scratch.handed_on((256, 1024), torch.float32, owner))
