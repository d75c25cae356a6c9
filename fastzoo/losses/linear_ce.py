"""Cross-entropy of a linear head, ``F.cross_entropy(hidden @ weight.T, target)``, without
materialising the ``[tokens, vocab]`` logits (the LM head of GPT-2: vocab 50257).

The fused path follows Liger-Kernel's fused linear cross-entropy and Apple's Cut
Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"):
the logits are computed one block at a time, never all at once, and the gradients of ``hidden``
and ``weight`` are formed in the forward; the backward only scales them by the upstream gradient.
By default ("mean" / "sum") it takes one pass over chunks of tokens (Liger-Kernel's order: the three
matmuls of the logits path, each as large as the weight, so each runs at the machine's GEMM rate):
each chunk's ``[rows, V]`` logits become ``softmax - onehot`` in place through one ``log_softmax``
kernel, and the gradients are two matmuls on them, the weight's added into it (``addmm_``). The
chunk holds as many logits as the weight holds parameters (:func:`one_pass_rows`), so the peak is
about twice the gradients any path returns, a quarter or less of the materialised logits' (tokens,
their log-softmax, their gradient) once tokens outnumber the width; it does fewer passes over the
``[rows, V]`` block than the logits path does over ``[N, V]``, and is as fast or faster
(benchmarks/results/cpu-2core/linear_ce.md, README.md there for the measurements).
``reduction="none"``, ``softcap`` and a small ``block_bytes`` take two passes over ``[rows, cols]``
blocks (tokens x vocabulary): a ``logsumexp`` pass (online softmax), then one that recomputes each
block, turns it into ``softmax - onehot`` and adds it into the gradients, four matmuls; each
target's logit is its hidden state dotted with the target's row of the weight.

``impl`` (all three compute the same function; tests compare them in value and gradient):

- ``"reference"``: the logits materialised, ``F.cross_entropy`` on them;
- ``"fused"``: the blocked autograd.Function below (one pass over token chunks, or two);
- ``"torch"``: torch's own chunked ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``;
- ``"auto"``: the fastest on the device (:data:`AUTO_IMPL`, from ``benchmarks/results``).

Under autocast the matmuls run in the autocast dtype and the softmax in fp32, as the
reference does; the loss is fp32. As in the reference's backward, ``softmax - onehot`` is formed
in fp32 and only then rounded to the matmuls' dtype: a confident token's gradient
(``p - 1 -> 0``) stays small instead of the difference of two rounded terms of size 1 (a loss
constant in the weights, a one-class vocabulary, has gradients of exactly 0, as the reference's).

``softcap`` (Gemma's ``final_logit_softcapping``): the loss of the capped logits
``cap * tanh(logits / cap)``, still one block at a time: each block is capped where it is
computed, and the gradient takes the cap's derivative ``1 - tanh^2`` per logit (the target's
too), in the two-pass order; torch's op has no cap.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastzoo.kernel_ranges import kernel_range
from fastzoo.losses.lm import IGNORE_INDEX
from fastzoo.losses.registry import Loss
from fastzoo.tracing import tracing

IMPLS = ("auto", "reference", "fused", "torch")
REDUCTIONS = ("mean", "sum", "none")
# Measured in benchmarks/results/cpu-2core/linear_ce.md (fwd+bwd, 4096 tokens x 768 -> 50257): the fused path is
# faster than torch's chunked op on CPU. On CUDA torch's op is the documented fast path, but no CUDA
# measurement exists in benchmarks/results, so CUDA takes the measured fused path too.
AUTO_IMPL = {"cpu": "fused", "cuda": "fused"}


def linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    target_N: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    impl: str = "auto",
    block_bytes: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden_ND @ weight_VD.T, target_N, ignore_index=..., reduction=...)``.

    ``hidden_ND`` may carry leading dimensions (``[..., D]`` with ``target`` ``[...]``); they are
    flattened. ``reduction="mean"`` averages over the targets that are not ``ignore_index`` (all
    ignored: nan, as ``F.cross_entropy``); ``"none"`` returns one loss per token (0 where ignored).

    ``block_bytes`` (fused path): the most the one logits block may hold. Default (None): one pass
    over chunks of as many tokens as the head is wide (:func:`one_pass_rows`: a block as large as
    the weight). A budget with room for at least :data:`ONE_PASS_ROWS` tokens x the vocabulary (in
    the matmuls' dtype) sets the chunk; a smaller one takes two passes over ``[rows, 512]`` blocks
    no larger than ``hidden_ND`` (:func:`logits_block`, torch's rule), four matmuls, for the least
    memory. ``reduction="none"`` and ``softcap`` always take two passes.

    ``softcap``: the logits are soft-capped first, ``softcap * tanh(logits / softcap)`` (None: not).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {', '.join(IMPLS)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: choose one of {', '.join(REDUCTIONS)}")
    if block_bytes is not None and (isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1):
        raise ValueError(f"block_bytes={block_bytes!r}: a positive number of bytes, or None for the default")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap={softcap!r}: a positive number (the logits' soft cap), or None")
    if softcap is not None and impl == "torch":
        raise ValueError("impl='torch': torch's F.linear_cross_entropy has no logit soft-capping; use impl='fused' or "
                         "'reference' with softcap")
    hidden_ND, target_N = _check(hidden_ND, weight_VD, target_N, ignore_index)
    asked = impl
    if impl == "auto":
        impl = AUTO_IMPL.get(hidden_ND.device.type, "fused")
    with kernel_range("loss", "linear_cross_entropy", impl if asked == impl else f"{asked} -> {impl}"):
        return _dispatch(hidden_ND, weight_VD, target_N, ignore_index, reduction, impl, block_bytes, softcap)


def softcap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma's final-logit soft-capping, ``cap * tanh(logits / cap)``, in transformers' order of ops."""
    return torch.tanh(logits / cap) * cap


def _dispatch(hidden_ND, weight_VD, target_N, ignore_index: int, reduction: str, impl: str, block_bytes,
              softcap=None) -> torch.Tensor:
    if impl == "reference":
        logits = hidden_ND @ weight_VD.T
        logits = logits if softcap is None else softcap_logits(logits, softcap)
        return F.cross_entropy(logits, target_N, ignore_index=ignore_index, reduction=reduction)
    if impl == "torch":
        from torch.nn import LinearCrossEntropyOptions

        return F.linear_cross_entropy(hidden_ND, weight_VD, target_N, ignore_index=ignore_index, reduction=reduction,
                                      options=LinearCrossEntropyOptions())
    dtype = _matmul_dtype(hidden_ND, weight_VD)
    loss = _FusedLinearCrossEntropy.apply(hidden_ND, weight_VD, target_N, ignore_index, reduction, dtype, block_bytes,
                                          softcap)
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
    if target.device.type == "cpu" and target.numel() and not tracing():
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


VOCAB_BLOCK = 512  # vocabulary columns per logits block: see logits_block


WEIGHT_SHARE = 16  # the block may also hold a sixteenth of the weight's gradient: see logits_block


def logits_block(n_tokens: int, vocab: int, width: int) -> tuple[int, int]:
    """(token rows, vocabulary columns) of the one logits block the fused path holds at a time.

    The block holds at most as many elements as the hidden states (``n_tokens x width``, torch's
    "aspect ratio" rule) or a sixteenth of the weight's gradient, whichever is more, so the peak
    is the two gradients plus at most one such tensor: 8 MiB at 4096 x 768 -> 50257
    (``[4096, 512]``) next to the weight's 147 MiB gradient. At a narrow head and a large
    vocabulary (1024 x 256 -> 128256) the hidden states alone would allow [512, 512] blocks, 502
    small matmuls per pass; a sixteenth of the gradient, 8 MiB, gives [1024, 1536], 84.
    Columns: 512, as measured on CPU (256 and 1024 were no faster), widened in steps of 512 once
    every token is in the block; rows: a power of two, at least 64, filling the budget."""
    budget = max(n_tokens * width, vocab * width // WEIGHT_SHARE)
    cols = min(VOCAB_BLOCK, vocab)
    rows = min(max(64, 1 << (max(budget // cols, 1).bit_length() - 1)), max(n_tokens, 1))
    if rows == n_tokens:
        cols = min(vocab, max(cols, budget // rows // VOCAB_BLOCK * VOCAB_BLOCK))
    return rows, cols


def lse_block(n_tokens: int, vocab: int, width: int, room: int) -> tuple[int, int]:
    """(token rows, vocabulary columns) of the first pass's block when the gradients are computed
    right after it: it runs before they exist, so it may hold ``room`` logits, as many bytes as
    the gradients will take, without raising the peak -- fewer, larger matmuls. Rows as
    :func:`logits_block`'s; columns a multiple of its, filling the room."""
    rows, cols = logits_block(n_tokens, vocab, width)
    wide = room // rows // VOCAB_BLOCK * VOCAB_BLOCK
    return rows, min(vocab, max(cols, wide))


ONE_PASS_ROWS = 256  # the fewest tokens per chunk of the one-pass path: fewer re-read the weight's gradient too often
SCRATCH_BYTES = 32 * 2**20  # off the CPU, the fp32 softmax scratch below fp32: few enough steps that each op stays large
L2_FALLBACK_BYTES = 2**20  # a CPU core's L2 cache where sysfs does not say


def one_pass_rows(n_tokens: int, vocab: int, width: int, dtype: torch.dtype, block_bytes: int | None) -> int | None:
    """Token rows per chunk of the one-pass path, spread evenly over the chunks; None: two passes.

    Default (``block_bytes=None``): the block holds as many logits as the weight holds parameters,
    ``width`` tokens (at least :data:`ONE_PASS_ROWS`), so the peak is about twice the gradients any
    path returns, a quarter or less of the materialised logits' once tokens outnumber the width
    (measured in benchmarks/results/cpu-2core/README.md: larger chunks were faster, the weight's
    gradient is re-read once per chunk). With ``block_bytes``: as many rows as it holds of ``[rows,
    vocab]`` logits in the matmuls' ``dtype``, None if that is under :data:`ONE_PASS_ROWS` tokens (or
    every token, when there are fewer)."""
    n = max(n_tokens, 1)
    if block_bytes is None:
        rows = max(width, ONE_PASS_ROWS)
    else:
        rows = block_bytes // (vocab * dtype.itemsize)
        if rows < min(ONE_PASS_ROWS, n):
            return None
    chunks = -(-n // rows)
    return -(-n // chunks)


def l2_cache_bytes() -> int:
    """One CPU core's L2 cache, from sysfs (:data:`L2_FALLBACK_BYTES` where it does not say)."""
    global _L2
    if _L2 is None:
        _L2 = L2_FALLBACK_BYTES
        try:
            with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
                text = f.read().strip().upper()
            scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
            _L2 = int(text.rstrip("KM")) * scale
        except (OSError, ValueError):
            pass
    return _L2


_L2 = None


def scratch_rows(vocab: int, acc: torch.dtype, device: torch.device) -> int:
    """Rows of the one-pass path's fp32 softmax scratch (below fp32): on a CPU as many as one core's
    L2 cache holds, so the exponentials and the rounding read it from the cache (measured: 3x faster
    than a scratch as large as the chunk); elsewhere :data:`SCRATCH_BYTES` of them."""
    room = l2_cache_bytes() if device.type == "cpu" else SCRATCH_BYTES
    return max(1, room // (vocab * acc.itemsize))


GRAD_W_SLICE = 4096  # vocabulary rows per product added into the fp32 gradient of the weight (below fp32)


def _one_pass(h_ND, w_VD, safe_t_N, valid_N, c, want_h: bool, want_w: bool, rows: int, acc: torch.dtype):
    """Per-token loss and the gradients of ``c * sum_i loss_i`` over the valid tokens, in one pass
    over token chunks (Liger-Kernel's order: three matmuls, as many as the logits path). Each
    chunk's ``[rows, V]`` logits become ``k_i * (softmax - onehot)`` (``k_i``: the token's weight)
    by one ``log_softmax`` kernel in place (its target entry is the token's loss), ``exp`` and the
    onehot; the gradients are two matmuls on them, the weight's added into it with ``addmm_``. Below
    fp32 the softmax runs a few rows at a time in an fp32 scratch (:func:`scratch_rows`) and is
    rounded once to the matmuls' dtype, as the reference's backward rounds its ``d loss / d logits``;
    the weight's gradient is accumulated in ``acc`` a vocabulary slice at a time (one chunk, every
    token: written once in the matmuls' dtype, as the reference's)."""
    n, d = h_ND.shape
    v = w_VD.shape[0]
    dt, dev = h_ND.dtype, h_ND.device
    low = dt != acc
    block = torch.empty(min(rows, n) * v, dtype=dt, device=dev)
    sub = scratch_rows(v, acc, dev) if low else rows  # fp32: the whole chunk in place (tiling measured no faster)
    scratch = torch.empty(min(sub, rows, n) * v, dtype=acc, device=dev) if low else None
    k_N = valid_N.to(acc) * c  # d (c * sum loss) / d loss_i
    minus_one = torch.full((min(sub, rows, n), 1), -1.0, dtype=acc, device=dev)
    loss_N = torch.empty(n, dtype=acc, device=dev)
    grad_h = torch.empty(n, d, dtype=dt, device=dev) if want_h else None
    whole = rows >= n
    grad_w = torch.empty(v, d, dtype=dt if whole or not low else acc, device=dev) if want_w else None
    slice_w = torch.empty(min(GRAD_W_SLICE, v), d, dtype=dt, device=dev) if want_w and low and not whole else None
    for s, e in _spans(n, rows):
        t_c = safe_t_N[s:e, None]
        g = torch.mm(h_ND[s:e], w_VD.T, out=block[: (e - s) * v].view(e - s, v))
        for a, b in _spans(e - s, sub):
            x = scratch[: (b - a) * v].view(b - a, v).copy_(g[a:b]) if low else g[a:b]
            torch._log_softmax(x, 1, False, out=x)  # row by row in one kernel: max, sum of exp, subtract
            loss_N[s + a:s + b] = x.gather(1, t_c[a:b]).squeeze(1).neg_()
            x.exp_().scatter_add_(1, t_c[a:b], minus_one[: b - a])  # softmax - onehot, before any rounding
            torch.mul(x, k_N[s + a:s + b, None], out=g[a:b]) if low else x.mul_(k_N[s + a:s + b, None])
        if want_h:
            torch.mm(g, w_VD, out=grad_h[s:e])
        if want_w:
            if s == 0 and (whole or not low):
                torch.mm(g.T, h_ND[s:e], out=grad_w)
            elif not low:
                grad_w.addmm_(g.T, h_ND[s:e])
            else:
                for a, b in _spans(v, GRAD_W_SLICE):
                    part = torch.mm(g[:, a:b].T, h_ND[s:e], out=slice_w[: b - a])
                    grad_w[a:b].copy_(part) if s == 0 else grad_w[a:b].add_(part)
    if want_w and n == 0:  # no tokens: no chunk wrote it
        grad_w.zero_()
    del block, scratch  # before the caller casts the gradients
    return torch.where(valid_N, loss_N, 0.0), grad_h, grad_w


def _spans(n: int, step: int):
    return [(s, min(s + step, n)) for s in range(0, n, step)]


class _Block:
    """The one logits buffer, reused by every block (a fresh one each time would be page-faulted in
    anew), as contiguous ``[rows, cols]`` views (``out=`` wants contiguous); when the matmuls run
    below fp32, a second one holds the block in fp32 for the softmax."""

    def __init__(self, numel: int, dtype: torch.dtype, acc: torch.dtype, device):
        self.flat = torch.empty(numel, dtype=dtype, device=device)
        self.flat_acc = torch.empty(numel, dtype=acc, device=device) if acc != dtype else None

    def mm(self, rows: int, cols: int) -> torch.Tensor:
        return self.flat[: rows * cols].view(rows, cols)

    def acc(self, block: torch.Tensor) -> torch.Tensor:
        if self.flat_acc is None:
            return block
        return self.flat_acc[: block.numel()].view(block.shape).copy_(block)


def _logsumexp_pass(h_ND, w_VD, rows: int, cols: int, acc: torch.dtype, cap: float | None = None):
    """Per token, the ``logsumexp`` of its logits (soft-capped at ``cap``), one block at a time
    (a running max and sum of exponentials, as in online softmax)."""
    n, v = h_ND.shape[0], w_VD.shape[0]
    buf = _Block(min(rows, n) * cols, h_ND.dtype, acc, h_ND.device)
    lse_N = torch.empty(n, dtype=acc, device=h_ND.device)
    for s, e in _spans(n, rows):
        m_c = torch.full((e - s,), float("-inf"), dtype=acc, device=h_ND.device)
        z_c = torch.zeros(e - s, dtype=acc, device=h_ND.device)
        for a, b in _spans(v, cols):
            logits = buf.acc(torch.mm(h_ND[s:e], w_VD[a:b].T, out=buf.mm(e - s, b - a)))
            if cap is not None:
                logits = logits.div_(cap).tanh_().mul_(cap)
            m_new = torch.maximum(m_c, logits.amax(1))
            z_c = z_c.mul_((m_c - m_new).exp_()).add_(logits.sub_(m_new[:, None]).exp_().sum(1))
            m_c = m_new
        lse_N[s:e] = m_c + z_c.log()
    return lse_N


TARGET_ROWS = 512  # tokens per step of the target terms below: a [512, D] temporary at most


def _target_logits(h_ND, w_VD, safe_t_N, acc: torch.dtype, cap: float | None = None):
    """Per token, the logit of its target: its hidden state dotted with the target's row of the
    weight, rounded to the matmuls' dtype as the logits blocks are (soft-capped at ``cap``)."""
    picked_N = torch.empty(h_ND.shape[0], dtype=acc, device=h_ND.device)
    for s, e in _spans(h_ND.shape[0], TARGET_ROWS):
        dot = (h_ND[s:e].to(acc) * w_VD[safe_t_N[s:e]].to(acc)).sum(1)
        picked_N[s:e] = dot.to(h_ND.dtype).to(acc)
    if cap is not None:
        picked_N = softcap_logits(picked_N, cap)
    return picked_N


def _grad_pass(h_ND, w_VD, safe_t_N, lse_N, scale_N, want_h: bool, want_w: bool, rows: int, cols: int,
               acc: torch.dtype, cap: float | None = None):
    """Gradients of ``sum_i scale_N[i] * loss_i`` with respect to h and w: ``d loss / d logits =
    softmax - onehot(target)``, one logits block at a time, read from the saved ``lse_N`` (the
    onehot in the block holding the target's column, in fp32), the vocabulary the outer loop so
    that each block of the weight's gradient is written once, whole."""
    n, d = h_ND.shape
    v = w_VD.shape[0]
    low = h_ND.dtype != acc
    buf = _Block(min(rows, n) * cols, h_ND.dtype, acc, h_ND.device)
    # accumulated over vocabulary blocks: in fp32 when the matmuls run in a lower precision
    grad_h = torch.zeros(n, d, dtype=acc, device=h_ND.device) if want_h else None
    grad_w = torch.empty(v, d, dtype=acc, device=h_ND.device) if want_w else None
    for a, b in _spans(v, cols):
        # each token's target as a column of this block (0 where outside it: a no-op, no host sync)
        col_N = (safe_t_N - a).clamp_(0, b - a - 1)[:, None]
        minus_onehot_N = ((safe_t_N >= a) & (safe_t_N < b)).to(acc).neg_()[:, None]
        for s, e in _spans(n, rows):
            logits = torch.mm(h_ND[s:e], w_VD[a:b].T, out=buf.mm(e - s, b - a))
            g = buf.acc(logits)
            if cap is not None:  # capped logits, and the cap's derivative 1 - tanh^2 per logit
                tanh = g.div_(cap).tanh_()
                slope = 1 - tanh.square()
                g = tanh.mul_(cap)
            g.sub_(lse_N[s:e, None]).exp_().scatter_add_(1, col_N[s:e], minus_onehot_N[s:e])  # softmax - onehot
            g.mul_(scale_N[s:e, None])  # scaled per token
            if cap is not None:
                g.mul_(slope)
            g = logits.copy_(g) if low else g  # the matmuls' dtype
            if want_h:
                if low:
                    grad_h[s:e].add_(g @ w_VD[a:b])
                else:
                    grad_h[s:e].addmm_(g, w_VD[a:b])
            if want_w:
                if low:
                    grad_w[a:b].add_(g.T @ h_ND[s:e]) if s else grad_w[a:b].copy_(g.T @ h_ND[s:e])
                elif s:
                    grad_w[a:b].addmm_(g.T, h_ND[s:e])
                else:
                    torch.mm(g.T, h_ND[s:e], out=grad_w[a:b])
    return grad_h, grad_w


def _first_block(ctx, h, w, reduction: str, acc: torch.dtype) -> tuple[int, int]:
    """The first pass's block: :func:`lse_block` when the gradients follow in this forward (room:
    their bytes), else the second pass's (:func:`logits_block`)."""
    n, d = h.shape
    v = w.shape[0]
    want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if reduction == "none" or not (want_h or want_w):
        return logits_block(n, v, d)
    per_logit = h.dtype.itemsize + (acc.itemsize if acc != h.dtype else 0)  # the block, and its copy in acc
    return lse_block(n, v, d, (want_w * v + want_h * n) * d * acc.itemsize // per_logit)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Two passes over logits blocks: the ``logsumexp`` of each token's logits, then (for "mean" and
    "sum", still in the forward) the gradients. For "none" the backward needs the per-token
    upstream gradient, so the forward saves ``logsumexp`` and the backward runs the second pass."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, target_N, ignore_index, reduction, dtype, block_bytes, cap):
        with torch.autocast(h_ND.device.type, enabled=False):  # dtypes are explicit below
            return _FusedLinearCrossEntropy._forward(ctx, h_ND.to(dtype), w_VD.to(dtype), target_N, ignore_index,
                                                     reduction, h_ND.dtype, w_VD.dtype, block_bytes, cap)

    @staticmethod
    def _forward(ctx, h, w, target_N, ignore_index, reduction, h_dtype, w_dtype, block_bytes, cap):
        valid_N = target_N != ignore_index
        safe_t_N = torch.where(valid_N, target_N, 0)
        acc = torch.promote_types(h.dtype, torch.float32)  # softmax and sums: fp32 (fp64 stays fp64)
        rows, cols = logits_block(h.shape[0], w.shape[0], h.shape[1])
        ctx.reduction, ctx.h_dtype, ctx.w_dtype, ctx.block, ctx.cap = reduction, h_dtype, w_dtype, (rows, cols, acc), cap
        one_pass = (one_pass_rows(h.shape[0], w.shape[0], h.shape[1], h.dtype, block_bytes)
                    if reduction != "none" and cap is None else None)
        if one_pass is None:
            lse_N = _logsumexp_pass(h, w, *_first_block(ctx, h, w, reduction, acc), acc, cap)
            loss_N = torch.where(valid_N, lse_N - _target_logits(h, w, safe_t_N, acc, cap), 0.0)
        if reduction == "none":
            ctx.save_for_backward(h, w, safe_t_N, valid_N, lse_N)
            return loss_N
        n_valid = valid_N.sum()
        # "mean": each counted token weighs 1/n_valid (no host sync; all ignored -> grads 0, loss nan)
        c = 1 / n_valid.clamp_min(1).to(acc) if reduction == "mean" else torch.ones((), dtype=acc, device=h.device)
        scale_N = valid_N.to(acc) * c
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = grad_w = None
        if one_pass is not None:
            loss_N, grad_h, grad_w = _one_pass(h, w, safe_t_N, valid_N, c, want_h, want_w, one_pass, acc)
        elif want_h or want_w:
            grad_h, grad_w = _grad_pass(h, w, safe_t_N, lse_N, scale_N, want_h, want_w, rows, cols, acc, cap)
        total = loss_N.sum()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.consumed = False
        return total / n_valid if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.reduction == "none":
            h, w, safe_t_N, valid_N, lse_N = ctx.saved_tensors
            rows, cols, acc = ctx.block
            scale_N = grad_out.to(acc) * valid_N
            grad_h, grad_w = _grad_pass(h, w, safe_t_N, lse_N, scale_N, ctx.needs_input_grad[0],
                                        ctx.needs_input_grad[1], rows, cols, acc, ctx.cap)
        else:
            if ctx.consumed:
                raise RuntimeError("linear_cross_entropy (fused): backward through the graph a second time is not "
                                   "supported (its gradients were computed in the forward and scaled in place); "
                                   "use impl='reference' for retain_graph=True")
            ctx.consumed = True
            grad_h, grad_w = ctx.saved_tensors
            return _times(grad_h, grad_out, ctx.h_dtype), _times(grad_w, grad_out, ctx.w_dtype), *[None] * 6
        grad_h = grad_h.to(ctx.h_dtype) if grad_h is not None else None
        grad_w = grad_w.to(ctx.w_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


def _times(grad, grad_out, dtype):
    """``grad * grad_out`` in ``dtype``, in place, in the wider of ``grad``'s dtype and ``dtype``: the
    upstream gradient (``1 / num_items_in_batch``, say) is never rounded below the result's dtype."""
    if grad is None:
        return None
    if torch.promote_types(grad.dtype, dtype) == dtype:  # cast up first (a cast the result needs anyway)
        return grad.to(dtype).mul_(grad_out.to(dtype))
    return grad.mul_(grad_out.to(grad.dtype)).to(dtype)


LINEAR_CE = Loss(
    name="linear_ce",
    description="cross-entropy of a linear head's logits without materialising them (the LM head's loss)",
    functions=("linear_cross_entropy",),
    impls={"reference": "logits materialised, F.cross_entropy", "fused": "blocked autograd.Function (online softmax)",
           "torch": "torch's chunked F.linear_cross_entropy", "auto": "the fastest measured on the device (AUTO_IMPL)"},
    kernel_ops=r"LinearCrossEntropy|cross_entropy|nll_loss|log_softmax",
    bench="fastzoo.bench.linear_ce",
)

