"""``flex``: FlexAttention (``torch.nn.attention.flex_attention``) with score_mod / block_mask.

Options: ``score_mod`` (callable or ``"softcap"``), ``mask_mod`` (callable or one of
``"causal"``, ``"sliding_window"``, ``"neighborhood"``), or a ready ``block_mask``;
preset parameters ``softcap``, ``window``, ``radius``; ``compile`` (default: on CUDA only).
The context's own masks (causal, padding, packed documents) are always added, so a packed
batch can never attend across sequences whatever the user's mask says.

Flex has no attention dropout: a model configured with one is refused at create /
set_attention. On CPU PyTorch runs flex without a backward: a training forward fails
before it runs.

Compiled FlexAttention on CPU (``compile=True``, or the model under ``torch.compile``) is
refused unless this torch has passed :mod:`fastzoo.attention.flex_cpu_repro` (compiled against
uncompiled flex, torch only): PyTorch's C++ template was reported to give wrong results in
about half of the runs with torch 2.14.1. ``python -m fastzoo.attention.flex_cpu_repro``
stores the verdict; the refusal lifts for a torch whose verdict is ``correct``. Uncompiled
flex on CPU is exact (it runs the scores through eager ops) and stays available; compiled flex
on CUDA (Triton) is unaffected.
"""
from __future__ import annotations

import functools
import sys

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from fastzoo.attention import flex_cpu_repro, masks
from fastzoo.attention.base import FLOATS, AttentionBackend, Capabilities, KernelProfile
from fastzoo.errors import BackendUnavailableError
from fastzoo.tracing import tracing

_compiled_flex = {}


def cpu_compile_refusal() -> str | None:
    """Why compiled flex on CPU is refused with this torch, or None once the reproducer's stored
    verdict for it is ``correct`` (read once per process and cache location)."""
    return _refusal_for(str(flex_cpu_repro.cache_path()))


@functools.lru_cache(maxsize=None)
def _refusal_for(path: str) -> str | None:
    verdict = flex_cpu_repro.stored_verdict()
    if verdict is not None and verdict.get("verdict") == "correct":
        return None
    seen = ("no verdict for this torch yet" if verdict is None
            else f"its verdict for this torch: wrong in {verdict.get('wrong')} of {verdict.get('runs')} runs")
    return ("compiled FlexAttention on CPU is refused: PyTorch's C++ flex template was reported to give wrong results "
            f"(torch 2.14.1); `python -m fastzoo.attention.flex_cpu_repro` tests torch {torch.__version__} and lifts "
            f"the refusal if compiled and uncompiled flex agree ({seen}). Meanwhile run flex uncompiled on CPU "
            "(compile=False, and do not torch.compile the model), use another backend (sdpa, eager) under "
            "torch.compile, or compile on CUDA")


def _flex_fn(compile_: bool, device_type: str):
    """``flex_attention``, compiled or not (on CPU only where :func:`cpu_compile_refusal` allows it).

    Uncompiled (the CPU default, declared in the capability matrix) PyTorch would warn once per
    process, on stderr, that the scores are materialised and to compile it: fastzoo runs it so on
    purpose, so that one warning is marked shown at its source (torch's once-per-process record),
    which changes no warning filter of the user's and no graph.

    Compiled on CUDA, ``dynamic=None`` is PyTorch's automatic dynamic shapes: the first
    shape gets a specialised kernel and the first change of a size (a packed batch's T
    changes every step) recompiles once with that size symbolic, which flex's Triton
    template supports (flex marks only the head count and head dim static), instead of
    recompiling per length until the recompile limit as ``dynamic=False`` does. On CPU it is
    ``dynamic=False``: the C++ template was seen to fail with symbolic lengths.
    """
    if not compile_:
        shown = getattr(sys.modules["torch.nn.attention.flex_attention"], "_WARNINGS_SHOWN", None)
        if shown is not None:
            shown.add("flex_attention_performance")
        return flex_attention
    if device_type not in _compiled_flex:
        _compiled_flex[device_type] = torch.compile(flex_attention, dynamic=None if device_type == "cuda" else False)
    return _compiled_flex[device_type]


@torch.compiler.disable
def _refuse_compiled_on_cpu(backend: "FlexBackend"):
    """Raised outside the graph: a ``raise`` traced by dynamo would only break the graph, and
    the eager re-run (no longer compiling) would then pass silently."""
    raise BackendUnavailableError(backend._message([backend._cpu_refusal]))


class FlexBackend(AttentionBackend):
    name = "flex"
    description = "FlexAttention: score_mod/mask_mod presets softcap, causal, sliding_window, neighborhood"
    capabilities = Capabilities(
        devices={"cpu": FLOATS, "cuda": FLOATS},
        varlen=True,
        score_mod=True,
        kv_cache=True,
        gqa=True,  # flex_attention(enable_gqa=True)
        head_dim_on=(("cuda", 16, 1),),  # the Triton template's tiles: head dim >= 16
        window=True,  # the context's window joins its mask_mod
        softcap=True,  # the context's softcap as a score_mod, before the user's
        dropout=False,
        backward=("cuda",),
        verified=("CPU fp32 inference, uncompiled (torch 2.14.1); compiled on CPU refused until "
                  "`python -m fastzoo.attention.flex_cpu_repro` passes for the torch in use; "
                  "compiled on an H100 (torch 2.11): ViT-B/16 bf16/fp16/fp32"),
    )
    options = {
        "score_mod": None, "mask_mod": None, "block_mask": None,
        "softcap": 50.0, "window": 128, "radius": 3, "compile": None,
    }

    kernel_ops = r"FlexAttention|flex_attention|triton_tem"

    def kernel_profile(self, q, k, ctx):
        compiled = self.opts["compile"] if self.opts["compile"] is not None else q.is_cuda
        return KernelProfile(f"{self.label()}: FlexAttention ({'compiled' if compiled else 'not compiled'})", self.kernel_ops)

    def __init__(self, **options):
        super().__init__(**options)
        masks.check_mod_option("score_mod", self.opts["score_mod"], masks.SCORE_PRESETS)
        masks.check_mod_option("mask_mod", self.opts["mask_mod"], masks.MASK_PRESETS)
        bm = self.opts["block_mask"]
        if bm is not None and not isinstance(bm, BlockMask):
            raise TypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got {type(bm).__name__}")
        if bm is not None and self.opts["mask_mod"] is not None:
            raise ValueError("give either block_mask or mask_mod, not both: a block_mask already holds its mask_mod")
        self._cpu_refusal = cpu_compile_refusal()  # read here, not per call: a traced forward reads no file
        self._block_masks = {}  # (Sq, Sk, device) -> BlockMask for masks that do not depend on the batch

    def problems(self, req):
        problems = super().problems(req) + masks.request_problems(self.opts["mask_mod"], req)
        refusal = self.opts["compile"] and req.device in (None, "cpu") and cpu_compile_refusal()  # None: CPU parameters
        if refusal:
            problems.append(refusal)
        return problems

    def check_call(self, q, k, ctx):
        super().check_call(q, k, ctx)
        if not q.is_cuda and (self.opts["compile"] or tracing()) and self._cpu_refusal:
            _refuse_compiled_on_cpu(self)

    def _block_mask(self, ctx, B, Sq, Sk, device):
        user = self.opts["block_mask"]
        context_masks = ctx.causal or ctx.key_padding_mask is not None or ctx.cu_seqlens is not None  # (window: causal)
        if user is not None and not context_masks:
            if tuple(user.seq_lengths) != (Sq, Sk):
                raise ValueError(f"block_mask was built for {tuple(user.seq_lengths)} tokens, the input has ({Sq}, {Sk})")
            return user
        if user is not None:
            extra = user.mask_mod
        else:
            extra = masks.resolve_mask_mod(self.opts["mask_mod"], ctx, window=self.opts["window"], radius=self.opts["radius"])
        mask_mod = masks.context_mask_mod(ctx, Sq, extra, total_k=Sk, device=device)
        if mask_mod is None:
            return None
        if ctx.key_padding_mask is not None or ctx.cu_seqlens is not None:  # depends on this batch: once per forward
            batch = B if ctx.key_padding_mask is not None else None
            return ctx.cached((self.uid, "block_mask", B, Sq, Sk, ctx.window),
                              lambda: create_block_mask(mask_mod, batch, None, Sq, Sk, device=device))
        key = (Sq, Sk, str(device), ctx.causal, ctx.window, ctx.grid_size, ctx.num_prefix_tokens)
        if key not in self._block_masks:
            self._block_masks[key] = create_block_mask(mask_mod, None, None, Sq, Sk, device=device)
        return self._block_masks[key]

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        B, _, Sq, _ = q_BHSD.shape
        block_mask = self._block_mask(ctx, B, Sq, k_BHSD.shape[-2], q_BHSD.device)
        score_mod = masks.resolve_score_mod(self.opts["score_mod"], softcap_value=self.opts["softcap"])
        score_mod = masks.with_context_softcap(ctx, score_mod)
        compile_ = self.opts["compile"]
        compile_ = q_BHSD.is_cuda if compile_ is None else compile_
        return _flex_fn(compile_, q_BHSD.device.type)(q_BHSD, k_BHSD, v_BHSD, score_mod=score_mod, block_mask=block_mask, scale=ctx.scale,
                                  enable_gqa=k_BHSD.shape[1] != q_BHSD.shape[1])
