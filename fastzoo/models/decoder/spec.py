"""The decoder family as the rest of fastzoo reads it: variants, converters, tiny config, the original."""
from __future__ import annotations

from torch import nn

from fastzoo.models.decoder.convert import GPT2, GPT2_FASTZOO
from fastzoo.models.decoder.gpt2 import GPT2LMHeadModel
from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload


def hf_gpt2(cfg: dict) -> nn.Module:
    """transformers' GPT2LMHeadModel on fastzoo config fields, eager attention (the reference)."""
    from transformers import GPT2Config, GPT2LMHeadModel as HFGPT2

    return HFGPT2(GPT2Config(**cfg, attn_implementation="eager"))


def hf_as_users_run_it(model: nn.Module) -> nn.Module:
    """transformers' default attention: SDPA."""
    model.set_attn_implementation("sdpa")
    return model


def gpt2_flops(cfg, *, tokens: int, attended: int, train: bool = True) -> int:
    """Matmul FLOPs of one step over ``tokens`` tokens of which ``attended`` (query, key) pairs
    are computed (the sum of squared sequence lengths when packed, B * S^2 when padded)."""
    D, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
    per_token = cfg.n_layer * 2 * D * (3 * D + D + 2 * inner) + 2 * D * cfg.vocab_size
    forward = tokens * per_token + cfg.n_layer * 2 * 2 * attended * D
    return forward * (3 if train else 1)


def _gpt2(name: str, hf: str, n_embd: int, n_layer: int, n_head: int, what: str) -> Variant:
    return Variant(name, dict(vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head),
                   f"GPT-2 {what}, as Hugging Face's {hf} (GPT2LMHeadModel)", f"transformers GPT2LMHeadModel ({hf})")


GPT2_SPEC = ModelSpec(
    family="gpt2",
    task="causal-lm",
    model=GPT2LMHeadModel,
    variants=(
        _gpt2("gpt2", "gpt2", 768, 12, 12, "small (124M)"),
        _gpt2("gpt2_medium", "gpt2-medium", 1024, 24, 16, "medium (355M)"),
    ),
    converters=(GPT2, GPT2_FASTZOO),
    tiny=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
    original=Original(hf_gpt2, "transformers GPT2LMHeadModel (eager attention)", "attn_pdrop"),
    flops=gpt2_flops,
    bench=BenchSettings(
        variant="gpt2", library="HF", peer=hf_as_users_run_it, peer_attention="sdpa", compile=False,
        deterministic=dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        sizes={"bench": Workload("4x256, 8 seqs in [1,512]", dict(n_layer=4, n_embd=256, n_head=4), batch=8, max_len=512),
               "tour": Workload("GPT-2 4x256, 8 seqs of 1-128 tokens", dict(n_layer=4, n_embd=256, n_head=4), batch=8,
                                max_len=128),
               "quick": Workload("tiny GPT-2", dict(n_layer=1, n_embd=64, n_head=4, vocab_size=256), batch=4, max_len=32)}),
)
SPECS = (GPT2_SPEC,)
