"""Batching for sequence models (padded, packed with cu_seqlens, nested) and, in
``fastzoo.data.boxes``, detection data: COCO-format sets with their categories, DETR's batches
(``pixel_values``, ``pixel_mask``, ``labels``) and box targets in every layout the GIoU loss takes."""
from fastzoo.data import boxes
from fastzoo.data.collate import (
    IGNORE_INDEX, PackedBatch, PaddedBatch, nested, pack, pack_stream, pad_to_longest, pad_to_max,
)

__all__ = ["IGNORE_INDEX", "boxes", "PackedBatch", "PaddedBatch", "nested", "pack", "pack_stream", "pad_to_longest", "pad_to_max"]
