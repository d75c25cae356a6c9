"""Decoder family: causal language models in Hugging Face's layouts (GPT-2), sharing packing,
the KV cache, the fused loss and ``generate``."""
from fastzoo.models.decoder.config import GPT2Config
from fastzoo.models.decoder.gpt2 import GPT2LMHeadModel, GPT2Model

__all__ = ["GPT2Config", "GPT2LMHeadModel", "GPT2Model"]
