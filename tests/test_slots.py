"""The slot sizes of the DDP hook's one collective per bucket (deepreduce.collective.slots): a slot
grows past an overflowing payload with slack, keeps its size while payloads fit, shrinks when
far too large; headers round-trip; disagreeing headers raise the same clear error; the exchange
(NumPy arrays, ranks simulated by threads) gives every rank every payload, in one gather once the
slot fits."""
import threading

import numpy as np
import pytest
from conftest import run_threads

from deepreduce.collective import agreement, slots
from deepreduce.errors import CommunicationError


def test_a_slot_grows_on_overflow_and_then_holds():
    s = slots.Slots()
    assert s.capacity(0) == 0
    assert s.settle(0, np.array([1000, 900])) == 1000          # nothing fitted: the whole payload is the rest
    grown = s.capacity(0)
    assert grown >= 1000 * (1 + slots.SLACK) and grown % slots.ALIGN == 0
    assert s.settle(0, np.array([grown, grown // 2])) == 0     # fits: no second collective, same size
    assert s.capacity(0) == grown
    assert s.settle(0, np.array([grown + 5, 0])) == 5          # only the bytes beyond the slot travel again
    assert s.capacity(0) > grown
    assert s.capacity(1) == 0                                   # another bucket position has its own slot


def test_a_slot_far_too_large_shrinks():
    s = slots.Slots()
    s.settle(0, np.array([100_000]))
    large = s.capacity(0)
    assert s.settle(0, np.array([int(large * slots.SHRINK_BELOW) - 1])) == 0
    assert s.capacity(0) < large


def layout(name="w", compressor=("topk", "00" * 8)):
    return agreement.Layout(compressor, [(name, (4, 4), "float32")], "parameter")


def test_headers_round_trip_and_disagreements_are_named():
    mine = slots.prefix(123, layout(), 7)
    assert mine.dtype == np.uint8 and mine.shape == (slots.PREFIX_BYTES,)
    headers = slots.parse(np.stack([mine, slots.prefix(45, layout(), 7)]))
    assert headers[:, 0].tolist() == [123, 45] and headers[:, 3].tolist() == [7, 7]
    slots.check(headers, "bucket", lambda: "never asked")
    slots.check_step(headers, "bucket")
    other = slots.parse(np.stack([mine, slots.prefix(123, layout("v"), 7)]))
    with pytest.raises(CommunicationError, match="bucket: rank 1 has parameter 'v'"):
        slots.check(other, "bucket", lambda: "rank 1 has parameter 'v'")
    late = slots.parse(np.stack([mine, slots.prefix(123, layout(), 8)]))
    with pytest.raises(CommunicationError, match="step counter"):
        slots.check_step(late, "bucket")
    with pytest.raises(CommunicationError, match="codes of different sizes"):
        slots.check_step(headers, "bucket", "FP16Compressor()")
    failed = slots.parse(np.stack([mine, slots.prefix(slots.FAILED, layout(), 7)]))
    with pytest.raises(CommunicationError, match=r"rank\(s\) \[1\] could not encode"):
        slots.check_step(failed, "bucket", "FP16Compressor()")


def test_a_payload_of_steady_size_gets_an_exact_slot():
    """A codec whose output size is fixed by the tensor's size (QSGD of every entry) pays no slack
    from the third step on; a size that moves again regrows the slot with slack."""
    s = slots.Slots()
    assert s.settle(0, np.array([1000, 1000])) == 1000
    assert s.capacity(0) >= 1000 * (1 + slots.SLACK)
    assert s.settle(0, np.array([1000, 1000])) == 0
    assert s.capacity(0) == 1024                               # 1000 rounded up to ALIGN, no slack
    assert s.settle(0, np.array([1000, 990])) == 0
    assert s.capacity(0) == 1024
    assert s.settle(0, np.array([1100, 990])) == 76            # grew: the rest travels, the slot regrows
    assert s.capacity(0) >= 1100 * (1 + slots.SLACK)


def test_sizes_that_vary_keep_the_slack():
    s = slots.Slots()
    for longest in (1000, 1010, 995, 1005):
        s.settle(0, np.array([longest, 900]))
    assert s.capacity(0) >= 1010 * (1 + slots.SLACK) - slots.ALIGN


class Ranks:
    """An allgather among threads, one per simulated rank (each call returns every rank's array)."""

    def __init__(self, world: int) -> None:
        self.barrier, self.arrays, self.calls = threading.Barrier(world), [None] * world, 0

    def gather(self, rank: int):
        def allgather(array):
            self.arrays[rank] = array.copy()
            self.barrier.wait()
            out = list(self.arrays)
            if rank == 0:
                self.calls += 1
            self.barrier.wait()
            return out
        return allgather


def test_the_exchange_gathers_every_payload_in_one_collective_once_the_slot_fits():
    sizes = [[300, 700], [500, 200], [650, 90]]   # per step, per rank: the slot grows at step 0, then holds
    ranks, results = Ranks(2), {}

    def rank(r):
        s, out = slots.Slots(), []
        for step, sizes_now in enumerate(sizes):
            payload = np.full(sizes_now[r], r + 1, dtype=np.uint8)
            before = ranks.calls
            headers, parts = s.exchange(0, slots.prefix(len(payload), layout(), step), payload, ranks.gather(r),
                                        payload, "bucket", lambda: "never asked")
            out.append((headers[:, 0].tolist(), [p.tolist() for p in parts], ranks.calls - before))
        results[r] = out

    run_threads(rank, [(0,), (1,)], 30)
    assert results[0] == results[1]
    for (reported, parts, _), sizes_now in zip(results[0], sizes):
        assert reported == sizes_now
        assert parts == [[1] * sizes_now[0], [2] * sizes_now[1]]
    assert [calls for _, _, calls in results[0]] == [2, 1, 1]


def test_summed_payloads_flag_whatever_differs_from_the_agreement():
    s, codes = slots.Slots(), ("layout digest", 64, "float16")
    assert s.agreed(0) is None                          # nothing agreed: the header goes first
    s.agree(0, codes, 3)
    assert s.agreed(0) == codes and s.agreed(1) is None
    assert s.flag(0, codes, 4) == 0                     # what was agreed, one step later: one collective
    assert s.flag(0, codes, 6) == 1                     # a step counter a checkpoint moved
    assert s.flag(0, ("layout digest", 128, "float16"), 4) == 1   # codes of another size
    assert s.flag(0, ("other layout", 64, "float16"), 4) == 1     # a rebuilt bucket
    assert s.flag(0, None, 4) == 1                      # an encode that raised
