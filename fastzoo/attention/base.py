"""The attention contract every backend follows.

A backend receives ``q_BHSD, k_BHSD, v_BHSD`` (batch, heads, sequence, head dim; the
layout of ``F.scaled_dot_product_attention``) and an :class:`AttnContext`, and returns
``o_BHSD``. Packed sequences use a batch of one, ``S = T`` tokens, and ``ctx.cu_seqlens``.

Causal attention is bottom-right aligned: with ``Sq`` queries and ``Sk`` keys, query ``i``
sees keys ``j <= i + Sk - Sq`` (the queries are the last ``Sq`` positions). With
``Sq == Sk`` that is the usual top-left triangle; ``Sq < Sk`` is decoding with a KV cache
(the keys of earlier steps plus the new ones), which a backend serves only if it declares
``kv_cache`` (SDPA's ``is_causal`` and a plain lower-triangular mask are top-left: they
would let the first new token see nothing of the cache). A key-padding mask then covers
all ``Sk`` keys.

Packed sequences with a KV cache carry the keys' own offsets: ``ctx.cu_seqlens`` (and
``max_seqlen``) splits the ``Tq`` queries, ``ctx.cu_seqlens_k`` (and ``max_seqlen_k``) the
``Tk`` keys into the same number of sequences, with ``Sq_n <= Sk_n`` for each; causal is
then bottom-right aligned per sequence (query ``i`` of sequence ``n`` sees that sequence's
keys ``j <= i + Sk_n - Sq_n``), the same rule as above, one sequence at a time, as
FlashAttention's ``flash_attn_varlen_func(cu_seqlens_q, cu_seqlens_k, ...)`` does. Without
``cu_seqlens_k`` queries and keys share ``cu_seqlens`` (self-attention: ``Tq == Tk``). A
backend serves packed keys with their own offsets if it declares both ``varlen`` and
``kv_cache``.

Grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q`` (``Hkv`` dividing
``Hq``; query head ``h`` reads key/value head ``h // (Hq // Hkv)``, as Llama's ``repeat_kv``).
A backend declaring ``gqa`` takes them as they are; for any other the contract repeats them
(:func:`repeat_kv`) before its ``forward``, so a model never repeats them itself.

Sliding-window attention (``ctx.window``, Mistral's / Qwen2's ``sliding_window``): a query at
position ``i`` sees the keys ``j`` with ``i - j < window``, itself and the ``window - 1`` keys
before it (transformers' ``sliding_window_causal_mask_function``); it is causal, and with a KV
cache ``i`` is the query's position among the keys (bottom-right), per packed sequence. Only
a backend declaring ``window`` is given it; the others are refused, naming it.

Soft-capping (``ctx.softcap``, Gemma 2's ``attn_logit_softcapping``): the scaled scores become
``softcap * tanh(score / softcap)`` before the mask and the softmax. Only a backend declaring
``softcap`` is given it; the others are refused at create, naming it (never dropped silently).

Each backend declares :class:`Capabilities`. Models state what they need as an
:class:`AttnRequest`; :meth:`AttentionBackend.check` compares the two when a model is
built or its backend is switched, so that an impossible request fails before the first
forward with a message that names the missing piece.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from fastzoo.attention.availability import package_available, unavailable  # noqa: F401  (re-exported)
from fastzoo.errors import BackendUnavailableError
from fastzoo.text import dtype_name  # noqa: F401  (re-exported: backends name dtypes in messages)
from fastzoo.tracing import tracing

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
FLOATS, HALF = (FP32, BF16, FP16), (BF16, FP16)  # the dtype sets backends declare


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve. ``devices`` maps a device type to the dtypes it takes there."""

    devices: dict[str, tuple[torch.dtype, ...]]
    causal: bool = True
    padding_mask: bool = True
    varlen: bool = False
    score_mod: bool = False
    kv_cache: bool = False  # causal with fewer queries than keys (Sq < Sk), bottom-right aligned
    gqa: bool = False  # takes k/v with fewer heads than q itself (else the contract repeats them)
    window: bool = False  # sliding-window causal attention (ctx.window)
    softcap: bool = False  # scores soft-capped, cap * tanh(score / cap), before the mask (ctx.softcap)
    dropout: bool = True  # attention dropout (ctx.dropout_p > 0)
    backward: tuple[str, ...] = ("cpu", "cuda")  # device types on which backward works
    # runs inside non-reentrant torch.utils.checkpoint (gradient checkpointing): what it saves for the
    # backward passes checkpoint's hooks and is recomputed alike
    checkpoint: bool = True
    compile: bool = True
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    head_dim_on: tuple[tuple[str, int, int], ...] = ()  # (device, minimum, multiple): limits on that device only
    min_cuda_capability: tuple[int, int] | None = None
    packages: tuple[str, ...] = ()  # import names the backend needs
    install: str | None = None  # how to get those packages
    # "module:attribute" that must be true once the packages import: their compiled kernels loaded
    # (xFormers imports without its C++/CUDA extension when the wheel was built for another torch)
    kernels_loaded: str | None = None
    verified: str = "not verified on hardware"  # where parity was last shown

    def dtypes_text(self) -> str:
        return "; ".join(f"{dev}: {'/'.join(dtype_name(d) for d in dts)}" for dev, dts in self.devices.items())


@dataclass
class AttnContext:
    """Per-forward facts about the attention a model asks for.

    A model builds one context per forward and hands it to every layer; treat it as
    read-only. A layer whose ``scale`` or ``dropout_p`` differs derives its own with
    :meth:`replace`, which keeps the shared :meth:`cached` store: masks and packing
    metadata that depend only on the batch (a dense padding mask, a flex ``BlockMask``,
    document ids, an xFormers bias) are built by the first layer and reused by the others.
    """

    causal: bool = False  # bottom-right aligned when there are fewer queries than keys (KV cache)
    key_padding_mask: torch.Tensor | None = None  # [B, Sk] bool over the keys, True = real token
    cu_seqlens: torch.Tensor | None = None  # [N+1] int32 offsets of packed sequences along S (the queries')
    max_seqlen: int | None = None
    cu_seqlens_k: torch.Tensor | None = None  # [N+1] offsets of the keys' sequences (KV cache); None: cu_seqlens
    max_seqlen_k: int | None = None
    scale: float | None = None  # None: 1/sqrt(head_dim)
    dropout_p: float = 0.0
    window: int | None = None  # sliding window: query i sees keys j with i - j < window (causal); None: all
    softcap: float | None = None  # scaled scores become softcap * tanh(score / softcap); None: not capped
    # where the scale goes in a kernel that writes the scores out (eager): on the product q k^T (transformers'
    # eager_attention_forward) or, False, on q before it (timm's Attention); the same function, rounded otherwise
    scale_scores: bool = False
    grid_size: tuple[int, int] | None = None  # ViT patch grid (rows, cols), for 2-D masks
    num_prefix_tokens: int = 0  # class/register tokens before the patch tokens
    _cache: dict = field(default_factory=dict, repr=False, compare=False)  # see cached()

    def cached(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()`` once per forward: later calls with the same ``key`` get the first result.

        ``key`` names what the value depends on beyond the context's own fields (who built
        it, shapes); the context's masks and offsets are fixed for its lifetime.
        """
        if any(isinstance(k, (torch.SymInt, torch.fx.Proxy)) for k in key):
            return build()  # a traced size (export's dynamic batch, FX) is no dict key: build per call
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def replace(self, **changes) -> "AttnContext":
        """A copy with ``changes`` (e.g. a layer's own ``scale``) sharing this context's cache."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class AttnRequest:
    """What a model needs from its attention backend. ``None`` means: not known yet."""

    head_dim: int
    causal: bool = False
    padding_mask: bool = False  # the model's forward takes key-padding masks (GPT-2's attention_mask)
    varlen: bool = False  # the model's forward takes packed sequences (cu_seqlens)
    unpads: bool = False  # the model packs a padded batch itself for a backend with varlen but no padding mask
    kv_cache: bool = False  # decoding with a KV cache: causal with Sq < Sk (packed: keys with their own offsets)
    window: bool = False  # some layer attends through a sliding window (its ctx.window)
    softcap: bool = False  # some layer soft-caps its attention scores (its ctx.softcap)
    gqa: bool = False  # k/v have fewer heads than q: served by any backend (repeated where not native)
    grid_2d: bool | None = None  # the model gives ctx.grid_size (ViT patches), for 2-D masks
    attn_dropout: float = 0.0  # the largest attention dropout the model is configured with
    attn_dropout_field: str = "attention dropout"  # the config field that sets it, for messages
    device: str | None = None
    dtype: torch.dtype | None = None
    backward: bool | None = None
    checkpoint: bool = False  # the layers run inside non-reentrant torch.utils.checkpoint (gradient checkpointing)
    at_call: bool = False  # made from one call's tensors (AttentionBackend.call_request): wording of refusals


@dataclass(frozen=True)
class KernelProfile:
    """What one call's requested kernel looks like in a ``torch.profiler`` trace, as the backend
    that runs it declares (``fastzoo.explain`` asks backends; it knows none by name).

    ``ops``: a regex that some executed op name matches when the requested kernel ran; None:
    plain tensor ops only (no fused attention op may run). ``fallbacks``: ``(regex, why)`` for
    each other op the call may run instead and why it would; ``missing``: why, when neither shows.
    """

    requested: str
    ops: str | None
    fallbacks: tuple[tuple[str, str], ...] = ()
    missing: str | None = None
    checked: bool = True  # False: a user's backend, whose kernels fastzoo cannot know


class AttentionBackend:
    """Base class: subclasses set ``name`` and ``capabilities`` and implement :meth:`forward`.

    Options passed to the constructor are the backend's own (``sdpa_backend=`` for sdpa,
    ``score_mod=`` for flex...). A subclass lists them in ``options`` with their defaults.
    """

    name: ClassVar[str] = "?"
    capabilities: Capabilities  # class default; an instance may narrow it from its options
    options: ClassVar[dict] = {}
    variants: ClassVar[tuple[dict, ...]] = ()  # option sets that pick another kernel: a matrix row each
    description: ClassVar[str] = ""
    # The fused attention ops (forward and backward) this backend's kernels show in a profiler
    # trace, as one regex; None: plain tensor ops only. fastzoo.explain recognises attention
    # kernels by the union of these and checks each call against kernel_profile().
    kernel_ops: ClassVar[str | None] = None
    # Names of the backends this machine runs, said in every refusal. The registry
    # (fastzoo.attention) installs it: this module sits below the registry and cannot import it.
    available_here: ClassVar[Callable[[], list[str]]] = staticmethod(lambda: [])

    def __init__(self, **options):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(sorted(self.options)) or "none"
            raise TypeError(f"attention backend {self.name!r} got unknown option(s) {unknown}; its options are: {known}")
        self.opts = {**self.options, **options}
        self.uid = next(_INSTANCE_IDS)  # keys this instance's entries in AttnContext.cached

    # -- availability ---------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend (with default options) cannot run on this machine at all, or None."""
        return unavailable(cls.capabilities)

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    def check(self, req: AttnRequest) -> None:
        """Raise :class:`BackendUnavailableError` if this backend cannot serve ``req``, naming every problem."""
        problems = self.problems(req)
        if problems:
            raise BackendUnavailableError(self._message(problems))

    def problems(self, req: AttnRequest) -> list[str]:
        """What keeps this backend (with its options) from serving ``req``; a subclass adds its own."""
        reason = unavailable(self.capabilities)
        return ([reason] if reason else []) + capability_problems(self.capabilities, req)

    def _message(self, problems: list[str]) -> str:
        here = ", ".join(AttentionBackend.available_here())
        text = f"attention backend {self.name!r} " + "; ".join(problems)
        return text.rstrip(".") + f". Available on this machine: {here}."

    @staticmethod
    def call_request(q: torch.Tensor, k: torch.Tensor, ctx: AttnContext) -> AttnRequest:
        """The request one call makes, read from its tensors and context (no device sync)."""
        Sq, Sk = q.shape[-2], k.shape[-2]
        return AttnRequest(
            head_dim=q.shape[-1], causal=ctx.causal, padding_mask=ctx.key_padding_mask is not None,
            varlen=ctx.cu_seqlens is not None, kv_cache=bool(ctx.causal and Sq != Sk) or ctx.cu_seqlens_k is not None,
            window=ctx.window is not None, softcap=ctx.softcap is not None, gqa=k.shape[1] != q.shape[1], attn_dropout=ctx.dropout_p,
            attn_dropout_field="dropout_p", device=q.device.type, dtype=q.dtype,
            backward=torch.is_grad_enabled() and q.requires_grad, at_call=True,
        )

    def check_call(self, q: torch.Tensor, k: torch.Tensor, ctx: AttnContext) -> None:
        """Per-forward check of what is only known at call time: the same rule as at create
        (:meth:`problems`) on the call's own request (cheap: no device sync)."""
        problems = self.problems(self.call_request(q, k, ctx))
        if problems:
            raise BackendUnavailableError(self._message(problems))

    # -- what a profiler shows -----------------------------------------------------------
    def label(self) -> str:
        """The backend's name with the options that differ from its defaults (callables left out)."""
        changed = {k: v for k, v in self.opts.items() if v != self.options.get(k) and not callable(v)}
        return self.name + (f" ({', '.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")

    def kernel_profile(self, q: torch.Tensor, k: torch.Tensor, ctx: AttnContext) -> KernelProfile:
        """The kernel this call asks for and how a profiler shows it ran: by default any op of
        :attr:`kernel_ops` (with none declared, plain tensor ops). Backends whose kernel
        depends on the call (a pinned SDPA kernel, varlen's pick) say so here."""
        return KernelProfile(self.label(), self.kernel_ops, checked=self.kernel_ops is not None)

    # -- compute --------------------------------------------------------------------
    def __call__(self, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        if isinstance(q_BHSD, torch.fx.Proxy):  # symbolic tracing: record the kernel; create checked the request
            return self.forward(q_BHSD, k_BHSD, v_BHSD, ctx)
        groups = kv_groups(q_BHSD, k_BHSD, v_BHSD)
        check_context(ctx, q_BHSD.shape[-2], k_BHSD.shape[-2])
        self.check_call(q_BHSD, k_BHSD, ctx)
        if q_BHSD.numel() == 0:  # no queries (S == 0 or B == 0): every kernel's answer is the empty output
            return v_BHSD.new_zeros(*q_BHSD.shape[:-1], v_BHSD.shape[-1])
        if groups > 1 and not self.capabilities.gqa:
            k_BHSD, v_BHSD = repeat_kv(k_BHSD, groups), repeat_kv(v_BHSD, groups)
        return self.forward(q_BHSD, k_BHSD, v_BHSD, ctx)

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx: AttnContext) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.opts.items() if v != self.options.get(k)}
        args = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        return f"{type(self).__name__}({args})"


_INSTANCE_IDS = itertools.count()


def capability_problems(caps: Capabilities, req: AttnRequest) -> list[str]:
    """The capability rule, written once: what of ``req`` a kernel declaring ``caps`` cannot
    serve. ``create`` / ``set_attention`` ask it with the model's request, every call with the
    call's own (:meth:`AttentionBackend.call_request`), and varlen's automatic pick with each
    kernel's capabilities in turn. Availability on this machine is :func:`fastzoo.attention.availability.unavailable`."""
    problems = []
    at_call = req.at_call
    dev = req.device
    if dev is not None and dev not in caps.devices:
        problems.append(f"{'got tensors on' if at_call else 'does not run on'} {dev} (runs on {'/'.join(caps.devices)})")
    elif dev is not None and req.dtype is not None and req.dtype not in caps.devices[dev]:
        problems.append(f"got {dtype_name(req.dtype)} on {dev} ({caps.dtypes_text()}); use autocast or .to(dtype)" if at_call
                        else f"does not take {dtype_name(req.dtype)} on {dev} ({caps.dtypes_text()})")
    if caps.max_head_dim is not None and req.head_dim > caps.max_head_dim:
        problems.append(f"supports head dim <= {caps.max_head_dim}, the model has {req.head_dim}")
    if req.head_dim % caps.head_dim_multiple:
        problems.append(f"needs a head dim divisible by {caps.head_dim_multiple}, the model has {req.head_dim}")
    for device, least, multiple in caps.head_dim_on:
        if dev == device and (req.head_dim < least or req.head_dim % multiple):
            need = " and ".join(w for w in (f">= {least}" if least > 1 else "", f"divisible by {multiple}" if multiple > 1 else "") if w)
            problems.append(f"needs a head dim {need} on {device}, the model has {req.head_dim}")
    if req.causal and not caps.causal:
        problems.append("has no causal masking, which this model needs")
    if req.padding_mask and not caps.padding_mask and not (req.unpads and caps.varlen):
        problems.append("takes no key-padding mask, which this model needs")
    if req.varlen and not caps.varlen:
        problems.append("takes no packed sequences (cu_seqlens), which this model needs")
    if req.kv_cache and not caps.kv_cache:
        problems.append("cannot attend with a KV cache (causal with fewer queries than keys, or packed keys with their "
                        "own offsets cu_seqlens_k), which generation needs: pass use_cache=False, or pick a backend "
                        "with kv_cache (eager, sdpa, varlen, nested)")
    if req.window and not caps.window:
        problems.append("has no sliding-window attention (window), which this model needs: pick a backend with "
                        "window (eager, sdpa, flex, varlen)")
    if req.softcap and not caps.softcap:
        problems.append("has no attention-logit soft-capping (softcap), which this model needs (its attention scores are "
                        "capped, Gemma 2's attn_logit_softcapping): pick a backend with softcap (eager, flex, fa2, fa3, fa4)")
    if req.attn_dropout > 0 and not caps.dropout:
        problems.append(
            f"has no attention dropout (got dropout_p={req.attn_dropout:g}): set the model's attention dropout to 0"
            if at_call else
            f"has no attention dropout, and this model is configured with {req.attn_dropout_field}={req.attn_dropout:g}: "
            f"build it with {req.attn_dropout_field}=0.0, or pick a backend with dropout"
        )
    if req.backward and dev is not None and dev not in caps.backward:
        problems.append(f"has no backward on {dev}: run under torch.no_grad() / inference_mode, or pick another backend"
                        if at_call else f"has no backward on {dev} (backward on: {'/'.join(caps.backward) or 'none'})")
    if req.checkpoint and not caps.checkpoint:
        problems.append("cannot run inside non-reentrant gradient checkpointing (torch.utils.checkpoint), which this "
                        "model asks for: call gradient_checkpointing_disable(), pass gradient_checkpointing_kwargs="
                        "{'use_reentrant': True} where the model takes it, or pick a backend with checkpoint (eager, "
                        "sdpa, varlen)")
    return problems


def kv_groups(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor) -> int:
    """How many query heads share one key/value head (1 without grouped-query attention)."""
    Hq, Hk = q_BHSD.shape[1], k_BHSD.shape[1]
    if v_BHSD.shape[1] != Hk or Hq % Hk:
        raise ValueError(f"k, v: grouped-query attention needs as many key as value heads, dividing the {Hq} query "
                         f"heads (num_kv_heads divides num_heads); got k {tuple(k_BHSD.shape)}, v {tuple(v_BHSD.shape)}")
    return Hq // Hk


def repeat_kv(x_BHSD: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, Hkv * groups, S, D]``: each key/value head serves ``groups``
    consecutive query heads (Llama's ``repeat_kv``, SDPA's ``enable_gqa``). The one place K/V
    are repeated, for backends that do not declare ``gqa``."""
    if groups == 1:
        return x_BHSD
    B, H, S, D = x_BHSD.shape
    return x_BHSD[:, :, None].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)


def check_context(ctx: AttnContext, Sq: int, Sk: int) -> None:
    """Refuse a context that does not fit the call's sizes, naming the argument (the packed
    key offsets read once per forward: one host read)."""
    if ctx.cu_seqlens_k is not None and ctx.cu_seqlens is None:
        raise ValueError("cu_seqlens_k: the keys' offsets go with the queries' cu_seqlens; give both")
    if ctx.cu_seqlens is not None and ctx.cu_seqlens_k is None and Sq != Sk:
        raise ValueError(f"cu_seqlens: {Sq} packed queries and {Sk} keys share one set of offsets only when the "
                         "counts are equal; give the keys' own offsets as cu_seqlens_k (a KV cache)")
    if ctx.window is not None and (not ctx.causal or isinstance(ctx.window, bool) or int(ctx.window) < 1):
        raise ValueError(f"window: a sliding window is a positive number of keys on a causal context (query i sees "
                         f"keys j with i - j < window), got window={ctx.window!r} with causal={ctx.causal}")
    if ctx.cu_seqlens_k is not None and not tracing():  # once per forward (one host read)
        ctx.cached(("checked cu_seqlens_k", Sk), lambda: check_seqlens(ctx.cu_seqlens, ctx.cu_seqlens_k, Sk, ctx.causal))


def check_offsets(name: str, first: int, shortest: int, last: int, total: int, what: str) -> None:
    """The rule for packed offsets, written once: ``[N+1]`` offsets from 0 to ``total`` (the
    number of ``what``), strictly increasing (no empty sequence). Takes the values already read
    on the host (callers batch that read with their other checks)."""
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {first}")
    if shortest <= 0:
        raise ValueError(f"{name} must be strictly increasing (no empty sequence), got a sequence of {shortest}")
    if last != total:
        raise ValueError(f"{name} must end at {total} (the number of {what}), got {last}")


def check_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int, causal: bool = True) -> None:
    """Refuse key offsets (``ctx.cu_seqlens_k``) that do not fit the keys, naming the argument:
    as many sequences as the queries' offsets, from 0 to ``total_k``, each (causal: the queries
    are its last positions) with at least as many keys as queries. One host read; :meth:`AttentionBackend.__call__` runs it once per
    forward, before any kernel reads past a sequence's end."""
    if cu_seqlens_k.ndim != 1 or cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k must be [N+1] like cu_seqlens ({cu_seqlens_q.numel()} offsets), "
                         f"got shape {tuple(cu_seqlens_k.shape)}")
    cu_k, cu_q = cu_seqlens_k.long().cpu(), cu_seqlens_q.long().cpu()
    len_k, len_q = cu_k[1:] - cu_k[:-1], cu_q[1:] - cu_q[:-1]
    check_offsets("cu_seqlens_k", int(cu_k[0]), int(len_k.min()), int(cu_k[-1]), total_k, "keys")
    if causal and bool((len_k < len_q).any()):
        raise ValueError(f"cu_seqlens_k: each sequence needs at least as many keys as queries (the queries are "
                         f"its last positions), got key lengths {len_k.tolist()} for query lengths {len_q.tolist()}")


# What a function registered without capabilities= is trusted with: a plain
# softmax(q k^T) v that may ignore ctx entirely. It can then never silently drop a mask:
# a model that needs causal / padding / packed attention or dropout is refused at create.
FUNCTION_DEFAULT_CAPABILITIES = Capabilities(
    devices={"cpu": FLOATS, "cuda": FLOATS},
    causal=False, padding_mask=False, varlen=False, score_mod=False, dropout=False,
    verified="user function: not verified by fastzoo",
)


class FunctionBackend(AttentionBackend):
    """Wraps a user's ``fn(q_BHSD, k_BHSD, v_BHSD, ctx) -> o_BHSD`` with declared capabilities."""

    fn: ClassVar[Callable]

    def kernel_profile(self, q, k, ctx):
        return KernelProfile(f"{self.label()} (user backend)", None, checked=False)

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        return type(self).fn(q_BHSD, k_BHSD, v_BHSD, ctx)
