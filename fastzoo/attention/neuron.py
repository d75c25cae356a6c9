"""``neuron``: the NKI flash-attention kernels for AWS Trainium / Inferentia2, on torch-xla tensors.

Calls the kernels that ship with the Neuron compiler, ``neuronxcc.nki.kernels.attention``
(documented at https://awsdocs-neuron.readthedocs-hosted.com/en/v2.21.0.beta/general/nki/api/generated/nki.kernels.flash_fwd.html
and .../nki.kernels.flash_attn_bwd.html; source: github.com/aws-neuron/nki-samples,
``src/nki_samples/reference/attention.py``):

- ``flash_fwd[b, h](q, k, v, seed, logit_bias=None, softmax_scale=None, use_causal_mask=True,
  mixed_precision=True, dropout_p=0.0, config=FlashConfig(...))`` with ``q``, ``k`` as
  ``[B, H, D, S]`` and ``v`` as ``[B, H, S, D]``; returns ``(o [B, H, S, D], lse)`` when
  ``config.training`` (lse: ``[B, H, 128, S // 128]``), else ``o``. ``seed`` is a ``(1,)`` tensor
  in training and must be None in inference. Head dim <= 128; the sequence length must be a
  multiple of ``config.seq_tile_size`` (>= 512); ``logit_bias`` broadcasts only as ``[1, 1, S, S]``.
- ``flash_attn_bwd[b, h](q, k, v, o, dy, lse, seed, logit_bias_ref=None, use_causal_mask=False,
  mixed_precision=False, dropout_p=0.0, softmax_scale=None)`` with every tensor ``[B, H, D, S]``;
  returns ``(dq, dk, dv)`` in that layout. Sequence length a multiple of 128.

Both are ``@nki.jit`` kernels launched on a ``[batch, heads]`` SPMD grid; on XLA tensors
``nki.jit`` compiles them as torch-xla custom ops. ``mixed_precision=True`` runs the matmuls in
bf16 with fp32 accumulation and softmax, so the backend takes bf16/fp16 only.

Sequence lengths that are not a multiple of 512 (ViT's 197 tokens) are padded here with zero
tokens; without a causal mask the padded keys get a large negative ``logit_bias`` (the padded
keys come after every real query, so a causal mask already hides them); the padded rows are
cut from the output and get zero upstream gradient. No key-padding mask, no packed sequences.

Which SDK: the ``neuronxcc.nki`` namespace ("NKI Beta 1") exists up to Neuron SDK 2.27; Neuron
2.28 removed it in favour of the standalone ``nki`` package, where these kernels live in
aws-neuron/nki-library instead. This file targets SDK 2.21-2.27 and has not been run on hardware.
Everything Neuron is imported inside the calls.
"""
from __future__ import annotations

import torch

from fastzoo.attention.base import HALF, AttentionBackend, Capabilities

MIN_TILE = 512  # FlashConfig.seq_tile_size must be >= 512 and divide the sequence length
PAD_BIAS = -30000.0  # finite (fits fp16) and large enough that exp() of it is 0 against any real score


def seq_tile_size(seqlen: int) -> int:
    """The largest of 2048 (the documented default), 1024, 512 dividing ``seqlen`` (already padded)."""
    return next(t for t in (2048, 1024, MIN_TILE) if seqlen % t == 0)


def padded_len(seqlen: int) -> int:
    return -(-seqlen // MIN_TILE) * MIN_TILE


def pad_bias(seqlen: int, padded: int, *, dtype, device) -> torch.Tensor:
    """``[1, 1, P, P]`` logit bias: 0 on real keys, PAD_BIAS on the padded ones."""
    bias = torch.zeros(1, 1, padded, padded, dtype=dtype, device=device)
    bias[..., seqlen:] = PAD_BIAS
    return bias


def _pad_seq(x_BHSD: torch.Tensor, padded: int) -> torch.Tensor:
    return torch.nn.functional.pad(x_BHSD, (0, 0, 0, padded - x_BHSD.shape[2]))


class _NkiFlashAttention(torch.autograd.Function):
    """flash_fwd forward, flash_attn_bwd backward; q/k/v/o in BHSD at the boundary."""

    @staticmethod
    def forward(ctx, q_BHSD, k_BHSD, v_BHSD, causal: bool, scale: float | None, dropout_p: float, training: bool):
        from neuronxcc.nki.kernels.attention import FlashConfig, flash_fwd

        B, H, S, _ = q_BHSD.shape
        P = padded_len(S)
        bias = None if P == S or causal else pad_bias(S, P, dtype=q_BHSD.dtype, device=q_BHSD.device)
        q_BHDS, k_BHDS = (_pad_seq(x, P).transpose(2, 3).contiguous() for x in (q_BHSD, k_BHSD))
        v_BHSD = _pad_seq(v_BHSD, P).contiguous()
        training = training or dropout_p > 0  # the kernel allows dropout only in its training mode
        # The kernel reads the seed only for dropout; inference mode requires None.
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32).to(q_BHSD.device) if training else None
        out = flash_fwd[B, H](
            q_BHDS, k_BHDS, v_BHSD, seed, logit_bias=bias, softmax_scale=scale, use_causal_mask=causal,
            mixed_precision=True, dropout_p=dropout_p, config=FlashConfig(seq_tile_size=seq_tile_size(P), training=training),
        )
        o_BHSD, lse = out if training else (out, None)
        if training:
            ctx.save_for_backward(q_BHDS, k_BHDS, v_BHSD, o_BHSD, lse, seed, *(() if bias is None else (bias,)))
            ctx.meta = (S, causal, scale, dropout_p)
        return o_BHSD[:, :, :S]

    @staticmethod
    def backward(ctx, do_BHSD):
        from neuronxcc.nki.kernels.attention import flash_attn_bwd

        q_BHDS, k_BHDS, v_BHSD, o_BHSD, lse, seed, *bias = ctx.saved_tensors
        S, causal, scale, dropout_p = ctx.meta
        B, H, _, P = q_BHDS.shape
        to_BHDS = lambda x: x.transpose(2, 3).contiguous()  # noqa: E731
        dy_BHDS = to_BHDS(_pad_seq(do_BHSD.to(q_BHDS.dtype), P))  # padded rows: zero gradient
        dq, dk, dv = flash_attn_bwd[B, H](
            q_BHDS, k_BHDS, to_BHDS(v_BHSD), to_BHDS(o_BHSD), dy_BHDS, lse, seed,
            logit_bias_ref=bias[0] if bias else None, use_causal_mask=causal, mixed_precision=True,
            dropout_p=dropout_p, softmax_scale=scale,
        )
        return (*(g_BHDS.transpose(2, 3)[:, :, :S] for g_BHDS in (dq, dk, dv)), None, None, None, None)


class NeuronBackend(AttentionBackend):
    name = "neuron"
    kernel_ops = r"nki|flash_fwd|flash_attn_bwd"
    description = "NKI flash attention (neuronxcc.nki.kernels flash_fwd / flash_attn_bwd; Neuron SDK 2.21-2.27) on Trainium/Inf2"
    capabilities = Capabilities(
        devices={"xla": HALF},  # mixed_precision=True: bf16 matmuls, fp32 accumulation and softmax
        padding_mask=False,
        varlen=False,
        backward=("xla",),
        compile=False,  # not tried under torch.compile
        max_head_dim=128,  # flash_fwd: "we do not support head_dim > 128"
        packages=("neuronxcc", "torch_neuronx"),
        install="pip install torch-neuronx neuronx-cc --extra-index-url=https://pip.repos.neuron.amazonaws.com",
        verified="not verified on hardware",
    )

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        if k_BHSD.shape != q_BHSD.shape or v_BHSD.shape != q_BHSD.shape:
            raise ValueError("neuron: flash_fwd needs self-attention with q, k, v of one shape [B, H, S, D] "
                             f"(no GQA, seq_q == seq_k); got {tuple(q_BHSD.shape)}, {tuple(k_BHSD.shape)}, "
                             f"{tuple(v_BHSD.shape)}")
        # Decided here: inside Function.forward grad mode is off. Training mode makes flash_fwd return lse.
        training = torch.is_grad_enabled() and any(x.requires_grad for x in (q_BHSD, k_BHSD, v_BHSD))
        return _NkiFlashAttention.apply(q_BHSD, k_BHSD, v_BHSD, ctx.causal, ctx.scale, ctx.dropout_p, training)
