"""Causal language modelling (GPT-2, the Llama layouts): token ids -> next-token logits, compared
with Hugging Face's original on a padded batch of distinct lengths and, where the backend takes
packed sequences, on the same sequences packed (token by token with the padded original)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from fastzoo.data import pack
from fastzoo.tasks.task import Inputs, Task


def example_inputs(model, batch, gen, caps, notes):
    cfg = model.config
    S = min(32, model.n_positions or 32)  # a learned position table bounds the length; rotary does not
    lengths = [S - ((i + 1) * S) // (2 * batch) for i in range(batch)]  # distinct lengths in [S/2, S), all padded
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    ids_BS = torch.zeros(batch, S, dtype=torch.long)
    mask_BS = torch.zeros(batch, S, dtype=torch.long)
    for i, s in enumerate(seqs):
        # the last row left-padded (as generate pads), the others right-padded (as training pads): an
        # inverted key-padding mask on a right-padded causal row leaves every real token's keys as they were
        at = slice(S - len(s), S) if i == batch - 1 else slice(0, len(s))
        ids_BS[i, at] = s
        mask_BS[i, at] = 1
    # positions count real tokens (transformers' generate: the mask's cumulative sum), as packing counts them
    pos_BS = (mask_BS.cumsum(1) - 1).masked_fill(mask_BS == 0, 1)
    padded = Inputs((ids_BS,), {"attention_mask": mask_BS, "position_ids": pos_BS}, keep=mask_BS.bool())
    if caps.padding_mask or caps.varlen:  # GPT-2 unpads a padded batch for packed-only backends
        yield "padded", padded, padded
    else:
        notes.append("padded batch not compared: the backend takes neither a key-padding mask nor packed sequences")
    if caps.varlen:
        packed = pack(seqs)
        get = (lambda k: packed[k]) if isinstance(packed, Mapping) else (lambda k: getattr(packed, k))
        kwargs = {k: get(k) for k in ("position_ids", "cu_seqlens", "max_seqlen")}
        yield "packed", Inputs((get("input_ids"),), kwargs), padded  # the original runs the padded batch
    else:
        notes.append("packed sequences not compared: the backend takes no cu_seqlens")


def step_flops(count, cfg, *, lengths: list[int], width: int | None, train: bool) -> int:
    """Sequences of ``lengths`` padded to ``width`` (None: packed, no padding): the tokens computed
    and the (query, key) pairs attended."""
    if width is None:
        return count(cfg, tokens=sum(lengths), attended=sum(n * n for n in lengths), train=train)
    return count(cfg, tokens=len(lengths) * width, attended=len(lengths) * width**2, train=train)


CAUSAL_LM = Task(
    name="causal-lm",
    description="token ids -> next-token logits (padded, packed or nested)",
    inputs=example_inputs,
    step_flops=step_flops,
    bench="fastzoo.bench.causal_lm:model_suite",
    tour="fastzoo.bench.causal_lm:tour_entry",
    parity={"pydoc_text": "fastzoo.accuracy.parity:Text"},
    train_script="scripts/finetune_causal_lm.py",
)
