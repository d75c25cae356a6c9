"""HF's own packing (``DataCollatorWithFlattening``: one row, positions restarting per sequence,
no attention mask) on every transformers attention that runs on the CPU: does the original
attend per sequence? This decides what the benchmarks' peer row "HF with
DataCollatorWithFlattening" may be compared on.

The finding at the pinned transformers (5.17): it attends per sequence only with
``use_cache=False``. Its mask code reads the boundaries from ``position_ids`` only when the
model has no KV cache, and its decoders make one by default (``config.use_cache``), in eval and
in train mode alike: the default call attends across the sequences on eager, sdpa and
flex_attention. The benchmarks' peer row therefore runs with ``use_cache=False``. fastzoo reads
such rows as packed sequences with or without a cache. Compared: every token's logits with the
same sequence run alone (fp32, 1e-4)."""
import pytest
import torch
import transformers

import fastzoo
from fastzoo import equivalence

TOL = equivalence.FP32_OUT_ATOL  # DESIGN.md: fp32 CPU, same weights
V = 64
LENGTHS = (5, 9, 3)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                                            eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": lambda: transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2),
    # soft-capping and a sliding window shorter than a sequence
    "gemma2": lambda: transformers.Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4),
}
# the attentions transformers offers on a CPU (flash_attention_2, which its docs pair with the
# collator, needs flash-attn on CUDA); GPT-2 has no flex_attention in transformers
CPU_ATTENTIONS = [(m, a) for m in CONFIGS for a in ("eager", "sdpa", "flex_attention") if (m, a) != ("gpt2", "flex_attention")]


def seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]


def flattened():
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s.tolist()} for s in seqs()])
    assert batch["position_ids"].tolist() == [[i for n in LENGTHS for i in range(n)]]  # restarting per sequence
    return batch


def original(model: str, attn: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[model](), attn_implementation=attn).eval()


def per_sequence(m) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([m(s[None], use_cache=False).logits[0] for s in seqs()])


def flat_logits(m, **kw) -> torch.Tensor:
    b = flattened()
    with torch.no_grad():
        return m(input_ids=b["input_ids"], position_ids=b["position_ids"], **kw).logits[0]


def per_sequence_error(flat, ref) -> list[float]:
    """Largest logit difference of each sequence."""
    return [d.max().item() for d in (flat - ref).abs().split(list(LENGTHS))]


@pytest.mark.parametrize("model,attn", CPU_ATTENTIONS)
def test_hf_flattened_rows_attend_per_sequence_with_use_cache_false(model, attn):
    """The benchmarks' peer row (HF on the collator's rows, ``use_cache=False``) computes each
    sequence's own function, in eval and train mode."""
    m = original(model, attn)
    ref = per_sequence(m)
    assert max(per_sequence_error(flat_logits(m, use_cache=False), ref)) <= TOL
    m.train()
    assert max(per_sequence_error(flat_logits(m, use_cache=False), ref)) <= TOL  # dropout is off in these configs


@pytest.mark.parametrize("model,attn", CPU_ATTENTIONS)
def test_hf_flattened_rows_attend_across_sequences_by_default(model, attn):
    """The finding (transformers 5.17): the default call (a KV cache made, as config.use_cache
    says) drops the boundaries: the first sequence is right, the later ones attend to the earlier.
    If this fails, transformers fixed it: the peer row no longer needs use_cache=False (say so in
    fastzoo/bench/causal_lm.py's FLATTENED and the results notes)."""
    m = original(model, attn)
    ref = per_sequence(m)
    for mode in ("eval", "train"):
        m.train(mode == "train")
        first, *later = per_sequence_error(flat_logits(m), ref)
        assert first <= TOL and min(later) > 100 * TOL, (mode, first, later)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_fastzoo_reads_the_same_rows_as_packed_sequences_cache_or_not(model):
    """fastzoo on the collator's rows: per sequence by default (eval: a cache would be made) and
    with use_cache=False, on the sdpa and varlen backends."""
    hf = original(model, "eager")
    ref = per_sequence(hf)
    for attn in ("sdpa", "varlen"):
        m = fastzoo.create(model, attn=attn, pretrained=hf).eval()
        assert max(per_sequence_error(flat_logits(m), ref)) <= TOL, attn
        assert max(per_sequence_error(flat_logits(m, use_cache=False), ref)) <= TOL, attn
