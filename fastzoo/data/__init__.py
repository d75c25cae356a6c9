"""Batching for sequence models (padded, packed with cu_seqlens, nested) and, in
``fastzoo.data.boxes``, detection targets (list, padded + mask, concatenated + counts)."""
from fastzoo.data import boxes
from fastzoo.data.collate import (
    IGNORE_INDEX, PackedBatch, PaddedBatch, nested, pack, pack_stream, pad_to_longest, pad_to_max,
)

__all__ = ["IGNORE_INDEX", "boxes", "PackedBatch", "PaddedBatch", "nested", "pack", "pack_stream", "pad_to_longest", "pad_to_max"]
