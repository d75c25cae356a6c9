"""The decoder family as the rest of fastzoo reads it: variants, converters, tiny config, the original."""
from __future__ import annotations

from torch import nn

from fastzoo.models.decoder.convert import GPT2, GPT2_FASTZOO
from fastzoo.models.decoder.gpt2 import GPT2LMHeadModel
from fastzoo.models.spec import ModelSpec, Original, Variant


def hf_gpt2(cfg: dict) -> nn.Module:
    """transformers' GPT2LMHeadModel on fastzoo config fields, eager attention (the reference)."""
    from transformers import GPT2Config, GPT2LMHeadModel as HFGPT2

    return HFGPT2(GPT2Config(**cfg, attn_implementation="eager"))


def gpt2_flops(cfg, *, tokens: int, attended: int, train: bool = True) -> int:
    """Matmul FLOPs of one step over ``tokens`` tokens of which ``attended`` (query, key) pairs
    are computed (the sum of squared sequence lengths when packed, B * S^2 when padded)."""
    D, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
    per_token = cfg.n_layer * 2 * D * (3 * D + D + 2 * inner) + 2 * D * cfg.vocab_size
    forward = tokens * per_token + cfg.n_layer * 2 * 2 * attended * D
    return forward * (3 if train else 1)


def _gpt2(name: str, n_embd: int, n_layer: int, n_head: int, what: str) -> Variant:
    """A GPT-2 size under Hugging Face's model id, also spelled ``openai-community/<id>`` (its hub
    organisation) and with an underscore (``gpt2_medium``); the name picks the architecture, no hub
    is contacted."""
    aliases = (f"openai-community/{name}",) + ((name.replace("-", "_"),) if "-" in name else ())
    return Variant(name, dict(vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head),
                   f"GPT-2 {what}, as Hugging Face's {name} (GPT2LMHeadModel)", f"transformers GPT2LMHeadModel ({name})",
                   aliases=aliases)


GPT2_SPEC = ModelSpec(
    family="gpt2",
    task="causal-lm",
    model=GPT2LMHeadModel,
    variants=(
        _gpt2("gpt2", 768, 12, 12, "small (124M)"),
        _gpt2("gpt2-medium", 1024, 24, 16, "medium (355M)"),
        _gpt2("gpt2-large", 1280, 36, 20, "large (774M)"),
        _gpt2("gpt2-xl", 1600, 48, 25, "XL (1.5B)"),
    ),
    converters=(GPT2, GPT2_FASTZOO),
    tiny=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
    original=Original(hf_gpt2, "transformers GPT2LMHeadModel (eager attention)", "attn_pdrop"),
    flops=gpt2_flops,
)
SPECS = (GPT2_SPEC,)
