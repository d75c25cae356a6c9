"""GPT-2 on variable-length batches: padding vs packing.

Sequence lengths are uniform in [1, max_len]. The peer is Hugging Face's
``GPT2LMHeadModel`` with SDPA attention, padded to the longest sequence (what a user
writes); HF padded to the maximum length and an HF loop that runs each sequence alone
are timed too. fastzoo runs padded (to max, to longest), as a jagged NestedTensor, and
packed (``fastzoo.data.pack``: one row, ``cu_seqlens``) with every requested backend that
takes packed sequences. Throughput counts real tokens only. Parity compares the logits
of real tokens, sequence by sequence, with fastzoo's eager model padded to the longest.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

import fastzoo
from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.bench.steps import check_mode, model_step
from fastzoo.losses import IGNORE_INDEX, causal_lm_loss


@dataclass(frozen=True)
class GPT2Setting:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    num_seqs: int
    max_len: int
    vocab_size: int = 50257

    def describe(self) -> str:
        return (f"GPT-2 {self.n_layer} layers x {self.n_embd} wide ({self.n_head} heads), vocab {self.vocab_size}; "
                f"{self.num_seqs} sequences, lengths uniform in [1, {self.max_len}]")


# The CPU target setting: a small GPT-2 on 8 sequences of 1..512 tokens.
TARGET_SETTING = GPT2Setting("4x256, 8 seqs in [1,512]", 4, 256, 4, 8, 512)


def _hf_model(s: GPT2Setting, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, vocab_size=s.vocab_size,
                     n_positions=max(1024, s.max_len), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=s.vocab_size - 1, eos_token_id=s.vocab_size - 1, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg).eval()


def _lengths(s: GPT2Setting, g: torch.Generator) -> list[int]:
    return torch.randint(1, s.max_len + 1, (s.num_seqs,), generator=g).tolist()


def _padded(seqs: list[torch.Tensor], width: int):
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return ids, mask


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def gpt2_suite(
    setting: GPT2Setting = TARGET_SETTING,
    *,
    backends: list[str],
    modes=("eval", "train"),
    compile_modes=(False,),
    device="cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Suite:
    device = torch.device(device)
    s = setting
    config = {"model": s.describe(), "peer": "HF GPT2LMHeadModel, attn_implementation='sdpa', padded to the longest",
              "tokens/s": "real tokens only"}
    from fastzoo.data import nested, pack

    hf = _hf_model(s, seed)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, s.vocab_size, (n,), generator=g) for n in _lengths(s, g)]
    real = sum(len(x) for x in seqs)
    config["lengths"] = [len(x) for x in seqs]
    config["real tokens"] = real
    targets = torch.cat(seqs).to(device)
    longest = max(len(x) for x in seqs)
    pad_max, pad_long = _padded(seqs, s.max_len), _padded(seqs, longest)
    on = lambda t: t.to(device)  # noqa: E731
    packed = pack(seqs).to(device)
    packed_args = (packed.input_ids,)
    packed_kwargs = dict(position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen)

    def padded_view(mask_BS):
        return lambda out: _logits(out)[mask_BS.to(device).bool()]  # [T_real, V], sequence by sequence

    def packed_view(out):
        return _logits(out)[0]

    def nested_view(out):
        out = _logits(out)
        return torch.cat(out.unbind()) if out.is_nested else out.reshape(-1, out.shape[-1])

    def loss_on(view):
        return lambda out: F.cross_entropy(view(out).float(), targets)

    def step(model, mode, compiled, args, kwargs, view):
        fwd = (lambda *a: model(*a, **kwargs)) if kwargs else model
        wrapped = _Call(model, fwd)
        return model_step(wrapped, args, mode=mode, loss=loss_on(view), items=real, compile=compiled, view=view)

    def fz(attn):
        model = fastzoo.create("gpt2", attn="eager", pretrained=hf)
        model.set_attention(attn, device=device, dtype=dtype)
        return model.to(device=device, dtype=dtype)

    def hf_copy():
        return copy.deepcopy(hf).to(device=device, dtype=dtype)

    layouts = {  # name -> (positional inputs, keyword inputs, view of the real tokens' logits)
        "longest": ((on(pad_long[0]),), {"attention_mask": on(pad_long[1])}, padded_view(pad_long[1])),
        "max": ((on(pad_max[0]),), {"attention_mask": on(pad_max[1])}, padded_view(pad_max[1])),
        "packed": (packed_args, packed_kwargs, packed_view),
        "nested": ((nested(seqs).to(device),), {}, nested_view),
    }

    def hf_case(layout, mode, compiled):
        def build():
            model = hf_copy()
            if layout == "loop":
                return _fastzoo_layout(step(_HFLoop(model, [on(x) for x in seqs]), mode, compiled, (), {}, lambda o: o), model)
            return _fastzoo_layout(step(model, mode, compiled, *layouts[layout]), model)
        return build

    def fz_case(backend, layout, mode, compiled):
        return lambda: step(fz(backend), mode, compiled, *layouts[layout])

    @cache
    def reference(mode):
        model = fastzoo.create("gpt2", attn="eager", pretrained=hf).to(device)
        return step(model, mode, False, *layouts["longest"]).outputs()

    groups = []
    for mode in map(check_mode, modes):
        for c in compile_modes:
            cases = [
                Case("HF padded to longest (sdpa)", hf_case("longest", mode, c), peer=True, compiled=c),
                Case("HF padded to max (sdpa)", hf_case("max", mode, c), compiled=c),
                Case("HF loop, one sequence at a time", hf_case("loop", mode, c), compiled=c),
            ]
            for b in backends:
                caps = fastzoo.attention.backend_class(b).capabilities
                if b == "nested":  # its own input: a jagged NestedTensor of ids
                    cases.append(Case("fastzoo nested", fz_case(b, "nested", mode, c), compiled=c))
                    continue
                if caps.padding_mask:
                    cases.append(Case(f"fastzoo padded to longest ({b})", fz_case(b, "longest", mode, c),
                                      reference=b == "eager", compiled=c))
                if caps.padding_mask and b == "sdpa":
                    cases.append(Case(f"fastzoo padded to max ({b})", fz_case(b, "max", mode, c), compiled=c))
                if caps.varlen:
                    cases.append(Case(f"fastzoo packed ({b})", fz_case(b, "packed", mode, c), compiled=c))
            groups.append(Group(f"{s.name} | {mode}" + (" | compiled" if c else ""), cases,
                                reference=lambda m=mode: reference(m), unit="tokens/s"))
    if "train" in modes:
        groups.append(_labels_group(s, hf, seqs, pad_long, packed, backends, real, hf_copy, fz, device))
    if "eval" in modes:
        groups.append(_generate_group(s, seqs, backends, hf_copy, fz, device))
    return Suite("gpt2_varlen", groups, config=config, dtype=dtype, device=device)


def _labels_group(s, hf, seqs, pad_long, packed, backends, real, hf_copy, fz, device) -> Group:
    """A training step as users write it: ``model(..., labels=...).loss.backward()``. HF computes
    the logits and ``cross_entropy`` on them; fastzoo in train mode computes the loss from the
    hidden states with the fused ``linear_cross_entropy`` (no ``[tokens, 50257]`` logits)."""
    ids, mask = pad_long
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX).to(device)  # HF's convention: padding not scored
    padded_kwargs = {"attention_mask": mask.to(device), "labels": labels}
    packed_kwargs = dict(position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen,
                         labels=packed.labels)

    def loss_step(model, args, kwargs):
        return model_step(_Call(model, lambda *a: model(*a, **kwargs)), args, mode="train", loss=lambda out: out.loss,
                          items=real, view=lambda out: out.loss.reshape(1))

    def hf_case():
        model = hf_copy()
        return _fastzoo_layout(loss_step(model, (ids.to(device),), padded_kwargs), model)

    def fz_case(backend, args, kwargs):
        return lambda: loss_step(fz(backend), args, kwargs)

    def reference():  # fp32 logits materialised, HF's loss on them: the function both sides compute
        model = fastzoo.create("gpt2", attn="eager", pretrained=hf).to(device).train()
        h_ids = ids.to(device)
        out = model(h_ids, attention_mask=mask.to(device))
        logits = _logits(out).float()
        loss = causal_lm_loss(logits, labels)
        loss.backward()
        got = {"output": loss.detach().reshape(1)}
        got.update({f"grad:{n}": p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
        return got

    cases = [Case("HF padded to longest (sdpa), labels", hf_case, peer=True)]
    for b in backends:
        caps = fastzoo.attention.backend_class(b).capabilities
        if caps.padding_mask and b in ("eager", "sdpa"):
            cases.append(Case(f"fastzoo padded to longest ({b}), labels: fused loss",
                              fz_case(b, (ids.to(device),), padded_kwargs), reference=b == "eager"))
        if caps.varlen:
            cases.append(Case(f"fastzoo packed ({b}), labels: fused loss", fz_case(b, (packed.input_ids,), packed_kwargs)))
    return Group(f"{s.name} | train with labels", cases, reference=reference, unit="tokens/s", cpu_memory=True)


GENERATE_NEW_TOKENS = 32


def _generate_group(s, seqs, backends, hf_copy, fz, device) -> Group:
    """``generate`` with the KV cache, greedy, on the suite's sequences as left-padded prompts
    (each cut to at most 64 tokens): HF's ``generate`` against fastzoo's (transformers'
    GenerationMixin driving fastzoo's forward and cache). Throughput counts new tokens; parity
    is the generated ids, which must be equal token for token."""
    from fastzoo.data import pad_to_longest

    prompts = pad_to_longest([x[-64:] for x in seqs], side="left")
    ids, mask = prompts.input_ids.to(device), prompts.attention_mask.to(device)
    kw = dict(attention_mask=mask, max_new_tokens=GENERATE_NEW_TOKENS, min_new_tokens=GENERATE_NEW_TOKENS,
              do_sample=False, use_cache=True, pad_token_id=0)
    items = GENERATE_NEW_TOKENS * ids.shape[0]

    def step(model):
        model.eval()
        out = {}

        def run():
            with torch.no_grad():
                out["ids"] = model.generate(ids, **kw)
            return out["ids"]

        return Step(run, items, outputs=lambda: {"output": (out["ids"] if "ids" in out else run()).float()})

    def fz_case(backend):
        return lambda: step(fz(backend))

    cases = [Case("HF generate, KV cache (sdpa)", lambda: step(hf_copy()), peer=True)]
    for b in backends:
        if fastzoo.attention.backend_class(b).capabilities.kv_cache:
            cases.append(Case(f"fastzoo generate, KV cache ({b})", fz_case(b), reference=b == "eager"))
    reference = lambda: step(hf_copy()).outputs()  # noqa: E731  HF's tokens: every case must equal them
    return Group(f"{s.name} | generate {GENERATE_NEW_TOKENS} tokens, greedy, left-padded prompts", cases,
                 reference=reference, unit="new tokens/s")


def _fastzoo_layout(step, hf_model):
    """HF keeps GPT-2's projections as ``Conv1D`` (weight [in, out]); fastzoo, with the same
    names, as ``nn.Linear`` ([out, in]). Transpose those gradients so every one is compared."""
    conv1d = {f"grad:{n}.weight" for n, m in hf_model.named_modules() if type(m).__name__ == "Conv1D"}
    outputs = step.outputs
    step.outputs = lambda: {k: v.t() if k in conv1d else v for k, v in outputs().items()}
    return step


class _Call(torch.nn.Module):
    """A model with its keyword inputs bound, so the step calls it with positional inputs only
    (and ``torch.compile`` compiles the model, keywords included). Parameter names stay the model's."""

    def __init__(self, model, fwd):
        super().__init__()
        self.model = model
        self._fwd = fwd

    def forward(self, *args):
        return self._fwd(*args)

    def named_parameters(self, *a, **k):
        return self.model.named_parameters(*a, **k)


class _HFLoop(torch.nn.Module):
    """Hugging Face GPT-2 run on each sequence alone (no padding at all, no batching);
    returns the logits of every token, sequence after sequence."""

    def __init__(self, hf, seqs):
        super().__init__()
        self.hf = hf
        self.seqs = seqs

    def forward(self):
        return torch.cat([self.hf(x[None]).logits[0] for x in self.seqs])

    def named_parameters(self, *a, **k):
        return self.hf.named_parameters(*a, **k)
