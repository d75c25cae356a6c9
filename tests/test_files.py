"""Every file fastzoo writes is replaced atomically and durably (``fastzoo.files``): a writer
that dies half-way (a full disk, simulated by a writer raising ENOSPC after writing part of
its bytes) leaves the previous file or directory exactly as it was and no temporary file
behind; ``save_pretrained`` and ``fastzoo convert`` go through it, so converting a
checkpoint over itself is safe."""
import errno
import json
import os
import stat

import pytest
import torch
from conftest import TINY, model_kwargs
from safetensors.torch import load_file

import fastzoo
from fastzoo import files
from fastzoo.cli import main as cli

VIT = TINY["vit"]


def disk_full(path, data: bytes = b"partial"):
    """A writer that gets part of its bytes out and then meets a full disk."""
    with open(path, "wb") as f:
        f.write(data)
    raise OSError(errno.ENOSPC, "No space left on device")


def listing(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    files.write_json(path, {"v": 1})
    with pytest.raises(OSError, match="No space left"):
        with files.atomic_path(path) as tmp:
            disk_full(tmp)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_an_interrupted_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "a.txt"
    files.write_text(path, "old")
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_path(path) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_written_files_get_the_usual_permissions(tmp_path):
    """The temporary file is created like open() creates one (0666 minus the umask), so the
    result is not left private (0600) as a mkstemp file would be."""
    old = os.umask(0o022)
    try:
        files.write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644


def test_the_new_contents_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    files.write_text(tmp_path / "a.txt", "x")
    assert len(synced) == 2 and synced[0].endswith(".tmp") and synced[1] == str(tmp_path)  # file, then directory


def test_atomic_dir_replaces_a_directory_and_recovers_from_a_kill(tmp_path):
    target = tmp_path / "checkpoint-3"
    with files.atomic_dir(target) as d:
        (d / "w").write_text("one")
    with pytest.raises(OSError):
        with files.atomic_dir(target) as d:
            (d / "w").write_text("tw")
            disk_full(d / "x")
    assert listing(tmp_path) == {"checkpoint-3/w": b"one"}
    # what a kill between the two renames leaves: the old version aside, the new one complete
    os.replace(target, tmp_path / "checkpoint-3.old")
    (tmp_path / "checkpoint-3.tmp").mkdir()
    (tmp_path / "checkpoint-3.tmp" / "w").write_text("half")
    files.recover_dir(target)
    assert listing(tmp_path) == {"checkpoint-3/w": b"one"}


def test_save_pretrained_that_fails_half_way_leaves_the_previous_save(tmp_path, monkeypatch):
    model = fastzoo.create("vit_s16", **VIT)
    model.save_pretrained(tmp_path)
    before = listing(tmp_path)
    other = fastzoo.create("vit_s16", **{**VIT, "num_classes": 5})
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", lambda tensors, path, metadata=None: disk_full(path))
    with pytest.raises(OSError, match="No space left"):
        other.save_pretrained(tmp_path)
    assert listing(tmp_path) == before  # config.json and weights both the old pair, nothing else


def test_save_pretrained_removes_a_stale_shard_index_that_would_shadow_it(tmp_path):
    """Readers prefer an index: one left by an earlier sharded save would load old weights."""
    old = fastzoo.create("vit_s16", **VIT)
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"old shard")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in old.state_dict()}}))
    (tmp_path / "tokenizer.json").write_text("{}")  # someone else's file stays
    new = fastzoo.create("vit_s16", **VIT)
    new.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    again = fastzoo.create("vit_s16", pretrained=tmp_path)
    assert torch.equal(again.head.weight, new.head.weight)


def test_save_pretrained_cleans_the_temporaries_of_a_killed_save(tmp_path):
    (tmp_path / ".model.safetensors.0badf00d.tmp").write_bytes(b"half a file")
    fastzoo.create("vit_s16", **VIT).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_save_pretrained_into_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        fastzoo.create("vit_s16", **VIT).save_pretrained(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


def test_convert_over_its_own_source(tmp_path):
    """``fastzoo convert M ck ck`` and ``--to timm x.safetensors x.safetensors``: the source is
    read whole, then replaced atomically."""
    model = fastzoo.create("vit_s16", **VIT)
    model.save_pretrained(tmp_path / "ck")
    assert cli(["convert", "vit_s16", str(tmp_path / "ck"), str(tmp_path / "ck")]) == 0
    again = fastzoo.create("vit_s16", pretrained=tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    timm_file = tmp_path / "timm.safetensors"
    assert cli(["convert", "vit_s16", str(tmp_path / "ck"), str(timm_file), "--to", "timm"]) == 0
    first = load_file(timm_file)
    sets = ["--set", *model_kwargs(VIT, "embed_dim", "depth", "num_heads", "patch_size")]  # what a timm file cannot tell
    assert cli(["convert", "vit_s16", str(timm_file), str(timm_file), "--to", "timm", *sets]) == 0
    second = load_file(timm_file)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "timm.safetensors"]  # no temporary left


def test_convert_that_fails_to_write_leaves_the_source(tmp_path, monkeypatch, capsys):
    model = fastzoo.create("vit_s16", **VIT)
    model.save_pretrained(tmp_path / "ck")
    before = listing(tmp_path)
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", lambda tensors, path, metadata=None: disk_full(path))
    assert cli(["convert", "vit_s16", str(tmp_path / "ck"), str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1
    assert listing(tmp_path) == before


def test_convert_to_a_foreign_format_into_a_directory_is_one_line(tmp_path, capsys):
    fastzoo.create("vit_s16", **VIT).save_pretrained(tmp_path / "ck")
    assert cli(["convert", "vit_s16", str(tmp_path / "ck"), str(tmp_path), "--to", "timm"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli(["convert", "vit_s16", str(tmp_path / "ck"), str(tmp_path / "no" / "x.safetensors"), "--to", "timm"]) == 2
    assert "no such directory" in capsys.readouterr().err
