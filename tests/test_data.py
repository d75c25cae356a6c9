"""Collators (padded, packed, nested), the packing helper, and the causal LM loss."""
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

import fastzoo
from fastzoo.data import IGNORE_INDEX, nested, pack, pack_stream, pad_to_longest, pad_to_max
from fastzoo.losses import causal_lm_loss

SEQS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]


def test_pack_layout():
    b = fastzoo.data.pack(SEQS)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0]]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert b.max_seqlen == 5 and isinstance(b.max_seqlen, int)
    # each sequence's first token is no target: the shift never scores across a boundary
    assert b.labels.tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, 10, 11, 12, IGNORE_INDEX]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_to_longest(side):
    b = pad_to_longest(SEQS, pad_id=0, side=side)
    assert b.input_ids.shape == (3, 5)
    row = [5, 6, 7, 0, 0] if side == "right" else [0, 0, 5, 6, 7]
    assert b.input_ids[0].tolist() == row
    assert b.attention_mask[0].tolist() == [int(t != 0) for t in row]
    real_pos = b.position_ids[0][b.attention_mask[0].bool()].tolist()
    assert real_pos == [0, 1, 2]  # positions count real tokens, whichever side is padded
    assert b.labels[0].tolist() == [t if t else IGNORE_INDEX for t in row]


def test_pad_to_max():
    b = pad_to_max(SEQS, 8)
    assert b.input_ids.shape == (3, 8)
    with pytest.raises(ValueError, match="max_length"):
        pad_to_max(SEQS, 4)


def test_nested():
    nt = nested(SEQS)
    assert nt.is_nested and nt.shape[0] == 3
    assert [t.tolist() for t in nt.unbind()] == SEQS


@pytest.mark.parametrize("bad, match", [([], "empty"), ([[1, 2], []], r"seqs\[1\]"), ([[[1, 2]]], r"seqs\[0\]")])
def test_collators_refuse_bad_sequences(bad, match):
    with pytest.raises(ValueError, match=match):
        pack(bad)


def test_pack_stream_fills_the_budget_in_order():
    stream = [list(range(n)) for n in (3, 4, 2, 6, 1)]
    batches = list(pack_stream(iter(stream), max_tokens=7))
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 3, 7], [0, 2], [0, 6, 7]]
    assert all(b.input_ids.shape[1] <= 7 for b in batches)
    assert torch.cat([b.input_ids[0] for b in batches]).tolist() == sum(stream, [])


def test_pack_stream_cuts_long_sequences():
    batches = list(pack_stream([list(range(10))], max_tokens=4))
    assert [b.input_ids[0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[1].position_ids.tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="max_tokens"):
        next(pack_stream([[1]], max_tokens=0))


# -- loss ----------------------------------------------------------------------------------------
def reference_loss(logits_per_seq, seqs):
    """Mean next-token CE, each sequence on its own."""
    losses = [F.cross_entropy(lg[:-1], torch.tensor(s[1:], dtype=torch.long), reduction="sum") for lg, s in zip(logits_per_seq, seqs)]
    return sum(losses) / sum(len(s) - 1 for s in seqs)


def test_loss_padded_packed_nested_agree_and_never_cross_boundaries():
    torch.manual_seed(0)
    per_seq = [torch.randn(len(s), 20) for s in SEQS]
    ref = reference_loss(per_seq, SEQS)
    padded = pad_to_longest(SEQS)
    logits_padded = torch.zeros(3, 5, 20)
    for i, lg in enumerate(per_seq):
        logits_padded[i, : len(lg)] = lg
    packed = pack(SEQS)
    logits_packed = torch.cat(per_seq)[None]
    tol = 1e-6  # the same sum of fp32 terms in another order
    assert (causal_lm_loss(logits_padded, padded.labels) - ref).abs() <= tol
    assert (causal_lm_loss(logits_packed, packed.labels) - ref).abs() <= tol
    # raw ids as labels: cu_seqlens alone keeps the shift inside each sequence
    assert (causal_lm_loss(logits_packed, packed.input_ids, cu_seqlens=packed.cu_seqlens) - ref).abs() <= tol
    nt_logits = torch.nested.nested_tensor_from_jagged(torch.cat(per_seq), offsets=nested(SEQS).offsets())
    assert (causal_lm_loss(nt_logits, nested(SEQS)) - ref).abs() <= tol
    # and without the boundary information the loss would differ (the test can fail)
    assert (causal_lm_loss(logits_packed, packed.input_ids) - ref).abs() > 1e-3


def test_loss_equals_hf_loss_function():
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    b = pad_to_longest(SEQS)
    logits = torch.randn(3, 5, 20)
    assert (causal_lm_loss(logits, b.labels) - ForCausalLMLoss(logits, b.labels, vocab_size=20)).abs() <= 1e-6


def test_loss_bad_inputs():
    with pytest.raises(ValueError, match="labels"):
        causal_lm_loss(torch.randn(2, 5, 3), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_lm_loss(torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="reduction"):
        causal_lm_loss(torch.randn(1, 5, 3), torch.zeros(1, 5, dtype=torch.long), reduction="none")


def test_next_token_targets_shift_inside_each_sequence():
    from fastzoo.losses import next_token_targets

    b = pack(SEQS)
    shifted = next_token_targets(b.input_ids, cu_seqlens=b.cu_seqlens)
    assert shifted.tolist() == [[6, 7, IGNORE_INDEX, 9, 10, 11, 12, IGNORE_INDEX, IGNORE_INDEX]]
    # pack's labels (IGNORE_INDEX on each first token) give the same targets without cu_seqlens
    assert torch.equal(next_token_targets(b.labels), shifted)
    assert next_token_targets(pad_to_longest(SEQS).labels)[2].tolist() == [IGNORE_INDEX] * 5


def test_loss_takes_a_model_output_for_its_logits():
    m = fastzoo.create("gpt2", **TINY["gpt2"]).eval()
    b = pad_to_longest(SEQS)
    with torch.no_grad():
        out = m(b.input_ids, attention_mask=b.attention_mask)
        assert torch.equal(causal_lm_loss(out, b.labels), causal_lm_loss(out.logits, b.labels))
        with pytest.raises(ValueError, match="logits: the model output holds no logits"):
            causal_lm_loss(m.train()(b.input_ids, attention_mask=b.attention_mask, labels=b.labels), b.labels)
    with pytest.raises(TypeError, match="logits: expected a .* tensor or a model output with .logits, got dict"):
        causal_lm_loss({"loss": torch.tensor(0.0)}, b.labels)
