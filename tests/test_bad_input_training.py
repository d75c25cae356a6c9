"""Bad input to the training state (``--resume`` checkpoints, ``--replay`` captures,
``log.jsonl``): each damaged or mismatched file is refused with a CheckpointError naming the
file and the problem, before anything is applied (model weights, optimizer state and RNG
untouched); the scripts turn it into one line and exit status 2."""
import json

import pytest
import torch
from conftest import TINY, model_kwargs

import fastzoo
from fastzoo.errors import CheckpointError
from fastzoo.train import distributed as D
from fastzoo.train.checkpoint import STATE_FILE, TrainState, load_checkpoint, save_checkpoint
from fastzoo.train.nan_guard import read_capture, write_capture
from fastzoo.train.progress import trim_log
from fastzoo.train.rng import get_rng_state

WORLD = D.World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
GPT2 = TINY["gpt2"]


def build(**overrides):
    model = fastzoo.create("gpt2", attn="eager", **{**GPT2, **overrides})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(3)
    model, opt, sched = build()
    model(torch.randint(0, GPT2["vocab_size"], (2, 8))).logits.sum().backward()
    opt.step()
    return save_checkpoint(tmp_path / "checkpoint-1", model, opt, sched, TrainState(1, 0, 1), WORLD)


def resume(path, **overrides):
    """Resume into a fresh run; assert that a refusal changed nothing, and re-raise it."""
    model, opt, sched = build(**overrides)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    try:
        return load_checkpoint(path, model, opt, sched, WORLD)
    except CheckpointError:
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), "weights changed"
        assert opt.state_dict()["state"] == {}, "optimizer state changed"
        assert torch.equal(torch.get_rng_state(), rng), "RNG state changed"
        raise


def test_a_good_checkpoint_resumes(ckpt):
    assert resume(ckpt) == TrainState(1, 0, 1)


def test_resuming_with_another_architecture_names_the_field(ckpt):
    """n_head changes no shape: only the checkpoint's config.json can tell."""
    heads = GPT2["n_head"]
    with pytest.raises(CheckpointError, match=f"n_head: checkpoint {heads} vs model {heads // 2}"):
        resume(ckpt, n_head=heads // 2)
    with pytest.raises(CheckpointError, match="layer_norm_epsilon"):
        resume(ckpt, layer_norm_epsilon=1e-3)


def test_resuming_with_other_dropout_warns(ckpt):
    with pytest.warns(UserWarning, match="attn_pdrop: checkpoint 0.1, this run 0.0"):
        resume(ckpt, attn_pdrop=0.0)


def test_resuming_a_vit_checkpoint_into_gpt2_is_refused(tmp_path):
    vit = fastzoo.create("vit_s16", **TINY["vit"])
    opt = torch.optim.AdamW(vit.parameters())
    save_checkpoint(tmp_path / "c", vit, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), TrainState(), WORLD)
    with pytest.raises(CheckpointError, match="a vit checkpoint; this run trains a gpt2 model"):
        resume(tmp_path / "c")


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage,needle", [
    (lambda d: truncate(d / "config.json"), "config.json: not valid JSON"),
    (lambda d: (d / "config.json").write_text("[]"), "config.json: holds a JSON list"),
    (lambda d: (d / "config.json").unlink(), "no config.json there"),
    (lambda d: truncate(d / "model.safetensors"), "model.safetensors: cannot read"),
    (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors here"),
    (lambda d: truncate(d / STATE_FILE), "train_state.pt: cannot read it"),
    (lambda d: (d / STATE_FILE).write_bytes(b""), "train_state.pt: cannot read it"),
    (lambda d: (d / STATE_FILE).unlink(), "no train_state.pt there"),
])
def test_a_damaged_checkpoint_file_is_named(ckpt, damage, needle):
    damage(ckpt)
    with pytest.raises(CheckpointError, match=needle):
        resume(ckpt)


def edit_state(path, **changes):
    data = torch.load(path / STATE_FILE, weights_only=True)
    for k, v in changes.items():
        if v is None:
            del data[k]
        else:
            data[k] = v
    torch.save(data, path / STATE_FILE)


@pytest.mark.parametrize("changes,needle", [
    (dict(rng=None), "'rng' missing"),
    (dict(rng=[]), "'rng' is empty"),
    (dict(rng=[{"python": [3, [], None]}]), "rng[0]: no numpy / torch generator state"),
    (dict(step=None), "'step' missing"),
    (dict(step="3"), "'step' is a str, not int"),
    (dict(optimizer=None), "'optimizer' missing"),
    (dict(optimizer={"state": {}, "param_groups": []}), "optimizer parameter groups hold [] parameters"),
])
def test_an_incomplete_training_state_is_refused(ckpt, changes, needle):
    edit_state(ckpt, **changes)
    with pytest.raises(CheckpointError) as e:
        resume(ckpt)
    assert needle in str(e.value) and "train_state.pt" in str(e.value)


def test_a_damaged_rng_tensor_is_refused(ckpt):
    data = torch.load(ckpt / STATE_FILE, weights_only=True)
    data["rng"][0]["torch"] = data["rng"][0]["torch"][:10]
    torch.save(data, ckpt / STATE_FILE)
    with pytest.raises(CheckpointError, match="the torch generator state is damaged"):
        resume(ckpt)


def test_weights_of_another_kind_in_a_checkpoint_are_refused(ckpt):
    from safetensors.torch import load_file, save_file

    w = load_file(ckpt / "model.safetensors")
    w["transformer.ln_f.weight"] = w["transformer.ln_f.weight"].to(torch.int8)
    save_file(w, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="transformer.ln_f.weight: int8 values"):
        resume(ckpt)


def test_an_unfinished_checkpoint_is_not_resumed(ckpt):
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    ckpt.rename(tmp)
    with pytest.raises(CheckpointError, match="an unfinished checkpoint"):
        resume(tmp)


# -- --replay captures -------------------------------------------------------------------
@pytest.fixture
def capture(tmp_path):
    model, _, _ = build()
    return write_capture(tmp_path / "nan_step2", model=model, weights=model.state_dict(),
                         batch={"input_ids": torch.zeros(1, 4, dtype=torch.long)}, rng_state=get_rng_state(),
                         loss=torch.tensor(float("inf")), grads={}, meta={"step": 2, "count_global": 4.0,
                                                                          "world_size": 1, "args": {}})


def test_a_complete_capture_reads(capture):
    assert read_capture(capture)["meta"]["step"] == 2


@pytest.mark.parametrize("damage,needle", [
    (lambda d: truncate(d / "meta.json"), "meta.json: not valid JSON"),
    (lambda d: (d / "meta.json").write_text('{"step": 2}'), "meta.json: not a capture's metadata"),
    (lambda d: (d / "meta.json").unlink(), "no meta.json there"),
    (lambda d: truncate(d / "batch.pt"), "batch.pt: cannot read it"),
    (lambda d: (d / "rng.pt").unlink(), "rng.pt is missing"),
    (lambda d: torch.save({"python": 1}, d / "rng.pt"), "rng.pt: not the RNG states of a step"),
    (lambda d: truncate(d / "observed.safetensors"), "observed.safetensors: cannot read"),
    (lambda d: truncate(d / "model.safetensors"), "model.safetensors: cannot read"),
])
def test_a_damaged_capture_is_named(capture, damage, needle):
    damage(capture)
    with pytest.raises(CheckpointError, match=needle):
        read_capture(capture)


# -- log.jsonl -----------------------------------------------------------------------------
def test_trim_log_drops_the_steps_a_resume_runs_again_and_a_cut_line(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval_loss": 2.5}, {"step": 3, "loss": 1.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')  # killed mid-line
    assert trim_log(log, 2) == 2
    assert [json.loads(line) for line in log.read_text().splitlines()] == lines[:3]
    assert trim_log(log, 2) == 0  # nothing more to drop


# -- the scripts: one line, exit status 2 --------------------------------------------------
def test_resume_with_another_n_head_is_one_line_from_the_script(tmp_path, capsys):
    from test_train_scripts import _main

    mod = _main("finetune_image_classification.py")
    common = ["--synthetic", "8", "-b", "4", "--workers", "0", "--steps", "1", "--output-dir", str(tmp_path)]
    tiny = model_kwargs(TINY["vit"], "img_size", "patch_size", "embed_dim", "depth")
    heads = TINY["vit"]["num_heads"]
    with pytest.raises(SystemExit) as e:
        mod.run_main(mod.main, [*common, "--model-kwargs", *tiny, f"num_heads={heads}"])
    assert e.value.code == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        mod.run_main(mod.main, [*common, "--model-kwargs", *tiny, f"num_heads={heads // 2}",
                                "--resume", str(tmp_path / "checkpoint-1")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"num_heads: checkpoint {heads} vs model {heads // 2}" in err
