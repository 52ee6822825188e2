"""slimformer.memory.peak_memory reads the allocator: on CPU its events (torch.profiler),
so what an op allocates inside itself counts; on CUDA its statistics, whose logic is
tested here on CPU with a stand-in for ``torch.cuda`` (the real device runs in
``bench.gpu_check``'s plan rows and the ``gpu``-marked tests)."""

import pytest
import torch

from slimformer.memory.peak import _Allocation, cuda_marks, peak_memory, replay

TEMP_BYTES = 40_000  # the scratch the custom op below allocates and frees inside itself


@torch.library.custom_op("slimformer_test::with_scratch", mutates_args=())
def _with_scratch(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.empty(TEMP_BYTES // 4)  # a temporary no op output shows
    scratch.fill_(1.0)
    return x + scratch[: x.numel()].view_as(x)


def test_cpu_marks_split_the_block_and_see_inside_an_op():
    before = torch.ones(10_000)  # allocated before the block: not counted
    with peak_memory("cpu") as peak:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(1000)
        del b
        peak.mark("first")
        c = torch.ones(10)
        peak.mark("second")
        out = _with_scratch(c)  # 4040 live + the scratch + its 40-byte output
        del a, c
    assert peak.marks[0].label == "first" and (peak.marks[0].live, peak.marks[0].top) == (4000, 8000)
    assert peak.marks[0].moments == (4000, 8000)
    assert (peak.marks[1].live, peak.marks[1].top) == (4040, 4040)
    assert peak.bytes == 4040 + TEMP_BYTES + 40
    assert peak.method == "CPU allocator events (torch.profiler)"
    with pytest.raises(RuntimeError, match="peak.mark"):
        with peak_memory("cpu") as inner:
            inner.current_bytes()
    del before, out


def test_cpu_blocks_do_not_nest():
    with peak_memory("cpu"):
        with pytest.raises(RuntimeError, match="cannot nest"):
            with peak_memory("cpu"):
                pass


def test_replay_counts_frees_and_moments_per_mark():
    events = [
        _Allocation(t, address, size) for t, (address, size) in enumerate([(1, 100), (2, 50), (1, -100), (3, 30)])
    ]
    peak, marks = replay(events, [2, 4], ["a", "b"])
    assert peak == 150
    assert [(m.live, m.top, m.moments) for m in marks] == [(150, 150, (100, 150)), (80, 150, (80,))]
    assert marks[1].events == ((1, -100), (3, 30))


class FakeCuda:
    """A stand-in for ``torch.cuda``'s caching-allocator statistics (CPU-side test of the
    CUDA logic): ``alloc`` and ``free`` move the allocated bytes as the allocator would."""

    def __init__(self, allocated: int):
        self.allocated = self.peak = allocated
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def synchronize(self, device) -> None:
        pass

    def reset_peak_memory_stats(self, device) -> None:
        self.peak, self.resets = self.allocated, self.resets + 1

    def memory_allocated(self, device) -> int:
        return self.allocated

    def max_memory_allocated(self, device) -> int:
        return self.peak


@pytest.mark.parametrize("moments", [False, True])
def test_cuda_path_with_fake_memory_stats(moments):
    # CPU-only stand-in for the CUDA caching allocator; no GPU is used or needed
    fake = FakeCuda(allocated=1 << 20)  # what was allocated before the block is left out
    with peak_memory("cuda", moments=moments, _cuda_api=fake) as peak:
        fake.alloc(500)
        fake.alloc(300)
        fake.free(300)
        assert (peak.current_bytes(), peak.peak_so_far()) == (500, 800)
        peak.mark("forward")
        fake.alloc(1000)
        fake.free(1000)
        fake.alloc(10)
        peak.mark("backward")
        assert peak.peak_so_far() == 1500  # across the mark's reset of the peak statistic
        fake.free(510)
    assert peak.bytes == 1500 and peak.method == "max_memory_allocated"
    assert [(m.label, m.live, m.top) for m in peak.marks] == [("forward", 500, 800), ("backward", 510, 1500)]
    # no CUDA allocator events reach a CPU-only profiler: each mark's one moment is its top
    assert [m.moments for m in peak.marks] == [(800,), (1500,)]
    assert fake.resets == 3  # on entry and at each mark


def test_cuda_marks_take_the_profilers_events_only_where_they_agree_with_the_stats():
    events = [_Allocation(10, 1, 500), _Allocation(11, 2, 300), _Allocation(12, 2, -300), _Allocation(20, 3, 1000)]
    splits = [("forward", 500, 800), ("backward", 1500, 1500)]
    marks = cuda_marks(splits, events, [15, 25])
    assert [m.moments for m in marks] == [(500, 800), (1500,)]
    assert marks[0].events == ((1, 500), (2, 300), (2, -300))
    # the statistics say 600 were allocated at the first mark, the events 500: the events are not used there
    marks = cuda_marks([("forward", 600, 800), ("backward", 1600, 1600)], events, [15, 25])
    assert marks[0].moments == (800,) and marks[0].events == ()
    assert marks[1].moments == (1600,)  # 600 + 1000


def test_a_cpu_measurement_prints_nothing(capfd):
    # kineto writes a line to stderr at each profiler start and stop; a measurement must not
    x = torch.randn(64, 64, requires_grad=True)
    with peak_memory("cpu"):
        (x @ x).sum().backward()
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""
