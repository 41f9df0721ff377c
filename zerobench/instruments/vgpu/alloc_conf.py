"""The caching-allocator settings users set, in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax.

[Note: allocator settings]
``--alloc-conf "expandable_segments:True,max_split_size_mb:512"`` takes the text a user
puts in ``PYTORCH_CUDA_ALLOC_CONF`` (comma-separated ``key:value`` pairs, as
c10/cuda/CUDAAllocatorConfig parses them). Two settings are modelled
(allocator.py, [Note: virtual caching allocator]):

* ``expandable_segments:True`` (torchtitan's launcher sets it): one segment per stream
  and pool that grows by mapping memory at its end, instead of a new ``cudaMalloc``
  for each request that no cached block fits; freed memory is unmapped (given back)
  when memory runs short or on ``empty_cache()``, wherever it lies in the segment, so
  free space between live blocks no longer strands whole segments. Blocks are split
  whenever the remainder is at least 512 bytes.
* ``max_split_size_mb:N``: cached blocks of N MiB or more are *oversize*: a request
  below N never takes one, a request of N or more takes one only if it wastes less
  than 20 MiB, oversize blocks are never split, and when a new segment does not fit,
  cached oversize blocks are freed first, before the retry that frees the whole cache.

Every other key of ``PYTORCH_CUDA_ALLOC_CONF`` (``garbage_collection_threshold``,
``roundup_power2_divisions``, ``backend``, ...) is refused with the list of modelled
ones, rather than accepted and silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 2**20
MODELLED = ("expandable_segments", "max_split_size_mb")


@dataclass(frozen=True)
class AllocatorConfig:
    """The modelled subset of ``PYTORCH_CUDA_ALLOC_CONF``."""

    expandable_segments: bool = False
    """Grow one segment per stream and pool by mapping pages, instead of cudaMalloc per segment."""
    max_split_size: int | None = None
    """Bytes from which a cached block is oversize (``max_split_size_mb`` in bytes); None: no limit."""

    @classmethod
    def parse(cls, text: str | None) -> "AllocatorConfig":
        """``"expandable_segments:True,max_split_size_mb:512"`` -> AllocatorConfig; an
        error naming the key and what it allows otherwise."""
        if text is None or not str(text).strip():
            return cls()
        values: dict = {}
        for item in str(text).split(","):
            if not item.strip():
                continue
            key, sep, value = (part.strip() for part in item.partition(":"))
            if not sep:
                raise ValueError(f"--alloc-conf: {item.strip()!r} is not a key:value pair "
                                 f"(allowed keys: {', '.join(MODELLED)})")
            if key not in MODELLED:
                raise ValueError(f"--alloc-conf: {key!r} is not modelled by the virtual GPU "
                                 f"(allowed: {', '.join(MODELLED)}; docs/vgpu.md, 'Allocator settings')")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(f"--alloc-conf: expandable_segments:{value} is not allowed (allowed: True, False)")
                values["expandable_segments"] = value == "True"
            else:
                if not value.isdigit() or int(value) <= 20:
                    raise ValueError(f"--alloc-conf: max_split_size_mb:{value} is not allowed "
                                     "(allowed: an int > 20, as PyTorch requires)")
                values["max_split_size"] = int(value) * _MiB
        return cls(**values)

    def describe(self) -> str:
        """Back in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax ("" for the defaults)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // _MiB}")
        return ",".join(parts)
