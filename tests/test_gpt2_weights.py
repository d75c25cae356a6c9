"""HF GPT-2 weights into fastzoo and back, from every source form `pretrained=` takes."""
import json

import pytest
import torch
import transformers
from conftest import TINY as FAMILY_TINY
from safetensors.torch import save_file

import fastzoo
from fastzoo.equivalence import draw_
from fastzoo.errors import CheckpointError

TINY = {**FAMILY_TINY["gpt2"], "n_inner": 96}  # an MLP width other than 4 * n_embd: the config read back must carry it
LOGIT_TOL = 1e-4  # fastzoo.equivalence's rule: fp32 CPU, same weights


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(4)
    cfg = transformers.GPT2Config(**TINY, layer_norm_epsilon=1e-6, bos_token_id=None, eos_token_id=None)
    return draw_(transformers.GPT2LMHeadModel(cfg), seed=4).eval()


IDS = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(5))


def assert_same_function(model, hf):
    model.eval()
    with torch.no_grad():
        assert (model(IDS).logits - hf(IDS).logits).abs().max() <= LOGIT_TOL


def assert_config_from(model):
    c = model.config
    fields = ("n_layer", "n_embd", "vocab_size", "n_positions", "n_inner")
    assert tuple(getattr(c, k) for k in fields) == tuple(TINY[k] for k in fields)


def test_save_pretrained_dir(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    m = fastzoo.create("gpt2", attn="eager", pretrained=tmp_path)
    assert_config_from(m)
    assert m.config.n_head == TINY["n_head"] and m.config.layer_norm_epsilon == 1e-6  # config.json decides the architecture
    assert_same_function(m, hf)


def test_sharded_save_pretrained_dir(hf, tmp_path):
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_same_function(fastzoo.create("gpt2", attn="eager", pretrained=tmp_path), hf)


def test_sharded_bin_with_index(hf, tmp_path):
    state = hf.state_dict()
    keys = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2], "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    weight_map = {}
    for name, ks in shards.items():
        torch.save({k: state[k].clone() for k in ks}, tmp_path / name)
        weight_map.update({k: name for k in ks})
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf.config.to_json_file(tmp_path / "config.json")
    assert_same_function(fastzoo.create("gpt2", attn="eager", pretrained=tmp_path), hf)


@pytest.mark.parametrize("suffix", [".bin", ".safetensors"])
def test_single_file_needs_n_head_from_the_user(hf, tmp_path, suffix):
    """A bare file fixes the sizes but not the head count: n_head comes from the override (or the YAML)."""
    path = tmp_path / f"w{suffix}"
    state = {k: v.clone().contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, path) if suffix == ".bin" else save_file(state, str(path))
    m = fastzoo.create("gpt2", attn="eager", pretrained=path, n_head=TINY["n_head"], layer_norm_epsilon=1e-6)
    assert_config_from(m)
    assert_same_function(m, hf)


def test_live_module_and_state_dict(hf):
    assert_same_function(fastzoo.create("gpt2", attn="sdpa", pretrained=hf), hf)
    m = fastzoo.create("gpt2", attn="sdpa", pretrained=dict(hf.state_dict()), n_head=TINY["n_head"], layer_norm_epsilon=1e-6)
    assert_same_function(m, hf)


def test_gpt2model_keys_and_old_buffers(hf):
    """Keys without 'transformer.' (GPT2Model) and the attn.bias / attn.masked_bias buffers of old checkpoints."""
    state = {k[len("transformer."):]: v for k, v in hf.state_dict().items() if k.startswith("transformer.")}
    n = TINY["n_positions"]
    for i in range(TINY["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, n, n, dtype=torch.bool))
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    m = fastzoo.create("gpt2", attn="eager", pretrained=state, n_head=TINY["n_head"], layer_norm_epsilon=1e-6)
    assert_same_function(m, hf)


def test_export_loads_strictly_into_hf(hf):
    m = fastzoo.create("gpt2", attn="eager", pretrained=hf)
    exported = fastzoo.export_state_dict(m, "hf")
    fresh = transformers.GPT2LMHeadModel(hf.config).eval()
    fresh.load_state_dict(exported, strict=True)
    for k, v in hf.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k  # a copy, bit for bit
    assert_same_function(m, fresh)


def test_fastzoo_state_dict_and_save_pretrained_round_trip(hf, tmp_path):
    m = fastzoo.create("gpt2", attn="eager", pretrained=hf)
    again = fastzoo.create("gpt2", attn="eager", pretrained=m.state_dict(), n_head=TINY["n_head"], layer_norm_epsilon=1e-6)
    assert_same_function(again, hf)
    m.save_pretrained(tmp_path)
    assert_same_function(fastzoo.create("gpt2", attn="eager", pretrained=tmp_path), hf)


def test_untied_lm_head_is_refused(hf):
    state = dict(hf.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(CheckpointError, match="lm_head"):
        fastzoo.create("gpt2", attn="eager", pretrained=state, n_head=TINY["n_head"])


@pytest.mark.parametrize("field, value", [
    ("reorder_and_upcast_attn", True), ("add_cross_attention", True), ("tie_word_embeddings", False),
    ("activation_function", "swish"), ("model_type", "llama"),
])
def test_unsupported_config_json_is_refused(hf, tmp_path, field, value):
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=field):
        fastzoo.create("gpt2", pretrained=tmp_path)


def test_inverse_layer_idx_scaling_and_unscaled_attention(tmp_path):
    torch.manual_seed(6)
    cfg = transformers.GPT2Config(**TINY, scale_attn_by_inverse_layer_idx=True, scale_attn_weights=False,
                                  activation_function="relu", bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path)
    assert_same_function(fastzoo.create("gpt2", attn="sdpa", pretrained=tmp_path), hf)


def test_wrong_shapes_are_refused_with_names(hf):
    with pytest.raises(CheckpointError, match="wpe"):
        fastzoo.create("gpt2", attn="eager", pretrained=hf, n_positions=32)
