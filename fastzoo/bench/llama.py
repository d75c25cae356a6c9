"""A Llama-layout training step on a realistic length mix: Hugging Face's ``LlamaForCausalLM``
padded to the longest sequence (the peer) against fastzoo's packed sequences, each step as users
write it (``model(..., labels=...).loss.backward()``; fastzoo's loss fused with the LM head).

The mix: sequence lengths drawn log-normally (median 128 tokens, clipped to [16, 1024]), the
shape of instruction-tuning data, where padding to the longest wastes most of a batch. The
work a padded step does over the packed one is the **FLOP-ratio bound** (padded FLOPs ÷ packed
FLOPs, counted by the family spec's ``flops``: linear layers on every padded token, attention on
B * S^2 pairs against the sum of squared lengths): packing can at most be that much faster by
skipping work alone; above it, the kernels themselves are faster too.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

import fastzoo
from fastzoo.bench.gpt2 import _Call
from fastzoo.bench.harness import Case, Group, Suite
from fastzoo.bench.steps import model_step
from fastzoo.losses import IGNORE_INDEX


@dataclass(frozen=True)
class LlamaSetting:
    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_seqs: int
    median_len: int
    max_len: int
    vocab_size: int = 32000

    def config(self) -> dict:
        return dict(model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                    intermediate_size=int(self.hidden_size * 8 / 3) // 8 * 8, num_hidden_layers=self.num_hidden_layers,
                    num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                    max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    def describe(self) -> str:
        return (f"Llama {self.num_hidden_layers} layers x {self.hidden_size} wide ({self.num_attention_heads} heads, "
                f"{self.num_key_value_heads} key/value heads), vocab {self.vocab_size}; {self.num_seqs} sequences, "
                f"lengths log-normal (median {self.median_len}) in [16, {self.max_len}]")

    def lengths(self, g: torch.Generator) -> list[int]:
        z = torch.randn(self.num_seqs, generator=g)
        return [int(min(max(16, round(math.exp(math.log(self.median_len) + 0.8 * float(x)))), self.max_len)) for x in z]


# The CPU target setting: a small Llama on 8 sequences, median 128 tokens.
TARGET_SETTING = LlamaSetting("4x256 GQA 8/2, 8 seqs, median 128", 4, 256, 8, 2, 8, 128, 1024)


def flop_bound(setting: LlamaSetting, lengths: list[int]) -> dict:
    """Training FLOPs padded to the longest and packed, and their ratio (the bound packing works against)."""
    from fastzoo.models.decoder.config import LlamaConfig
    from fastzoo.registry import get_entry

    cfg, flops = LlamaConfig.from_dict(setting.config()), get_entry("llama").spec.flops
    B, S = len(lengths), max(lengths)
    padded = flops(cfg, tokens=B * S, attended=B * S * S)
    packed = flops(cfg, tokens=sum(lengths), attended=sum(n * n for n in lengths))
    return {"padded FLOPs": padded, "packed FLOPs": packed, "FLOP-ratio bound": round(padded / packed, 3)}


def llama_suite(setting: LlamaSetting = TARGET_SETTING, *, backends: list[str], device="cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> Suite:
    from fastzoo.data import pack, pad_to_longest
    from fastzoo.models.decoder.spec import hf_llama

    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    lengths = setting.lengths(g)
    seqs = [torch.randint(0, setting.vocab_size, (n,), generator=g) for n in lengths]
    real = sum(lengths)
    config = {"model": setting.describe(), "lengths": lengths, "real tokens": real,
              "peer": "HF LlamaForCausalLM, attn_implementation='sdpa', padded to the longest, loss on its logits",
              "tokens/s": "real tokens only", **flop_bound(setting, lengths)}
    torch.manual_seed(seed)
    hf = hf_llama(setting.config())
    hf.config._attn_implementation = "sdpa"
    padded, packed = pad_to_longest(seqs), pack(seqs)
    labels = padded.input_ids.masked_fill(padded.attention_mask == 0, IGNORE_INDEX)
    padded_in = ((padded.input_ids.to(device),), {"attention_mask": padded.attention_mask.to(device), "labels": labels.to(device)})
    packed_in = ((packed.input_ids.to(device),), {"position_ids": packed.position_ids.to(device),
                                                   "cu_seqlens": packed.cu_seqlens.to(device),
                                                   "max_seqlen": packed.max_seqlen, "labels": packed.labels.to(device)})

    def loss_step(model, inputs):
        args, kwargs = inputs
        model = model.to(device=device, dtype=dtype).train()
        return model_step(_Call(model, lambda *a: model(*a, **kwargs)), args, mode="train", loss=lambda out: out.loss, items=real,
                          view=lambda out: out.loss.reshape(1))

    def fz(backend):
        return fastzoo.create("llama", attn=backend, pretrained=hf)

    def reference():  # fastzoo eager, padded, the loss on fp32 logits: the function every case computes
        model = fz("eager").to(device).train()
        args, kwargs = padded_in
        out = model(*args, attention_mask=kwargs["attention_mask"])
        from fastzoo.losses import causal_lm_loss

        loss = causal_lm_loss(out.logits.float(), kwargs["labels"])
        loss.backward()
        got = {"output": loss.detach().reshape(1)}
        got.update({f"grad:{n}": p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
        return got

    cases = [Case("HF padded to longest (sdpa), labels", lambda: loss_step(copy.deepcopy(hf), padded_in), peer=True),
             Case("fastzoo padded to longest (sdpa), labels: fused loss", lambda: loss_step(fz("sdpa"), padded_in))]
    for b in backends:
        if fastzoo.attention.backend_class(b).capabilities.varlen:
            cases.append(Case(f"fastzoo packed ({b}), labels: fused loss", lambda b=b: loss_step(fz(b), packed_in)))
    group = Group(f"{setting.name} | train with labels", cases, reference=reference, unit="tokens/s")
    return Suite("llama_packed", [group], config=config, dtype=dtype, device=device)

