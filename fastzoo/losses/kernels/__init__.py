"""Fused loss kernels. ``giou_op`` registers the ``torch.ops.fastzoo`` ops; kernel
libraries (Triton, NKI) are imported only inside the functions that launch them."""

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp16/bf16 are computed (and the loss returned) in fp32, as torchvision does; fp64 if any
    input is fp64. pred and target may differ (bf16 predictions, fp32 targets under autocast)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32
