"""The `varlen` and `nested` backends against the eager reference, sequence by sequence."""
import pytest
import torch
import torch.nn.functional as F

from fastzoo.attention import AttnContext, capability_matrix, get_backend, list_attention
from fastzoo.errors import BackendUnavailableError

LENGTHS = (7, 1, 12, 4)
H, D = 3, 16
TOL = 1e-5  # fp32 attention of O(1) values: only the order of sums differs


def packed_qkv(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    T = sum(LENGTHS)
    qkv = [torch.randn(1, H, T, D, generator=g).to(device=device, dtype=dtype).requires_grad_() for _ in range(3)]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return qkv, cu


def reference_per_sequence(qkv, cu, causal):
    """Each sequence alone through plain SDPA math in fp32."""
    q, k, v = (t.detach().float().requires_grad_() for t in qkv)
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=causal))
    return torch.cat(outs, dim=2), (q, k, v)


CPU_TRAIN = [("varlen", {}), ("varlen", {"impl": "cpu"}), ("nested", {}), ("eager", {}), ("sdpa", {})]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name, opts", CPU_TRAIN, ids=lambda x: str(x))
def test_packed_forward_backward_equal_per_sequence_reference(name, opts, causal):
    qkv, cu = packed_qkv()
    backend = get_backend(name, **opts)
    out = backend(*qkv, AttnContext(causal=causal, cu_seqlens=cu, max_seqlen=max(LENGTHS)))
    ref, ref_inputs = reference_per_sequence(qkv, cu, causal)
    assert (out - ref).abs().max() <= TOL
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref.backward(grad_out)
    for t, r in zip(qkv, ref_inputs):
        assert (t.grad - r.grad).abs().max() <= TOL


@pytest.mark.parametrize("name, opts", [("flex", {}), ("varlen", {"impl": "flex"})], ids=str)
def test_flex_packed_inference_equals_reference(name, opts):
    qkv, cu = packed_qkv()
    qkv = [t.detach() for t in qkv]  # CPU flex refuses inputs that require grad
    with torch.no_grad():
        out = get_backend(name, **opts)(*qkv, AttnContext(causal=True, cu_seqlens=cu, max_seqlen=max(LENGTHS)))
    assert (out - reference_per_sequence(qkv, cu, True)[0]).abs().max() <= TOL


@pytest.mark.parametrize("name", ["varlen", "nested"])
def test_plain_batch_without_cu_seqlens_is_one_sequence_per_row(name):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, 6, D, generator=g) for _ in range(3))
    out = get_backend(name)(q, k, v, AttnContext(causal=True))
    assert (out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() <= TOL


def test_max_seqlen_is_computed_when_missing():
    qkv, cu = packed_qkv()
    with torch.no_grad():
        out = get_backend("varlen")(*qkv, AttnContext(causal=True, cu_seqlens=cu))
    assert (out - reference_per_sequence(qkv, cu, True)[0]).abs().max() <= TOL


def test_dropout_is_applied_by_the_cpu_path_and_refused_by_kernels_without_it():
    qkv, cu = packed_qkv()
    ctx = AttnContext(causal=True, cu_seqlens=cu, max_seqlen=max(LENGTHS), dropout_p=0.5)
    with torch.no_grad():
        dropped = get_backend("varlen")(*qkv, ctx)
        assert (dropped - reference_per_sequence(qkv, cu, True)[0]).abs().max() > 0.1
        with pytest.raises(BackendUnavailableError, match="dropout"):
            get_backend("varlen", impl="flex")(*qkv, ctx)


def test_padding_masks_are_refused_per_call():
    qkv, _ = packed_qkv()
    mask = torch.ones(1, sum(LENGTHS), dtype=torch.bool)
    for name in ("varlen", "nested"):
        with pytest.raises(BackendUnavailableError, match="padding"):
            get_backend(name)(*qkv, AttnContext(causal=True, key_padding_mask=mask))


def test_registered_and_in_the_capability_matrix():
    assert {"nested", "varlen"} <= set(list_attention(available_only=True))
    rows = {r["backend"]: r for r in capability_matrix()}
    assert rows["varlen"]["varlen"] == "yes" and rows["nested"]["varlen"] == "yes"


# -- GPU kernels (written against their documented APIs; run on a GPU machine) ---------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen GPU kernels need a CUDA GPU; this machine has none")
@pytest.mark.parametrize("impl", ["torch", "flash", "xformers", "flex", None])
def test_gpu_varlen_kernels_low_precision_rule(impl):
    from fastzoo.attention.base import unavailable

    reason = impl and unavailable(get_backend("varlen", impl=impl).capabilities)
    if reason:
        pytest.skip(reason)
    qkv, cu = packed_qkv(torch.bfloat16, "cuda")
    out = get_backend("varlen", impl=impl)(*qkv, AttnContext(causal=True, cu_seqlens=cu, max_seqlen=max(LENGTHS)))
    ref, _ = reference_per_sequence(qkv, cu, True)
    same_dtype = torch.cat([
        F.scaled_dot_product_attention(*(t[:, :, a:b].detach() for t in qkv), is_causal=True)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    ], dim=2)
    # flash-attn's rule: at most 3x the error of the same math in bf16, plus a small floor
    assert (out.float() - ref).abs().max() <= 3 * (same_dtype.float() - ref).abs().max() + 1e-3
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in qkv)


def test_document_ids_of_packed_tokens():
    from fastzoo.attention.masks import document_ids

    cu = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)  # an empty sequence, then 2 trailing tokens
    assert document_ids(cu, 8).tolist() == [0, 0, 0, 2, 3, 3, -1, -1]
