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
  allocator notices completed events only when it next allocates (``process_events`` at
  the top of ``malloc``) or empties its cache; neither ``torch.cuda.synchronize()`` nor
  ``memory_stats()`` does, so after a synchronisation a freed block whose stream has long
  passed it still counts as active until the next allocation. The model does the same:
  pending blocks are released at the next ``malloc`` whose host time is at or after
  their ready time (or by ``empty_cache``), and ``memory_stats`` reports them as active;
* ``reserved`` is the memory held from the device. When a new segment would exceed what
  the allocator may hold ([Note: capacity a process sees]), cached oversize blocks are
  freed first (with ``max_split_size_mb``), then the device is synchronised and every
  whole free segment released (``num_alloc_retries``: cudaFree synchronises), and if
  that is not enough the allocation fails with ``torch.OutOfMemoryError``
  (``num_ooms``, the message giving the figure the request needed);
* ``empty_cache()`` synchronises the host with the device and releases every whole free
  segment;
* ``expandable_segments`` and ``max_split_size_mb`` as alloc_conf.py describes them
  ([Note: allocator settings]). An expandable segment is modelled block by block: each
  block knows how many of its bytes are mapped; a free block's bytes are unmapped when
  memory runs short or on ``empty_cache()``, and mapped again when reused. Mapping
  granularity (2 MiB and 20 MiB pages) is left out.

Not modelled: the other ``PYTORCH_CUDA_ALLOC_CONF`` settings, and any blocking of the
host by cudaMalloc itself: a new segment costs no host time unless
``malloc_synchronizes`` is set, which makes every new segment wait for the device
(cudaMalloc *may* synchronise; whether it does depends on the driver, so both are
offered).

[Note: capacity a process sees]
The allocator cannot reserve all of the card: the CUDA context (with cuBLAS's and the
kernels' own allocations) and NCCL's buffers for each communicator live outside it
(pytorch#147179; NVIDIA/nccl#964 measured 544 MB for a communicator of two A100s and
688 MB for one of more). ``capacity`` starts at the card's memory less the preset's
``context_bytes``, and each process group that runs its first collective takes
``nccl_bytes_per_group`` more (``hold_outside``). Both figures are the preset's, set
with ``--context-mib`` and ``--nccl-mib`` (docs/vgpu.md gives their sources).
"""

from __future__ import annotations

import bisect
import itertools

import torch

from zerobench.instruments.vgpu.alloc_conf import AllocatorConfig

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
    __slots__ = ("size", "small", "stream_id", "first", "expandable")

    def __init__(self, size: int, small: bool, stream_id: int, expandable: bool = False):
        self.size, self.small, self.stream_id = size, small, stream_id
        self.first: Block | None = None
        self.expandable = expandable  # grows at its end; its blocks map and unmap memory

    def last(self) -> "Block | None":
        block = self.first
        while block is not None and block.next is not None:
            block = block.next
        return block


class Block:
    __slots__ = ("id", "segment", "size", "mapped", "requested", "allocated", "prev", "next", "recorded", "ready",
                 "label")

    def __init__(self, segment: Segment, size: int, mapped: int | None = None):
        self.id = next(_ids)
        self.segment = segment
        self.size = size
        # Bytes of this block backed by device memory: all of them, except for a free block
        # of an expandable segment whose pages were given back.
        self.mapped = size if mapped is None else mapped
        self.requested = 0
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.recorded: set = set()  # streams (other than the allocating one) that use it
        self.ready: float = 0.0  # when a pending block may be reused
        self.label: str | None = None  # what the caller said it is for (VirtualGpu.label)


class CachingAllocator:
    """Counts bytes the way ``torch.cuda.memory_stats`` names them."""

    def __init__(self, gpu, capacity: int, malloc_synchronizes: bool = False,
                 config: AllocatorConfig | None = None):
        self.gpu = gpu
        self.capacity = capacity  # what it may reserve; see [Note: capacity a process sees]
        self.outside_bytes = 0  # held outside it since creation (NCCL communicators)
        self.malloc_synchronizes = malloc_synchronizes
        self.config = config or AllocatorConfig()
        # (stream id, small pool) -> sorted [(size, block id, block)] of cached free blocks
        self._free: dict[tuple[int, bool], list] = {}
        self._segments: list[Segment] = []
        # (stream id, small pool) -> its expandable segment, with expandable_segments
        self._expandable: dict[tuple[int, bool], Segment] = {}
        # Freed blocks waiting for the streams that used them: [(ready, block id, block)]
        self._pending: list = []
        self.stats = dict.fromkeys(
            ("allocated", "active", "reserved", "requested", "allocated_peak", "active_peak", "reserved_peak",
             "requested_peak", "num_alloc_retries", "num_ooms", "num_mallocs", "segments"), 0)
        # For the report of a cell that ran out of memory: the request that failed, and
        # what the allocator would have had to reserve to serve it (at least what the cell needed).
        self.failed_request_bytes = 0
        self.needed_bytes = 0
        # Active bytes per label, and their peaks (for tests and reports of what piles up).
        self.active_by_label: dict[str, int] = {}
        self.peak_active_by_label: dict[str, int] = {}
        self.largest_by_label: dict[str, int] = {}  # the largest block ever given each label

    def hold_outside(self, nbytes: int) -> None:
        """Device memory taken outside the allocator from now on (a new NCCL communicator)."""
        self.capacity -= nbytes
        self.outside_bytes += nbytes

    # -- allocate ----------------------------------------------------------------

    def malloc(self, nbytes: int, stream, label: str | None = None) -> Block:
        self.process_events()
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        if self.config.expandable_segments:
            block = self._malloc_expandable(size, small, stream.id)
        else:
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

    def _oversize(self, size: int) -> bool:
        limit = self.config.max_split_size
        return limit is not None and size >= limit

    def _take_cached(self, stream_id: int, small: bool, size: int) -> Block | None:
        free = self._free.get((stream_id, small))
        if not free:
            return None
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        block = free[i][2]
        # max_split_size_mb: a request below the limit never takes an oversize block, and an
        # oversize request takes one only if it wastes less than a large segment (20 MiB).
        if self._oversize(block.size) and (not self._oversize(size) or block.size >= size + LARGE_SEGMENT):
            return None
        free.pop(i)
        return self._split(block, size, small)

    def _split(self, block: Block, size: int, small: bool) -> Block:
        remaining = block.size - size
        if block.segment.expandable:
            worth = remaining >= ROUND
        else:
            worth = remaining > (ROUND if small else SMALL_SIZE) and not self._oversize(size)
        if worth:
            # The mapped bytes go to the part being allocated first (it must be mapped).
            mapped = block.mapped
            rest = Block(block.segment, remaining, mapped=max(mapped - size, 0))
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            block.mapped = min(mapped, size)
            self._cache(rest)
        return block

    def _make_room(self, nbytes: int, request: int) -> None:
        """Make ``nbytes`` more reservable, or raise OutOfMemoryError naming ``request``."""
        if self.stats["reserved"] + nbytes <= self.capacity:
            return
        if self.config.max_split_size is not None:
            self._release_oversize(self.stats["reserved"] + nbytes - self.capacity)
            if self.stats["reserved"] + nbytes <= self.capacity:
                return
        self.stats["num_alloc_retries"] += 1
        self.gpu.synchronize()
        self.process_events()
        self.release_cached()
        if self.stats["reserved"] + nbytes > self.capacity:
            self.stats["num_ooms"] += 1
            self.failed_request_bytes = max(self.failed_request_bytes, request)
            self.needed_bytes = max(self.needed_bytes, self.stats["reserved"] + nbytes)
            gib = 2**30
            raise torch.OutOfMemoryError(
                f"virtual GPU out of memory: tried to allocate {request / gib:.2f} GiB; {self.capacity / gib:.2f} GiB "
                f"the allocator may reserve, {self.stats['reserved'] / gib:.2f} GiB reserved, "
                f"{self.stats['allocated'] / gib:.2f} GiB allocated; it needed "
                f"{(self.stats['reserved'] + nbytes) / gib:.2f} GiB")

    def _new_segment(self, size: int, small: bool, stream_id: int) -> Block:
        seg_size = segment_size(size)
        self._make_room(seg_size, size)
        if self.malloc_synchronizes:
            self.gpu.synchronize()
        segment = Segment(seg_size, small, stream_id)
        block = Block(segment, seg_size)
        segment.first = block
        self._segments.append(segment)
        self.stats["reserved"] += seg_size
        self.stats["segments"] += 1
        return self._split(block, size, small)

    def _malloc_expandable(self, size: int, small: bool, stream_id: int) -> Block:
        """A cached block (its unmapped bytes mapped again), else the segment's end grown."""
        key = (stream_id, small)
        block = self._take_cached(stream_id, small, size)
        if block is not None:
            missing = block.size - block.mapped
            if missing:
                try:
                    self._make_room(missing, size)
                except torch.OutOfMemoryError:
                    self._cache(block)
                    raise
                block.mapped = block.size
                self.stats["reserved"] += missing
            return block
        segment = self._expandable.get(key)
        if segment is None:
            segment = Segment(0, small, stream_id, expandable=True)
            self._expandable[key] = segment
            self._segments.append(segment)
            self.stats["segments"] += 1
        last = segment.last()
        if last is not None and not last.allocated and last.size < size and self._uncache(last):
            # grow the free block at the end to the request's size
            missing = size - last.mapped
            try:
                self._make_room(missing, size)
            except torch.OutOfMemoryError:
                self._cache(last)
                raise
            segment.size += size - last.size
            last.size, last.mapped = size, size
            self.stats["reserved"] += missing
            return last
        self._make_room(size, size)
        if self.malloc_synchronizes:
            self.gpu.synchronize()
        block = Block(segment, size)
        if last is None:
            segment.first = block
        else:
            last.next, block.prev = block, last
        segment.size += size
        self.stats["reserved"] += size
        return block

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
                    neighbour.mapped += block.mapped
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.mapped += neighbour.mapped
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

    def _release_oversize(self, wanted: int) -> None:
        """Free cached oversize segments (whole free ones), smallest first that covers
        ``wanted``, else the largest ones until it is covered (max_split_size_mb)."""
        candidates = sorted((seg for seg in self._segments if not seg.expandable and self._whole_free(seg)
                             and self._oversize(seg.size)), key=lambda seg: seg.size)
        fitting = [seg for seg in candidates if seg.size >= wanted]
        chosen = fitting[:1] or list(reversed(candidates))
        released = 0
        for segment in chosen:
            if released >= wanted:
                break
            self._drop_segment(segment)
            released += segment.size

    @staticmethod
    def _whole_free(segment: Segment) -> bool:
        block = segment.first
        return block is not None and block.next is None and not block.allocated

    def _drop_segment(self, segment: Segment) -> None:
        if self._uncache(segment.first):
            self.stats["reserved"] -= segment.size
            self.stats["segments"] -= 1
            self._segments.remove(segment)

    def release_cached(self) -> None:
        """Give back every segment that is one whole free block, and every mapped byte of
        a free block of an expandable segment."""
        kept = []
        for segment in self._segments:
            if segment.expandable:
                block = segment.first
                while block is not None:
                    if not block.allocated and block.mapped and self._uncache(block):
                        self.stats["reserved"] -= block.mapped
                        block.mapped = 0
                        self._cache(block)
                    block = block.next
                kept.append(segment)
            elif self._whole_free(segment) and self._uncache(segment.first):
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
        """``torch.cuda.memory_stats()``'s names for what is modelled. Like the real one it
        processes no events: a freed block waiting for another stream is active until the
        next ``malloc`` (see the Note)."""
        s = self.stats
        out = {}
        for name in ("allocated", "active", "reserved", "requested"):
            out[f"{name}_bytes.all.current"] = s[name]
            out[f"{name}_bytes.all.peak"] = s[f"{name}_peak"]
        out["num_alloc_retries"] = s["num_alloc_retries"]
        out["num_ooms"] = s["num_ooms"]
        out["segment.all.current"] = s["segments"]
        return out
