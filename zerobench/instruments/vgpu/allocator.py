"""A model of PyTorch's CUDA caching allocator, driven by the virtual GPU.

[Note: virtual caching allocator]
What is modelled, after c10/cuda/CUDACachingAllocator.cpp's documented behaviour:

* sizes are rounded up to 512 bytes. Requests up to 1 MiB come from the small pool
  (2 MiB segments); larger ones from the large pool (20 MiB segments below 10 MiB,
  else a segment of the request rounded up to 2 MiB). A cached free block is reused
  best-fit, within the pool *and the stream* it was allocated on, and split when the
  remainder is worth keeping (more than 512 bytes small, 1 MiB large); freed blocks
  merge with free neighbours in their segment;
* allocation happens at host time, on the current stream;
* ``free()`` at host time lowers ``allocated`` at once. A block whose tensor was
  ``record_stream``-ed onto other streams is not reusable until each of those streams
  has passed the free: it stays *active* (and out of the cache) until then. The real
  allocator notices completed events only when it next allocates (or synchronises), so
  the model does the same: pending blocks are released at the next ``malloc`` whose
  host time is at or after their ready time;
* ``reserved`` is the sum of segments. When a new segment would exceed the device's
  memory, whole free segments are released first (``num_alloc_retries``; this
  synchronises the device, as cudaFree does), and if that is not enough the allocation
  fails with ``torch.OutOfMemoryError`` (``num_ooms``);
* ``empty_cache()`` synchronises the host with the device and releases every whole free
  segment.

Not modelled: expandable segments, ``max_split_size_mb`` and the other
``PYTORCH_CUDA_ALLOC_CONF`` settings, and any blocking of the host by cudaMalloc
itself: a new segment costs no host time unless ``malloc_synchronizes`` is set, which
makes every new segment wait for the device (cudaMalloc *may* synchronise; whether it
does depends on the driver, so both are offered).
"""

from __future__ import annotations

import bisect
import itertools

import torch

ROUND = 512
SMALL_SIZE = 1 << 20
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

_ids = itertools.count()


def round_size(nbytes: int) -> int:
    return max(ROUND, -(-int(nbytes) // ROUND) * ROUND)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Segment:
    __slots__ = ("size", "small", "stream_id", "first")

    def __init__(self, size: int, small: bool, stream_id: int):
        self.size, self.small, self.stream_id = size, small, stream_id
        self.first: Block | None = None


class Block:
    __slots__ = ("id", "segment", "size", "requested", "allocated", "prev", "next", "recorded", "ready", "label")

    def __init__(self, segment: Segment, size: int):
        self.id = next(_ids)
        self.segment = segment
        self.size = size
        self.requested = 0
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.recorded: set = set()  # streams (other than the allocating one) that use it
        self.ready: float = 0.0  # when a pending block may be reused
        self.label: str | None = None  # what the caller said it is for (VirtualGpu.label)


class CachingAllocator:
    """Counts bytes the way ``torch.cuda.memory_stats`` names them."""

    def __init__(self, gpu, capacity: int, malloc_synchronizes: bool = False):
        self.gpu = gpu
        self.capacity = capacity
        self.malloc_synchronizes = malloc_synchronizes
        # (stream id, small pool) -> sorted [(size, block id, block)] of cached free blocks
        self._free: dict[tuple[int, bool], list] = {}
        self._segments: list[Segment] = []
        # Freed blocks waiting for the streams that used them: [(ready, block id, block)]
        self._pending: list = []
        self.stats = dict.fromkeys(
            ("allocated", "active", "reserved", "requested", "allocated_peak", "active_peak", "reserved_peak",
             "requested_peak", "num_alloc_retries", "num_ooms", "num_mallocs", "segments"), 0)
        # Active bytes per label, and their peaks (for tests and reports of what piles up).
        self.active_by_label: dict[str, int] = {}
        self.peak_active_by_label: dict[str, int] = {}
        self.largest_by_label: dict[str, int] = {}  # the largest block ever given each label

    # -- allocate ----------------------------------------------------------------

    def malloc(self, nbytes: int, stream, label: str | None = None) -> Block:
        self.process_events()
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_cached(stream.id, small, size)
        if block is None:
            block = self._new_segment(size, small, stream.id)
        block.allocated = True
        block.requested = int(nbytes)
        block.recorded = set()
        block.label = label
        if label is not None:
            now = self.active_by_label.get(label, 0) + block.size
            self.active_by_label[label] = now
            self.peak_active_by_label[label] = max(self.peak_active_by_label.get(label, 0), now)
        s = self.stats
        s["allocated"] += block.size
        s["active"] += block.size
        s["requested"] += block.requested
        s["num_mallocs"] += 1
        self._peaks()
        return block

    def _take_cached(self, stream_id: int, small: bool, size: int) -> Block | None:
        free = self._free.get((stream_id, small))
        if not free:
            return None
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        _, _, block = free.pop(i)
        return self._split(block, size, small)

    def _split(self, block: Block, size: int, small: bool) -> Block:
        remaining = block.size - size
        if remaining > (ROUND if small else SMALL_SIZE):
            rest = Block(block.segment, remaining)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._cache(rest)
        return block

    def _new_segment(self, size: int, small: bool, stream_id: int) -> Block:
        seg_size = segment_size(size)
        if self.stats["reserved"] + seg_size > self.capacity:
            self.stats["num_alloc_retries"] += 1
            self.gpu.synchronize()
            self.process_events()
            self.release_cached()
            if self.stats["reserved"] + seg_size > self.capacity:
                self.stats["num_ooms"] += 1
                gib = 2**30
                raise torch.OutOfMemoryError(
                    f"virtual GPU out of memory: tried to allocate {size / gib:.2f} GiB; {self.capacity / gib:.2f} GiB"
                    f" total capacity, {self.stats['reserved'] / gib:.2f} GiB reserved, "
                    f"{self.stats['allocated'] / gib:.2f} GiB allocated")
        if self.malloc_synchronizes:
            self.gpu.synchronize()
        segment = Segment(seg_size, small, stream_id)
        block = Block(segment, seg_size)
        segment.first = block
        self._segments.append(segment)
        self.stats["reserved"] += seg_size
        self.stats["segments"] += 1
        return self._split(block, size, small)

    # -- free --------------------------------------------------------------------

    def record_stream(self, block: Block, stream) -> None:
        if stream.id != block.segment.stream_id:
            block.recorded.add(stream)

    def free(self, block: Block) -> None:
        """The last reference died at host time ``now``."""
        if not block.allocated:
            return
        block.allocated = False
        self.stats["allocated"] -= block.size
        self.stats["requested"] -= block.requested
        if block.recorded:
            # The allocator records an event on each using stream now; the block is
            # reusable once every one of them has completed.
            now = self.gpu.host.now
            block.ready = max(max(s.tail, now) for s in block.recorded)
            block.recorded = set()
            bisect.insort(self._pending, (block.ready, block.id, block))
            return
        self._release(block)

    def process_events(self) -> None:
        now = self.gpu.host.now
        while self._pending and self._pending[0][0] <= now:
            _, _, block = self._pending.pop(0)
            self._release(block)

    def relabel(self, block: Block, label: str) -> None:
        """Count an allocated block under ``label`` from now on."""
        if not block.allocated or block.label == label:
            return
        if block.label is not None:
            self.active_by_label[block.label] -= block.size
        block.label = label
        now = self.active_by_label.get(label, 0) + block.size
        self.active_by_label[label] = now
        self.peak_active_by_label[label] = max(self.peak_active_by_label.get(label, 0), now)
        self.largest_by_label[label] = max(self.largest_by_label.get(label, 0), block.size)

    def _release(self, block: Block) -> None:
        self.stats["active"] -= block.size
        if block.label is not None:
            self.active_by_label[block.label] -= block.size
            block.label = None
        # merge with free neighbours in the segment
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and self._uncache(neighbour):
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._cache(block)

    def _cache(self, block: Block) -> None:
        key = (block.segment.stream_id, block.segment.small)
        bisect.insort(self._free.setdefault(key, []), (block.size, block.id, block))

    def _uncache(self, block: Block) -> bool:
        free = self._free.get((block.segment.stream_id, block.segment.small), [])
        i = bisect.bisect_left(free, (block.size, block.id))
        if i < len(free) and free[i][2] is block:
            free.pop(i)
            return True
        return False  # pending, not cached

    def release_cached(self) -> None:
        """Give back every segment that is one whole free block."""
        kept = []
        for segment in self._segments:
            block = segment.first
            if block is not None and block.next is None and not block.allocated and self._uncache(block):
                self.stats["reserved"] -= segment.size
                self.stats["segments"] -= 1
            else:
                kept.append(segment)
        self._segments = kept

    # -- statistics ----------------------------------------------------------------

    def _peaks(self) -> None:
        s = self.stats
        for name in ("allocated", "active", "reserved", "requested"):
            if s[name] > s[f"{name}_peak"]:
                s[f"{name}_peak"] = s[name]

    def reset_peak(self) -> None:
        self.peak_active_by_label = dict(self.active_by_label)
        s = self.stats
        for name in ("allocated", "active", "reserved", "requested"):
            s[f"{name}_peak"] = s[name]

    def memory_stats(self) -> dict:
        """``torch.cuda.memory_stats()``'s names for what is modelled."""
        self.process_events()
        s = self.stats
        out = {}
        for name in ("allocated", "active", "reserved", "requested"):
            out[f"{name}_bytes.all.current"] = s[name]
            out[f"{name}_bytes.all.peak"] = s[f"{name}_peak"]
        out["num_alloc_retries"] = s["num_alloc_retries"]
        out["num_ooms"] = s["num_ooms"]
        out["segment.all.current"] = s["segments"]
        return out
