"""Cross-entropy of a linear head, ``F.cross_entropy(hidden @ weight.T, target)``, without
materialising the ``[tokens, vocab]`` logits (the LM head of GPT-2: vocab 50257).

The fused path follows Liger-Kernel's fused linear cross-entropy and Apple's Cut
Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"):
tokens are processed in chunks; for each chunk the logits are computed, turned into the
softmax in place, and the gradients of ``hidden`` and of ``weight`` are accumulated right
there, in the forward. The backward then only scales those saved gradients by the upstream
gradient, so the peak holds one chunk of logits and the weight's gradient instead of the
logits, their log-softmax and their gradient.

``impl`` (all three compute the same function; tests compare them in value and gradient):

- ``"reference"``: the logits materialised, ``F.cross_entropy`` on them;
- ``"fused"``: the chunked autograd.Function below;
- ``"torch"``: torch's own chunked ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``;
- ``"auto"``: the fastest on the device (:data:`AUTO_IMPL`, from ``benchmarks/results``).

Under autocast the matmuls run in the autocast dtype and the softmax in fp32, as the
reference does; the loss is fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastzoo.kernel_ranges import kernel_range

IMPLS = ("auto", "reference", "fused", "torch")
REDUCTIONS = ("mean", "sum", "none")
# Measured in benchmarks/results/cpu-2core/linear_ce.md (fwd+bwd, 4096 tokens x 768 -> 50257): the fused path is
# faster than torch's chunked op on CPU. On CUDA torch's op is the documented fast path; not
# measured here (no GPU was lent), so CUDA uses the fused path too until a GPU run says otherwise.
AUTO_IMPL = {"cpu": "fused", "cuda": "fused"}


def linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    target_N: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    impl: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(hidden_ND @ weight_VD.T, target_N, ignore_index=..., reduction=...)``.

    ``hidden_ND`` may carry leading dimensions (``[..., D]`` with ``target`` ``[...]``); they are
    flattened. ``reduction="mean"`` averages over the targets that are not ``ignore_index`` (all
    ignored: nan, as ``F.cross_entropy``); ``"none"`` returns one loss per token (0 where ignored).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {', '.join(IMPLS)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: choose one of {', '.join(REDUCTIONS)}")
    hidden_ND, target_N = _check(hidden_ND, weight_VD, target_N, ignore_index)
    asked = impl
    if impl == "auto":
        impl = AUTO_IMPL.get(hidden_ND.device.type, "fused")
    with kernel_range("loss", "linear_cross_entropy", impl if asked == impl else f"{asked} -> {impl}"):
        return _dispatch(hidden_ND, weight_VD, target_N, ignore_index, reduction, impl)


def _dispatch(hidden_ND, weight_VD, target_N, ignore_index: int, reduction: str, impl: str) -> torch.Tensor:
    if impl == "reference":
        return F.cross_entropy(hidden_ND @ weight_VD.T, target_N, ignore_index=ignore_index, reduction=reduction)
    if impl == "torch":
        from torch.nn import LinearCrossEntropyOptions

        return F.linear_cross_entropy(hidden_ND, weight_VD, target_N, ignore_index=ignore_index, reduction=reduction,
                                      options=LinearCrossEntropyOptions())
    dtype = _matmul_dtype(hidden_ND, weight_VD)
    loss = _FusedLinearCrossEntropy.apply(hidden_ND, weight_VD, target_N, ignore_index, reduction, dtype)
    return loss if torch.is_autocast_enabled(hidden_ND.device.type) else loss.to(dtype)


def _check(hidden, weight, target, ignore_index):
    for name, t in (("hidden_ND", hidden), ("weight_VD", weight), ("target_N", target)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"hidden_ND and weight_VD must be floating point, got {hidden.dtype} and {weight.dtype}")
    if weight.ndim != 2 or hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight_VD must be [V, D] with D = hidden_ND.shape[-1], got weight {tuple(weight.shape)} "
                         f"for hidden {tuple(hidden.shape)}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"target_N must hold integer class indices, got {target.dtype}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target_N must have shape {tuple(hidden.shape[:-1])} (hidden_ND without its last dim), "
                         f"got {tuple(target.shape)}")
    if hidden.device != weight.device or target.device != hidden.device:
        raise ValueError(f"hidden_ND, weight_VD and target_N must be on one device, got {hidden.device}, "
                         f"{weight.device}, {target.device}")
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise ValueError(f"hidden_ND is {hidden.dtype} but weight_VD is {weight.dtype}: cast one (or run under autocast)")
    target = target.reshape(-1).long()
    # free on CPU in eager; on a GPU (or traced by torch.compile) it would be a host sync
    if target.device.type == "cpu" and target.numel() and not torch.compiler.is_compiling():
        bad = (target != ignore_index) & ((target < 0) | (target >= weight.shape[0]))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"target_N[{i}] = {int(target[i])} is not a class index in [0, {weight.shape[0]}) "
                             f"nor ignore_index={ignore_index}")
    return hidden.reshape(-1, hidden.shape[-1]), target


def _matmul_dtype(hidden, weight) -> torch.dtype:
    """The dtype of ``hidden @ weight.T`` here: autocast's if it is on, else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def chunk_rows(n_tokens: int, vocab: int, width: int) -> int:
    """Tokens per chunk: a power of two near a third of the width (256 for GPT-2's 768), at least 64.

    The fixed cost is the weight's fp32 gradient (vocab x width) and the hidden states'; a chunk
    adds its fp32 logits, ``rows x vocab`` -- a third of the weight's gradient at 256 rows. Fewer
    rows stream the weight through memory more often (three matmuls per chunk): measured on CPU
    at 4096 x 768 -> 50257, 256 rows run as fast as 512 and 128 rows about 20% slower."""
    rows = max(64, 1 << (max(width // 3, 1).bit_length() - 1))
    return min(rows, max(n_tokens, 1))


def _chunk_pass(h_ND, w_VD, target_N, valid_N, row_scale_N, want_h: bool, want_w: bool, compute_loss: bool):
    """One pass over token chunks: per-token loss (if ``compute_loss``) and the gradients of the
    sum over tokens of ``row_scale_N * loss`` with respect to h and w (if wanted)."""
    n, d = h_ND.shape
    v = w_VD.shape[0]
    step = chunk_rows(n, v, d)
    acc = torch.promote_types(h_ND.dtype, torch.float32)  # softmax and sums: fp32 (fp64 stays fp64)
    low = h_ND.dtype != acc
    loss_N = torch.zeros(n, dtype=acc, device=h_ND.device) if compute_loss else None
    grad_h = torch.empty(n, d, dtype=h_ND.dtype, device=h_ND.device) if want_h else None
    grad_w = torch.zeros(v, d, dtype=acc, device=h_ND.device) if want_w else None  # accumulated over chunks
    # one chunk's logits, reused by every chunk (a fresh [C, V] each time would be page-faulted in anew)
    buf = torch.empty(min(step, n), v, dtype=h_ND.dtype, device=h_ND.device)
    buf_acc = torch.empty(min(step, n), v, dtype=acc, device=h_ND.device) if low else buf
    for s in range(0, n, step):
        e = min(s + step, n)
        h_c = h_ND[s:e]
        logits = torch.mm(h_c, w_VD.T, out=buf[: e - s])  # [C, V] in the matmul dtype
        logits = buf_acc[: e - s].copy_(logits) if low else logits
        t_c = target_N[s:e]
        safe_t = torch.where(valid_N[s:e], t_c, 0)[:, None]
        if compute_loss:
            picked = logits.gather(1, safe_t).squeeze(1)
        # softmax in place: logits -> exp(logits - max) -> / sum
        m = logits.amax(1, keepdim=True)
        logits.sub_(m).exp_()
        z = logits.sum(1, keepdim=True)
        if compute_loss:
            lse = m.squeeze(1) + z.squeeze(1).log()
            loss_N[s:e] = torch.where(valid_N[s:e], lse - picked, 0.0)
        if not (want_h or want_w):
            continue
        # d loss / d logits = softmax - onehot(target), scaled per token (0 where ignored)
        logits.mul_(row_scale_N[s:e, None] / z)
        logits.scatter_add_(1, safe_t, -row_scale_N[s:e, None])
        g_CV = buf[: e - s].copy_(logits) if low else logits
        if want_h:
            torch.mm(g_CV, w_VD, out=grad_h[s:e])
        if want_w:
            if low:
                grad_w.add_(g_CV.T @ h_c)
            else:
                grad_w.addmm_(g_CV.T, h_c)
    return loss_N, grad_h, grad_w


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Chunked loss with the gradients computed in the forward ("mean"/"sum"); for "none" the
    backward needs the per-token upstream gradient, so it recomputes the chunks."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, target_N, ignore_index, reduction, dtype):
        with torch.autocast(h_ND.device.type, enabled=False):  # dtypes are explicit below
            return _FusedLinearCrossEntropy._forward(ctx, h_ND.to(dtype), w_VD.to(dtype), target_N, ignore_index,
                                                     reduction, h_ND.dtype, w_VD.dtype)

    @staticmethod
    def _forward(ctx, h, w, target_N, ignore_index, reduction, h_dtype, w_dtype):
        valid_N = target_N != ignore_index
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.reduction, ctx.h_dtype, ctx.w_dtype = reduction, h_dtype, w_dtype
        if reduction == "none":
            loss_N, _, _ = _chunk_pass(h, w, target_N, valid_N, None, False, False, True)
            ctx.save_for_backward(h, w, target_N, valid_N)
            return loss_N
        n_valid = valid_N.sum()
        # "mean": each counted token weighs 1/n_valid (no host sync; all ignored -> grads 0, loss nan)
        row_scale = valid_N.float() / n_valid.clamp_min(1) if reduction == "mean" else valid_N.float()
        loss_N, grad_h, grad_w = _chunk_pass(h, w, target_N, valid_N, row_scale, want_h, want_w, True)
        total = loss_N.sum()
        loss = total / n_valid if reduction == "mean" else total
        ctx.save_for_backward(grad_h, grad_w)
        ctx.consumed = False
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.reduction == "none":
            h, w, target_N, valid_N = ctx.saved_tensors
            row_scale = grad_out.float() * valid_N
            _, grad_h, grad_w = _chunk_pass(h, w, target_N, valid_N, row_scale, ctx.needs_input_grad[0],
                                            ctx.needs_input_grad[1], False)
        else:
            if ctx.consumed:
                raise RuntimeError("linear_cross_entropy (fused): backward through the graph a second time is not "
                                   "supported (its gradients were computed in the forward and scaled in place); "
                                   "use impl='reference' for retain_graph=True")
            ctx.consumed = True
            grad_h, grad_w = ctx.saved_tensors
            g = grad_out.float()
            grad_h = grad_h.mul_(g.to(grad_h.dtype)) if grad_h is not None else None
            grad_w = grad_w.mul_(g) if grad_w is not None else None
        grad_h = grad_h.to(ctx.h_dtype) if grad_h is not None else None
        grad_w = grad_w.to(ctx.w_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None
