"""Fused loss kernels. ``giou_op`` registers the ``torch.ops.fastzoo`` ops; kernel
libraries (Triton, NKI) are imported only inside the functions that launch them."""
