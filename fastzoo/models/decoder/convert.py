"""Hugging Face ``transformers`` checkpoints.

GPT-2: fastzoo's module names are HF's, so conversion is (1) adding/stripping the
``transformer.`` prefix (``GPT2Model`` checkpoints have none), (2) transposing the four
``Conv1D`` weights (HF stores ``[in, out]``; ``nn.Linear`` ``[out, in]``), (3) dropping the
causal-mask buffers old checkpoints carry (``attn.bias``, ``attn.masked_bias``), and
(4) the tied LM head: taken from ``wte`` when absent, refused when present and different.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from fastzoo.errors import CheckpointError
from fastzoo.models.decoder.config import GPT2Config

_CONV1D = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
_PREFIX = "transformer."
# HF fields that change the function and that fastzoo does not implement: value HF defaults to.
_UNSUPPORTED = {"reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True}


def _c_attn_weight(state: dict) -> torch.Tensor | None:
    return state.get("transformer.h.0.attn.c_attn.weight", state.get("h.0.attn.c_attn.weight"))


def _infer(state: dict, c_attn_transposed: bool) -> dict:
    """Sizes the weights fix. ``n_head`` is not among them: it comes from config.json or the
    model's YAML (pass ``n_head=`` when loading a bare state dict of another size)."""
    strip = {k[len(_PREFIX):] if k.startswith(_PREFIX) else k: v for k, v in state.items()}
    layers = {int(m.group(1)) for k in strip if (m := re.match(r"h\.(\d+)\.", k))}
    vocab, n_embd = strip["wte.weight"].shape
    fc = strip["h.0.mlp.c_fc.weight"].shape
    inner = fc[1] if c_attn_transposed else fc[0]
    return {
        "vocab_size": vocab, "n_embd": n_embd, "n_positions": strip["wpe.weight"].shape[0],
        "n_layer": len(layers), "n_inner": None if inner == 4 * n_embd else inner,
    }


class _HfGPT2:
    format = "hf"

    @staticmethod
    def matches(state: dict) -> bool:
        w = _c_attn_weight(state)
        return w is not None and w.ndim == 2 and w.shape[1] == 3 * w.shape[0]  # Conv1D: [in, 3 * in]

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        out = {}
        for k, v in state.items():
            k = k[len(_PREFIX):] if k.startswith(_PREFIX) else k
            if _BUFFERS.search(k):
                continue
            if k == "lm_head.weight":
                continue
            out[_PREFIX + k] = v.t() if _CONV1D.search(k) else v
        wte = out.get(_PREFIX + "wte.weight")
        head = state.get("lm_head.weight")
        if head is not None and wte is not None and not torch.equal(head, wte):
            raise CheckpointError(
                "lm_head.weight differs from transformer.wte.weight: this checkpoint has an untied LM head, "
                "and fastzoo's GPT-2 ties it to the token embedding (as every GPT-2 checkpoint does)"
            )
        if wte is not None:
            out["lm_head.weight"] = wte
        return out

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        """A state dict that ``transformers.GPT2LMHeadModel.load_state_dict(strict=True)`` takes."""
        out = {}
        for k, v in state.items():
            out[k] = v.t().contiguous() if _CONV1D.search(k) else v
        return out

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return _infer(state, c_attn_transposed=True)

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo config fields from an HF ``config.json``; an absent field takes HF's default, which is
        :class:`GPT2Config`'s (same names, same defaults)."""
        model_type = cfg.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise CheckpointError(f"config.json has model_type={model_type!r}; fastzoo's GPT-2 reads 'gpt2' configs")
        for name, default in _UNSUPPORTED.items():
            if cfg.get(name, default) != default:
                raise CheckpointError(
                    f"config.json sets {name}={cfg[name]!r}, which fastzoo's GPT-2 does not implement (only {default!r})"
                )
        return {f.name: cfg.get(f.name, f.default) for f in dataclasses.fields(GPT2Config)}


class _FastzooGPT2:
    """fastzoo's own GPT-2 keys (``nn.Linear`` orientation), e.g. ``model.state_dict()``."""

    format = "fastzoo"

    @staticmethod
    def matches(state: dict) -> bool:
        w = state.get("transformer.h.0.attn.c_attn.weight")
        return w is not None and w.ndim == 2 and w.shape[0] == 3 * w.shape[1]

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return dict(state)

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return dict(state)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return _infer(state, c_attn_transposed=False)


GPT2 = _HfGPT2()
GPT2_FASTZOO = _FastzooGPT2()
