"""Bad input to the weights layer (``fastzoo.load_pretrained`` / ``create(pretrained=)``):
every refusal is a CheckpointError naming the key or the file, and nothing changes, neither
the model's weights nor the files on disk.

Inputs: tensors of the wrong kind (integers, bools, complex numbers for float weights),
without data (meta), not dense (sparse, quantized), tied weights given two values; shard
indexes that escape the checkpoint directory, are malformed, or disagree with their
shards; damaged config.json files.
"""
import hashlib
import json
import os
import re

import pytest
import torch
from conftest import TINY
from safetensors.torch import save_file

import fastzoo
from fastzoo.errors import CheckpointError

VIT, GPT2 = TINY["vit"], TINY["gpt2"]


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed although the load was refused"


def tree_digest(root) -> dict:
    """Every file under ``root`` (names and bytes): to show a refusal wrote nothing."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture
def vit():
    return fastzoo.create("vit_s16", **VIT)


@pytest.fixture
def donor():
    """Weights of the same architecture, different from ``vit``'s: a refusal that copied
    anything would show."""
    torch.manual_seed(1)
    return fastzoo.create("vit_s16", **VIT).state_dict()


# -- values that cannot load faithfully --------------------------------------------------
BAD_VALUES = {
    "int8": lambda v: v.to(torch.int8),
    "int64": lambda v: (v * 100).long(),
    "uint8": lambda v: v.to(torch.uint8),
    "bool": lambda v: v != 0,
    "complex64": lambda v: v.to(torch.complex64),
    "meta": lambda v: v.to("meta"),
    "sparse_coo": lambda v: v.to_sparse(),
    "sparse_csr": lambda v: v.to_sparse_csr(),
    "quantized": lambda v: torch.quantize_per_tensor(v, 0.01, 0, torch.qint8),
}
NEEDLES = {"int8": "int8 values for a float32 tensor", "int64": "int64 values for a float32 tensor",
           "uint8": "uint8 values", "bool": "bool values", "complex64": "complex64 values", "meta": "a meta tensor",
           "sparse_coo": "a sparse_coo tensor", "sparse_csr": "a sparse_csr tensor", "quantized": "a quantized tensor"}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("kind", list(BAD_VALUES))
def test_a_tensor_of_another_kind_is_refused_naming_the_key(vit, donor, kind):
    state = dict(donor)
    state["head.weight"] = BAD_VALUES[kind](donor["head.weight"])
    before = snapshot(vit)
    with pytest.raises(CheckpointError, match="head.weight") as e:
        fastzoo.load_pretrained(vit, state)
    assert NEEDLES[kind] in str(e.value) and "nothing was loaded" in str(e.value)
    assert_unchanged(vit, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_another_float_precision_loads(vit, donor, dtype):
    """Precision within the float kind is a faithful load (HF and timm ship fp16/bf16 files)."""
    fastzoo.load_pretrained(vit, {k: v.to(dtype) for k, v in donor.items()})
    assert torch.equal(vit.head.weight, donor["head.weight"].to(dtype).float())


def test_a_meta_live_module_is_refused_by_create():
    ghost = fastzoo.create("vit_s16", **VIT).to("meta")  # as FSDP's deferred init leaves a model
    with pytest.raises(CheckpointError, match="a meta tensor"):
        fastzoo.create("vit_s16", pretrained=ghost)


def test_an_int8_safetensors_file_is_refused(tmp_path, vit, donor):
    path = tmp_path / "q.safetensors"
    save_file({k: (v * 100).to(torch.int8) for k, v in donor.items()}, path)
    before, files = snapshot(vit), tree_digest(tmp_path)
    with pytest.raises(CheckpointError, match="int8 values for a float32 tensor"):
        fastzoo.load_pretrained(vit, path)
    assert_unchanged(vit, before)
    assert tree_digest(tmp_path) == files


# -- GPT-2's tied LM head -----------------------------------------------------------------
def test_gpt2_lm_head_differing_from_the_embedding_is_refused_naming_both_keys():
    """fastzoo's GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight`` (one tensor, as
    every GPT-2 checkpoint): a fastzoo-format state dict giving them different values
    cannot be held, and loading both would keep whichever came last."""
    model = fastzoo.create("gpt2", **GPT2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["transformer.wte.weight"] = torch.randn_like(state["transformer.wte.weight"])
    state["lm_head.weight"] = torch.randn_like(state["transformer.wte.weight"])
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="lm_head.weight differs from transformer.wte.weight"):
        fastzoo.load_pretrained(model, state)
    assert_unchanged(model, before)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        fastzoo.create("gpt2", pretrained=state, n_head=GPT2["n_head"])


def test_gpt2_tied_head_equal_or_absent_loads():
    model = fastzoo.create("gpt2", **GPT2)
    wte = torch.randn_like(model.transformer.wte.weight)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["transformer.wte.weight"], state["lm_head.weight"] = wte, wte.clone()
    fastzoo.load_pretrained(model, state)
    assert torch.equal(model.lm_head.weight, wte)
    del state["lm_head.weight"]  # the tied copy left out, as a deduplicating writer does
    state["transformer.wte.weight"] = wte * 2
    fastzoo.load_pretrained(model, state)
    assert torch.equal(model.lm_head.weight, wte * 2) and model.lm_head.weight is model.transformer.wte.weight


# -- shard indexes ------------------------------------------------------------------------
def write_sharded(root, state: dict, n: int = 2) -> dict:
    """A sharded directory as Hugging Face writes one; returns the weight_map."""
    root.mkdir(parents=True, exist_ok=True)
    keys = list(state)
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = keys[i::n]
        save_file({k: state[k].contiguous() for k in part}, root / name)
        weight_map.update({k: name for k in part})
    write_index(root, weight_map)
    return weight_map


def write_index(root, weight_map, raw: str | None = None):
    (root / "model.safetensors.index.json").write_text(raw if raw is not None else json.dumps({"weight_map": weight_map}))


def test_a_well_formed_sharded_directory_loads(tmp_path, vit, donor):
    write_sharded(tmp_path / "ck", donor)
    fastzoo.load_pretrained(vit, tmp_path / "ck")
    assert_unchanged(vit, donor)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "sub/../../outside.safetensors", "ABSOLUTE"])
def test_shard_names_escaping_the_directory_are_refused(tmp_path, vit, donor, escape):
    outside = tmp_path / "outside.safetensors"
    save_file({k: v.contiguous() for k, v in donor.items()}, outside)
    ck = tmp_path / "ck"
    ck.mkdir()
    name = str(outside) if escape == "ABSOLUTE" else escape
    write_index(ck, {k: name for k in donor})
    before, files = snapshot(vit), tree_digest(tmp_path)
    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint directory"):
        fastzoo.load_pretrained(vit, ck)
    assert_unchanged(vit, before)
    assert tree_digest(tmp_path) == files


def test_a_shard_symlinked_out_of_the_directory_is_refused(tmp_path, vit, donor):
    save_file({k: v.contiguous() for k, v in donor.items()}, tmp_path / "elsewhere.safetensors")
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(tmp_path / "elsewhere.safetensors", ck / "model-1.safetensors")
    write_index(ck, {k: "model-1.safetensors" for k in donor})
    before = snapshot(vit)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        fastzoo.load_pretrained(vit, ck)
    assert_unchanged(vit, before)
    single = tmp_path / "single"
    single.mkdir()
    os.symlink(tmp_path / "elsewhere.safetensors", single / "model.safetensors")  # the unsharded file too
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        fastzoo.load_pretrained(vit, single)


def test_hugging_face_cache_snapshot_links_to_its_blobs_load(tmp_path, vit, donor):
    """``<repo>/snapshots/<rev>/<file>`` -> ``<repo>/blobs/<hash>`` is how the hub cache stores
    every file (what ``snapshot_download`` returns): the one layout allowed outside."""
    repo = tmp_path / "models--someone--vit"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in donor.items()}, repo / "blobs" / "0f1e2d")
    os.symlink(os.path.relpath(repo / "blobs" / "0f1e2d", snap), snap / "model.safetensors")
    fastzoo.load_pretrained(vit, snap)
    assert_unchanged(vit, donor)


@pytest.mark.parametrize("raw,needle", [
    ('{"weight_map": {"a": "x.safetensors"', "not valid JSON"),  # truncated
    ("[1, 2, 3]", "not a shard index"),
    ('{"metadata": {}}', "not a shard index"),
    ('{"weight_map": {}}', "not a shard index"),
    ('{"weight_map": ["model-1.safetensors"]}', "not a shard index"),
    ('{"weight_map": {"head.weight": 3}}', "weight_map['head.weight'] is 3"),
    ('{"weight_map": {"head.weight": null}}', "weight_map['head.weight'] is None"),
    ('{"weight_map": {"head.weight": ""}}', "weight_map['head.weight'] is ''"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
])
def test_a_malformed_index_is_refused_naming_the_file(tmp_path, vit, donor, raw, needle):
    ck = tmp_path / "ck"
    write_sharded(ck, donor)
    index = ck / "model.safetensors.index.json"
    index.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    before = snapshot(vit)
    with pytest.raises(CheckpointError) as e:
        fastzoo.load_pretrained(vit, ck)
    assert str(index) in str(e.value) and needle in str(e.value), str(e.value)
    assert_unchanged(vit, before)


def test_an_index_that_maps_a_key_to_the_wrong_shard_is_refused(tmp_path, vit, donor):
    ck = tmp_path / "ck"
    weight_map = write_sharded(ck, donor)
    key = "head.weight"
    other = next(s for s in set(weight_map.values()) if s != weight_map[key])
    write_index(ck, {**weight_map, key: other})
    before = snapshot(vit)
    with pytest.raises(CheckpointError, match=rf"holds '{key}', but the index maps it to '{other}'"):
        fastzoo.load_pretrained(vit, ck)
    assert_unchanged(vit, before)


def test_an_index_and_shards_that_disagree_are_refused(tmp_path, vit, donor):
    ck = tmp_path / "ck"
    weight_map = write_sharded(ck, donor)
    listed = dict(weight_map)
    del listed["head.bias"]  # a shard holds a key the index does not list
    write_index(ck, {**listed, "head.extra": next(iter(weight_map.values()))})  # and one no shard holds
    with pytest.raises(CheckpointError) as e:
        fastzoo.load_pretrained(vit, ck)
    assert "'head.bias', but the index does not list it" in str(e.value)
    assert "maps 'head.extra'" in str(e.value) and "which does not hold it" in str(e.value)


def test_a_key_in_two_shards_is_refused(tmp_path, vit, donor):
    ck = tmp_path / "ck"
    weight_map = write_sharded(ck, donor)
    key = "head.weight"
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map[key])
    both = {k: donor[k].contiguous() for k, s in weight_map.items() if s == other}
    save_file({**both, key: torch.zeros_like(donor[key])}, ck / other)  # a second, different copy
    before = snapshot(vit)
    with pytest.raises(CheckpointError, match=rf"{other} holds '{key}', but the index maps it to '{weight_map[key]}'"):
        fastzoo.load_pretrained(vit, ck)
    assert_unchanged(vit, before)


def test_a_missing_shard_is_named(tmp_path, vit, donor):
    ck = tmp_path / "ck"
    weight_map = write_sharded(ck, donor)
    gone = sorted(set(weight_map.values()))[0]
    (ck / gone).unlink()
    with pytest.raises(CheckpointError, match=f"{gone}' is missing"):
        fastzoo.load_pretrained(vit, ck)


def test_a_truncated_shard_is_named(tmp_path, vit, donor):
    ck = tmp_path / "ck"
    weight_map = write_sharded(ck, donor)
    shard = ck / sorted(set(weight_map.values()))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    before = snapshot(vit)
    with pytest.raises(CheckpointError, match=f"{shard.name}: cannot read"):
        fastzoo.load_pretrained(vit, ck)
    assert_unchanged(vit, before)


# -- config.json ------------------------------------------------------------------------
@pytest.mark.parametrize("raw,needle", [
    ('{"fastzoo_model": "vit_s16", "embed_dim": 3', "not valid JSON"),
    ("[]", "holds a JSON list"),
    ('"vit_s16"', "holds a JSON str"),
    ("", "not valid JSON"),
])
def test_a_damaged_config_json_is_refused_naming_the_file(tmp_path, vit, raw, needle):
    vit.save_pretrained(tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text(raw)
    with pytest.raises(CheckpointError, match=needle) as e:
        fastzoo.create("vit_s16", pretrained=tmp_path / "ck")
    assert "config.json" in str(e.value)


def test_a_state_dict_holding_something_other_than_tensors_is_refused(vit):
    with pytest.raises(CheckpointError, match="not a state dict"):
        fastzoo.load_pretrained(vit, {"head.weight": [[0.0] * 32] * 3})
    with pytest.raises(CheckpointError, match="takes a path"):
        fastzoo.load_pretrained(vit, 42)


# -- damaged and adversarial files ---------------------------------------------------------
def _safetensors_with_header(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header


@pytest.mark.parametrize("name,data,needle", [
    ("empty.safetensors", b"", "cannot read this checkpoint"),
    ("huge_header.safetensors", (10**15).to_bytes(8, "little") + b"{}", "header too large"),
    ("bad_header.safetensors", _safetensors_with_header(b"{{{{"), "cannot read this checkpoint"),
    ("offsets_past_the_end.safetensors", _safetensors_with_header(
        b'{"head.weight":{"dtype":"F32","shape":[3,32],"data_offsets":[0,99999999]}}'), "cannot read this checkpoint"),
    ("empty.pt", b"", "cannot read this checkpoint"),
    ("zeros.bin", b"\0" * 100, "cannot read this checkpoint (Unsupported operand"),  # damaged, not "pickled code"
])
def test_a_damaged_file_is_a_checkpoint_error_naming_it(tmp_path, vit, name, data, needle):
    (tmp_path / name).write_bytes(data)
    before = snapshot(vit)
    with pytest.raises(CheckpointError, match=re.escape(needle)) as e:
        fastzoo.load_pretrained(vit, tmp_path / name)
    assert str(tmp_path / name) in str(e.value)
    assert_unchanged(vit, before)
