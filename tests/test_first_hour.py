"""A user's first hour: what the README, ``--help`` and the error messages lead a new user to run, each
as that user expects it from the original library (transformers, timm) or from the flag's own words."""
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import SPECS

import fastzoo
from fastzoo.cli import main as cli_main
from fastzoo.errors import UnknownModelError
from fastzoo.text import error_line

ROOT = Path(__file__).resolve().parents[1]


def script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- models come back in the mode their library gives ------------------------------------------------
def test_a_vit_from_transformers_comes_back_in_eval_mode_and_from_timm_in_train_mode(tmp_path):
    """transformers' ``from_pretrained`` gives eval mode; timm's ``create_model`` train mode."""
    import timm
    import transformers

    hf = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8,
        num_labels=3))
    hf.save_pretrained(tmp_path)
    assert not fastzoo.create(pretrained=tmp_path).training
    tm = timm.create_model("vit_small_patch16_224", pretrained=False, depth=1, img_size=32, patch_size=8, num_classes=3)
    assert fastzoo.create("vit_small_patch16_224", pretrained=tm).training


def test_resnet_reset_classifier_keeps_eval_mode():
    """timm's own test_models.py asks this of every model: no module back in train mode."""
    model = fastzoo.create("resnet18", num_classes=3).eval()
    for num_classes, pool in ((5, "avg"), (0, "")):
        model.reset_classifier(num_classes, global_pool=pool)
        assert not any(m.training for m in model.modules())


# -- scripts do what their flags say -----------------------------------------------------------------
@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    words = "the cat sat on a mat while dogs ran in the park and birds sang".split()
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text("\n\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 20)) for i in range(60)))
    return path


def test_max_tokens_is_the_item_budget_of_a_rotary_model(text_file, tmp_path, capsys):
    """A long-context rotary model (max_position_embeddings 40960, as Qwen3) packs into items of
    --max-tokens tokens, not of its whole context; a document piece longer than an item is refused
    naming both flags."""
    lm = script("finetune_causal_lm")
    sizes = ["hidden_size=32", "intermediate_size=64", "num_hidden_layers=1", "num_attention_heads=2",
             "num_key_value_heads=1", "max_position_embeddings=40960"]
    args = ["--model", "llama", "--model-kwargs", *sizes, "--train-files", str(text_file), "--max-tokens", "256",
            "-b", "4", "--steps", "1", "--workers", "0", "--output-dir", str(tmp_path / "out")]
    assert lm.main(args) == 0
    with pytest.raises(fastzoo.errors.UsageError, match="--max-seq-len 512 exceeds --max-tokens 256"):
        lm.main([*args, "--max-seq-len", "512"])


def test_a_fresh_model_takes_the_tokenizers_end_of_text_id():
    """The byte tokenizer's vocabulary (257 ids) with Qwen's end-of-text id 151645 would never stop ``generate``."""
    lm = script("finetune_causal_lm")
    vocab = lm.tokenizer_vocabulary(lm.ByteTokenizer())
    assert vocab == {"vocab_size": 257, "eos_token_id": 256, "bos_token_id": None}
    model = fastzoo.create("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, **vocab)
    assert model.generation_config.eos_token_id == 256


def test_synthetic_images_are_one_task_in_training_and_evaluation():
    """The held-out split shows the training split's class patterns: a nearest-class-mean classifier
    fitted on the training images is right on nearly all held-out ones (chance: 1 in 10)."""
    train, held = script("finetune_image_classification").synthetic_splits(200, 10, (16, 16), seed=0)
    x = torch.stack([train[i][0] for i in range(len(train))])
    y = torch.tensor([train[i][1] for i in range(len(train))])
    means = torch.stack([x[y == c].mean(0) for c in range(10)]).flatten(1)
    right = sum(int(((means - held[i][0].flatten()) ** 2).sum(1).argmin() == held[i][1]) for i in range(len(held)))
    assert right >= 0.9 * len(held)


# -- detection feedback -------------------------------------------------------------------------------
def test_detection_says_what_it_does_from_the_first_line_and_numbers_epochs_from_1(tmp_path, capsys, monkeypatch):
    det = script("finetune_detection")
    built = []
    monkeypatch.setattr(det, "kernel_build_needed", lambda device: True)
    monkeypatch.setattr(det, "kernel_path", lambda device: built.append(device))
    sizes = [f"{k}={v}".replace(" ", "").replace("(", "[").replace(")", "]") for k, v in SPECS["detr"].tiny.items()
             if k not in ("num_labels",)]
    args = ["--synthetic", "8", "--img-size", "32", "-b", "2", "--epochs", "1", "--log-interval", "2", "--workers", "0",
            "--model-kwargs", *sizes, "--output-dir", str(tmp_path / "out")]
    assert det.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("building the fused GIoU kernel once") and built
    assert out[1].startswith("training steps 1 to 4")
    steps = [line for line in out if line.startswith("step ")]
    assert steps and all("epoch 1 " in line for line in steps)
    evals = [line for line in out if line.startswith("eval @ step 4")]
    assert evals and "(epoch 1)" in evals[0] and "loss_giou" in evals[0]


def test_detection_help_shows_a_small_recipe_and_how_to_read_map():
    text = " ".join(script("finetune_detection").build_parser().format_help().split())
    assert "A small DETR" in text and "--synthetic 256" in text and "mAP can stay at 0.000" in text and "loss_bbox falling" in text


def test_the_c_kernels_build_is_keyed_by_torch_compiler_python_and_source(monkeypatch, tmp_path):
    """Environments (or checkouts: ninja rebuilds for another source path) sharing torch's build cache
    never rebuild each other's kernel."""
    from fastzoo.cpp_build import build_name
    from fastzoo.losses.kernels.giou_op import CPP_SOURCE

    copy = tmp_path / CPP_SOURCE.name
    copy.write_bytes(CPP_SOURCE.read_bytes())
    names = {build_name("fastzoo_giou_cpu", CPP_SOURCE), build_name("fastzoo_giou_cpu", copy)}
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    names.add(build_name("fastzoo_giou_cpu", CPP_SOURCE))
    monkeypatch.setenv("CXX", "clang++-that-is-not-here")
    names.add(build_name("fastzoo_giou_cpu", CPP_SOURCE))
    monkeypatch.setattr(sys, "version", sys.version + " other")
    names.add(build_name("fastzoo_giou_cpu", CPP_SOURCE))
    assert len(names) == 5


class _Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        raise fastzoo.data.boxes.CocoError(f"cannot read image img{i}.jpg: truncated file")


def test_an_error_in_a_data_loading_worker_is_reported_with_its_cause():
    loader = torch.utils.data.DataLoader(_Broken(), num_workers=1)
    with pytest.raises(ValueError) as e:
        next(iter(loader))
    line = error_line("finetune_detection.py", e.value)
    assert re.fullmatch(r"finetune_detection\.py: error: cannot read image img0\.jpg: truncated file "
                        r"\(in DataLoader worker process 0\)", line), line


# -- names and messages -------------------------------------------------------------------------------
def test_gemma_with_fewer_layers_derives_layer_types_as_transformers():
    import transformers

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    for name, hf_class in (("gemma2", transformers.Gemma2Config), ("gemma3_text", transformers.Gemma3TextConfig)):
        for layers in (2, 7):
            model = fastzoo.create(name, num_hidden_layers=layers, device="meta", **small)
            assert list(model.config.layer_types) == hf_class(num_hidden_layers=layers).layer_types


def test_patterns_and_hub_ids_ignore_case_as_the_hub_does():
    assert "Qwen/Qwen3-0.6B" in fastzoo.list_models("qwen*")
    assert fastzoo.list_models("QWEN3*") == fastzoo.list_models("qwen3*")
    assert fastzoo.create("Qwen/Qwen3-0.6b", device="meta").config.model_type == "qwen3"


def test_fastzoo_list_is_narrow_unless_wide(capsys):
    assert cli_main(["list"]) == 0
    narrow = capsys.readouterr().out
    assert max(map(len, narrow.splitlines())) <= 160 and "--wide" in narrow
    assert cli_main(["list", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "| compile |" in wide and "| compile |" not in narrow


def test_a_timm_vit_name_of_another_architecture_says_what_is_missing():
    with pytest.raises(UnknownModelError, match="rotary position embeddings") as e:
        fastzoo.create("vit_base_patch16_rope_224")
    assert "gap" not in str(e.value)


def test_a_cli_error_points_at_the_cli(capsys):
    assert cli_main(["check", "vit_nope"]) == 2
    assert "`fastzoo list 'vit*'`" in capsys.readouterr().err


FOREIGN_FILES = {"train.py"}  # timm's training script


def test_no_docstring_points_at_a_file_that_does_not_exist():
    """A ``name.py`` a module's docstrings name is a file of the package (or the repository), or
    another library's named as such."""
    missing = []
    for path in (ROOT / "fastzoo").rglob("*.py"):
        for ref in re.findall(r"``([\w/]+\.py)``", path.read_text()):
            if ref not in FOREIGN_FILES and not any((ROOT / "fastzoo").rglob(Path(ref).name)) \
                    and not (ROOT / ref).exists():
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not missing, missing


# -- no input silently ignored ------------------------------------------------------------------------
@pytest.mark.parametrize("name, hf_class", [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_a_decoders_forward_takes_transformers_keywords_in_transformers_order(name, hf_class):
    import transformers

    ours = [p for p in inspect.signature(SPECS[name].model.forward).parameters if p != "kwargs"]
    theirs = [p for p in inspect.signature(getattr(transformers, hf_class).forward).parameters if p != "kwargs"]
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("family, keyword, value", [
    ("gpt2", "encoder_hidden_states", torch.zeros(1, 4, 64)), ("gpt2", "encoder_attention_mask", torch.ones(1, 4)),
    ("llama", "encoder_attention_mask", torch.ones(1, 4)), ("llama", "made_up_keyword", None),
    ("gpt2", "made_up_keyword", 1), ("vit", "made_up_keyword", None), ("vit", "attention_mask", torch.ones(1)),
    ("resnet", "made_up_keyword", 0),
])
def test_an_input_a_model_does_not_serve_is_refused_by_name(family, keyword, value):
    spec = SPECS[family]
    model = fastzoo.create(spec.variants[0].name, **spec.tiny).eval()
    if spec.task.name == "causal-lm":
        call = dict(input_ids=torch.tensor([[1, 2, 3, 4]]))
    else:
        side = spec.tiny.get("img_size", 32)
        call = dict(pixel_values=torch.randn(1, 3, side, side))
    with pytest.raises(ValueError, match=f"^{keyword}="):
        model(**call, **{keyword: value})


def test_fastzoo_check_explain_skips_as_without_it_and_stderr_stays_empty():
    """flex on CPU has no backward: ``--explain`` runs its forward as the check does (noted, not an
    exit 2), and the profiler's C++ log, flex's compile advice and the originals' library notices stay
    off stderr."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "fastzoo.cli", "check", "vit_s16", "--tiny", "--explain", "--attn", "flex",
                           "eager"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr == ""
    assert "gradients not compared: flex has no backward on cpu" in proc.stdout and "Kernels of flex" in proc.stdout
