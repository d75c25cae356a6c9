"""Batching for sequence models: padded, packed (cu_seqlens) and nested."""
from fastzoo.data.collate import (
    IGNORE_INDEX, PackedBatch, PaddedBatch, nested, pack, pack_stream, pad_to_longest, pad_to_max,
)

__all__ = ["IGNORE_INDEX", "PackedBatch", "PaddedBatch", "nested", "pack", "pack_stream", "pad_to_longest", "pad_to_max"]
