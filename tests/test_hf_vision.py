"""transformers' vision models as fastzoo models: every class the ViT and ResNet families read,
built by ``fastzoo.create(pretrained=<live transformers model>)`` with no name, computes the same
function as the transformers model on the same weights, on every CPU attention backend: outputs,
the ``labels=`` loss, the input gradient and every parameter gradient.

Tolerance (fp32, CPU): max |ours - transformers| <= 1e-4 for outputs and losses, gradients by the
project's relative rule (``equivalence.compare_grads``: 1e-4 of each gradient's scale), on weights
drawn by ``fastzoo.equivalence.draw_``: gradients reach O(100) there (SigLIP's patch embedding: 190,
fastzoo 3.5e-4 from transformers, 1.8e-6 of that scale), so an absolute bound would judge their
scale, not the function. transformers runs its eager attention.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

import fastzoo
from fastzoo import equivalence
from fastzoo.equivalence import draw_
from fastzoo.registry import get_entry, spec_of
from fastzoo.weights import Source, find_converter
from tests.conftest import backends

ATOL = 1e-4  # fp32 rule: outputs and losses (absolute), gradients (relative: FP32_GRAD_RTOL, the same 1e-4)
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)
_RESNET = dict(embedding_size=8, depths=[1, 2])


def _hf(cls_name: str):
    """A tiny transformers model of class ``cls_name`` with every weight random (LayerNorms,
    LayerScale, BatchNorm statistics included), eager attention, eval mode."""
    configs = {
        "ViTForImageClassification": lambda: T.ViTConfig(**_VIT, num_labels=3),
        "ViTModel": lambda: T.ViTConfig(**_VIT),
        "DeiTForImageClassification": lambda: T.DeiTConfig(**_VIT, num_labels=3),
        "DeiTForImageClassificationWithTeacher": lambda: T.DeiTConfig(**_VIT, num_labels=3),
        "Dinov2ForImageClassification": lambda: T.Dinov2Config(**{**_VIT, "mlp_ratio": 2}, num_labels=3),
        "Dinov2Model": lambda: T.Dinov2Config(**{**_VIT, "mlp_ratio": 2, "use_swiglu_ffn": True}),
        "CLIPVisionModel": lambda: T.CLIPVisionConfig(**_VIT),
        "SiglipVisionModel": lambda: T.SiglipVisionConfig(**_VIT),
        "ResNetForImageClassification": lambda: T.ResNetConfig(**_RESNET, hidden_sizes=[32, 64], layer_type="bottleneck",
                                                               num_labels=3),
        "ResNetModel": lambda: T.ResNetConfig(**_RESNET, hidden_sizes=[8, 16], layer_type="basic"),
    }
    cfg = configs[cls_name]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = draw_(getattr(T, cls_name)(cfg)).eval()
    return model


CLASSES = ["ViTForImageClassification", "ViTModel", "DeiTForImageClassification",
           "DeiTForImageClassificationWithTeacher", "Dinov2ForImageClassification", "Dinov2Model", "CLIPVisionModel",
           "SiglipVisionModel", "ResNetForImageClassification", "ResNetModel"]
_CLASSIFIERS = {"ViTForImageClassification", "DeiTForImageClassification", "Dinov2ForImageClassification",
                "ResNetForImageClassification"}


def _images(cls_name: str, requires_grad: bool) -> torch.Tensor:
    side = 64 if cls_name.startswith("ResNet") else 32
    return torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1)).requires_grad_(requires_grad)


def _run(model, cls_name: str, x, labels):
    """The outputs compared, and the scalar whose gradients are compared (the labels= loss for a
    classifier; a fixed projection of every output for the others)."""
    out = model(pixel_values=x, labels=labels) if labels is not None else model(pixel_values=x)
    tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k != "loss"}
    if labels is not None:
        return tensors, out.loss, out.loss
    gen = torch.Generator().manual_seed(2)
    scalar = sum((v * torch.randn(v.shape, generator=gen)).sum() for v in tensors.values())
    return tensors, None, scalar


def _compare(cls_name: str, attn: str, opts: dict, grads: bool) -> dict:
    ref = _hf(cls_name)
    ours = fastzoo.create(pretrained=ref, attn=attn, attn_options=opts).eval()
    labels = torch.tensor([0, 2]) if cls_name in _CLASSIFIERS else None
    x_ref, x = _images(cls_name, grads), _images(cls_name, grads)
    with torch.set_grad_enabled(grads):
        want, want_loss, want_scalar = _run(ref, cls_name, x_ref, labels)
        got, got_loss, got_scalar = _run(ours, cls_name, x, labels)
    diffs = {}
    assert set(got) == set(want), (set(got), set(want))
    for k in want:
        diffs[k] = (got[k] - want[k]).abs().max().item()
    if labels is not None:
        diffs["loss"] = (got_loss - want_loss).abs().item()
    if grads:
        want_scalar.backward()
        got_scalar.backward()
        diffs["input grad"] = equivalence.compare_grads("input grad", {"x": x.grad}, {"x": x_ref.grad}).err
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        ref_grads = find_converter(spec_of(ours), Source(ref_grads, "grads")).to_fastzoo(ref_grads)
        our_grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
        assert set(our_grads) == set(ref_grads), set(our_grads) ^ set(ref_grads)
        diffs["param grads"] = equivalence.compare_grads("grads", our_grads, ref_grads).err
    return diffs


TRAIN = backends(backward=True)
INFER_ONLY = [b for b in backends() if b not in TRAIN]


def _id(b):
    return b[0] + "".join(f"-{v}" for v in b[1].values())


@pytest.mark.parametrize("attn,opts", TRAIN, ids=[_id(b) for b in TRAIN])
@pytest.mark.parametrize("cls_name", CLASSES)
def test_outputs_loss_and_every_gradient_equal_transformers(cls_name, attn, opts):
    diffs = _compare(cls_name, attn, opts, grads=True)
    assert max(diffs.values()) <= ATOL, diffs  # fp32 rule, see the module docstring


@pytest.mark.parametrize("attn,opts", INFER_ONLY, ids=[_id(b) for b in INFER_ONLY])
@pytest.mark.parametrize("cls_name", [c for c in CLASSES if not c.startswith("ResNet")])
def test_outputs_equal_transformers_on_inference_only_backends(cls_name, attn, opts):
    diffs = _compare(cls_name, attn, opts, grads=False)
    assert max(diffs.values()) <= ATOL, diffs


def test_the_output_class_is_transformers_own_and_the_timm_call_stays():
    ref = _hf("DeiTForImageClassificationWithTeacher")
    ours = fastzoo.create(pretrained=ref).eval()
    x = _images("Deit", False)
    out = ours(pixel_values=x)
    assert type(out) is type(ref(pixel_values=x))
    assert torch.allclose(ours(x), out.logits, atol=0)  # timm's call: the same logits as a tensor
    assert torch.allclose(ours.forward_head(ours.forward_features(x)), out.logits, atol=0)
    assert isinstance(ours(pixel_values=x, return_dict=False), tuple)


@pytest.mark.parametrize("labels,num_labels,problem", [
    (torch.tensor([0, 2]), 3, "single_label_classification"),
    (torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), 3, "multi_label_classification"),
    (torch.tensor([0.3, -1.2]), 1, "regression"),
])
def test_labels_loss_follows_transformers_problem_type_rule(labels, num_labels, problem):
    cfg = T.ViTConfig(**_VIT, num_labels=num_labels)
    ref = T.ViTForImageClassification(cfg).eval()
    ours = fastzoo.create(pretrained=ref).eval()
    x = _images("ViT", False)
    want, got = ref(pixel_values=x, labels=labels).loss, ours(pixel_values=x, labels=labels).loss
    assert ref.config.problem_type == ours.config.hf_config["problem_type"] == problem
    assert abs(got.item() - want.item()) <= ATOL


def test_num_items_in_batch_scales_the_summed_loss_as_transformers():
    ref = _hf("ViTForImageClassification")
    ours = fastzoo.create(pretrained=ref).eval()
    x, labels = _images("ViT", False), torch.tensor([1, -100])
    want = ref(pixel_values=x, labels=labels, num_items_in_batch=torch.tensor(4)).loss
    got = ours(pixel_values=x, labels=labels, num_items_in_batch=torch.tensor(4)).loss
    assert abs(got.item() - want.item()) <= ATOL


@pytest.mark.parametrize("cls_name", ["ViTForImageClassification", "Dinov2Model", "ResNetForImageClassification"])
def test_hidden_states_equal_transformers(cls_name):
    ref = _hf(cls_name)
    ours = fastzoo.create(pretrained=ref, attn="eager").eval()
    x = _images(cls_name, False)
    want, got = ref(pixel_values=x, output_hidden_states=True), ours(pixel_values=x, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states)
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert (a - b).abs().max().item() <= ATOL


@pytest.mark.parametrize("cls_name", CLASSES)
def test_save_pretrained_is_read_by_transformers_and_by_fastzoo(cls_name, tmp_path):
    ref = _hf(cls_name)
    ours = fastzoo.create(pretrained=ref).eval()
    ours.save_pretrained(tmp_path)
    back = getattr(T, cls_name).from_pretrained(tmp_path).eval()
    x = _images(cls_name, False)
    want, got = ref(pixel_values=x), back(pixel_values=x)
    for k in want.keys():  # transformers reads it with its default (SDPA) attention: the fp32 rule, not bit-equality
        assert (want[k] - got[k]).abs().max().item() <= ATOL, k
    again = fastzoo.create(pretrained=tmp_path).eval()  # no name: the directory's config.json says it
    assert again.config.hf_config["architectures"] == [cls_name]
    assert type(again(pixel_values=x)) is type(want)


@pytest.mark.parametrize("cls_name", CLASSES)
def test_export_state_dict_hf_loads_strictly_into_transformers(cls_name):
    ref = _hf(cls_name)
    ours = fastzoo.create(pretrained=ref)
    fresh = getattr(T, cls_name)(ref.config)
    fresh.load_state_dict(fastzoo.export_state_dict(ours, "hf"), strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_hub_files_older_key_names_load_too():
    """Checkpoints on the hub were written by transformers 4 (``encoder.layer.N.attention.attention.query``)."""
    ref = _hf("ViTForImageClassification")
    old = {}
    for k, v in ref.state_dict().items():
        for new, was in ((".layers.", ".encoder.layer."), ("attention.q_proj", "attention.attention.query"),
                         ("attention.k_proj", "attention.attention.key"), ("attention.v_proj", "attention.attention.value"),
                         ("attention.o_proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"),
                         ("mlp.fc2", "output.dense")):
            k = k.replace(new, was)
        old[k] = v
    assert "vit.encoder.layer.0.attention.attention.query.weight" in old
    ours = fastzoo.create("google/vit-base-patch16-224", pretrained=old, embed_dim=32, depth=2, num_heads=4, img_size=32,
                          patch_size=8).eval()
    x = _images("ViT", False)
    assert (ours(x) - ref(pixel_values=x).logits).abs().max().item() <= ATOL


def test_whole_clip_model_gives_its_vision_tower():
    cfg = T.CLIPConfig(vision_config=_VIT, text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                            intermediate_size=64, vocab_size=50))
    whole = T.CLIPModel(cfg).eval()
    ours = fastzoo.create(pretrained=whole).eval()
    assert ours.config.hf_config["architectures"] == ["CLIPVisionModel"]
    x = _images("CLIP", False)
    want, got = whole.vision_model(pixel_values=x), ours(pixel_values=x)
    assert (got.pooler_output - want.pooler_output).abs().max().item() <= ATOL
    assert (got.last_hidden_state - want.last_hidden_state).abs().max().item() <= ATOL


HUB = [n for n in fastzoo.list_models() if get_entry(n).config.get("hf_config") and n == get_entry(n).name]


@pytest.mark.parametrize("name", HUB)
def test_hub_name_is_its_config_json_read_by_transformers_with_the_same_parameter_count(name):
    """The hub id's fields equal transformers' reading of its config.json (through its config
    classes, every default), and the model has the parameters of transformers' model built from it."""
    from transformers import CONFIG_MAPPING

    entry = get_entry(name)
    hub = dict(entry.config["hf_config"])
    family = entry.spec.converter("hf")
    read = family.config_from_json(hub)
    mine = entry.spec.config_class.from_dict(dict(entry.config))
    theirs = entry.spec.config_class.from_dict(read)
    diff = {k: (getattr(mine, k), getattr(theirs, k)) for k in read if k != "hf_config" and
            mine.compared(k) != theirs.compared(k)}
    assert not diff
    ours = fastzoo.create(name, device="meta")
    cfg = CONFIG_MAPPING[hub.pop("model_type")](**{k: v for k, v in hub.items() if k != "architectures"})
    with torch.device("meta"):
        original = getattr(T, entry.config["hf_config"]["architectures"][0])(cfg)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in original.parameters())


def test_microsoft_resnet_50_has_torchvisions_parameter_count():
    ours = fastzoo.create("microsoft/resnet-50", device="meta")
    assert sum(p.numel() for p in ours.parameters()) == 25_557_032  # torchvision's resnet50


@pytest.mark.parametrize("source", ["timm", "torchvision", "transformers", "gpt2", "llama", "fastzoo"])
def test_create_without_a_name_reads_family_and_sizes_from_a_live_module(source):
    import timm
    import torchvision

    x32 = torch.randn(1, 3, 32, 32)
    built = {
        "timm": lambda: timm.create_model("vit_tiny_patch16_224", num_classes=5, depth=2, img_size=32),
        "torchvision": lambda: torchvision.models.resnet18(num_classes=7),
        "transformers": lambda: _hf("Dinov2ForImageClassification"),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                          num_key_value_heads=2, intermediate_size=64, vocab_size=100)),
        "fastzoo": lambda: fastzoo.create("resnet18", num_classes=4),
    }[source]().eval()
    ours = fastzoo.create(pretrained=built).eval()
    if source in ("gpt2", "llama"):
        ids = torch.randint(0, 100, (1, 8))
        assert (ours(ids).logits - built(ids).logits).abs().max().item() <= ATOL
    elif source == "transformers":
        assert (ours(x32) - built(pixel_values=x32).logits).abs().max().item() <= ATOL
    else:
        x = x32 if source == "timm" else torch.randn(1, 3, 64, 64)
        assert (ours(x) - built(x)).abs().max().item() <= ATOL
    if source == "fastzoo":
        assert ours.model_name == "resnet18" and ours.config.num_classes == 4


def test_create_without_a_name_reads_a_config_json_directory(tmp_path):
    built = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=100, n_positions=64)).eval()
    built.save_pretrained(tmp_path)
    ours = fastzoo.create(pretrained=tmp_path).eval()
    assert ours.family == "gpt2" and ours.config.n_head == 4


def test_create_without_a_name_names_a_registered_variant_when_sizes_match():
    source = fastzoo.create("microsoft/resnet-18")
    assert fastzoo.create(pretrained=source).model_name == "microsoft/resnet-18"


def test_a_bare_state_dict_still_needs_a_name_and_says_so():
    with pytest.raises(fastzoo.errors.CheckpointError, match=r"does not say which architecture.*fastzoo.create\(name"):
        fastzoo.create(pretrained=_hf("ViTModel").state_dict())
    with pytest.raises(TypeError, match="needs a model name"):
        fastzoo.create()


def test_an_hf_config_without_torchvisions_network_is_refused_by_name():
    cfg = T.ResNetConfig(**_RESNET, hidden_sizes=[32, 64], layer_type="bottleneck", downsample_in_bottleneck=True)
    with pytest.raises(fastzoo.errors.CheckpointError, match="downsample_in_bottleneck"):
        fastzoo.create(pretrained=T.ResNetForImageClassification(cfg))


def test_output_attentions_and_interpolation_are_refused_by_name():
    ours = fastzoo.create(pretrained=_hf("ViTModel"))
    x = _images("ViT", False)
    with pytest.raises(ValueError, match="output_attentions"):
        ours(pixel_values=x, output_attentions=True)
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        ours(pixel_values=x, interpolate_pos_encoding=True)


def test_mask_token_replaces_masked_patches_as_transformers():
    ref = _hf("Dinov2Model")
    ours = fastzoo.create(pretrained=ref, attn="eager").eval()
    x = _images("Dinov2", False)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, ::3] = True
    want, got = ref(pixel_values=x, bool_masked_pos=mask), ours(pixel_values=x, bool_masked_pos=mask)
    assert (got.last_hidden_state - want.last_hidden_state).abs().max().item() <= ATOL


def _digits(n: int, num_labels: int):
    """sklearn's 8x8 digits as 32x32 RGB images in [-1, 1] with their labels (mod num_labels)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images[:n], dtype=torch.float32).div(8).sub(1)
    x = torch.nn.functional.interpolate(x[:, None], size=32, mode="nearest").expand(-1, 3, -1, -1)
    return [{"pixel_values": x[i].clone(), "labels": int(d.target[i]) % num_labels} for i in range(n)]


def test_transformers_image_classification_recipe_runs_unchanged_and_trains_like_transformers(tmp_path):
    """transformers' image-classification guide (Trainer, DefaultDataCollator, remove_unused_columns=False,
    evaluation and checkpoints each epoch, the best model loaded at the end, an accuracy metric, gradient
    accumulation), at tiny size: the fastzoo model logs the losses transformers' own model logs from the
    same weights and data (1e-4: a few Adam steps of fp32 rounding), and evaluates to the same accuracy."""
    import numpy as np

    def run(model, out):
        args = T.TrainingArguments(
            output_dir=str(out), remove_unused_columns=False, eval_strategy="epoch", save_strategy="epoch",
            learning_rate=5e-4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
            per_device_eval_batch_size=8, num_train_epochs=2, warmup_steps=0.1, logging_steps=1,
            load_best_model_at_end=True, metric_for_best_model="accuracy", report_to=[], use_cpu=True, seed=0,
            disable_tqdm=True)
        trainer = T.Trainer(model=model, args=args, data_collator=T.DefaultDataCollator(),
                            train_dataset=_digits(64, 3), eval_dataset=_digits(24, 3),
                            compute_metrics=lambda p: {"accuracy": float((np.argmax(p.predictions, 1) == p.label_ids).mean())})
        trainer.train()
        history = trainer.state.log_history
        return ([h["loss"] for h in history if "loss" in h], [h["eval_accuracy"] for h in history if "eval_accuracy" in h],
                trainer.evaluate()["eval_accuracy"])

    hf = _hf("ViTForImageClassification").train()
    ours = fastzoo.create(pretrained=hf).train()
    want_losses, want_accs, _ = run(hf, tmp_path / "hf")
    got_losses, got_accs, got_final = run(ours, tmp_path / "fastzoo")
    assert len(got_losses) == len(want_losses) > 4
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) <= 1e-4, (got_losses, want_losses)
    assert got_accs == want_accs  # each epoch's evaluation
    # the best checkpoint came back (transformers 5.17's own model does not reload it here: its checkpoints are
    # written in the hub's older key names, which the Trainer's best-model load_state_dict does not rename)
    assert got_final == max(got_accs)


def test_set_attention_switches_an_hf_loaded_model_between_every_backend():
    ref = _hf("SiglipVisionModel")  # its attention-pooling head runs through the backend too
    ours = fastzoo.create(pretrained=ref).eval()
    x = _images("Siglip", False)
    want = ref(pixel_values=x).pooler_output
    with torch.no_grad():  # inference-only backends (flex on CPU) too
        for attn, opts in backends(dtype=torch.float32):
            ours.set_attention(attn, **opts)
            assert ours.attn_name == attn
            assert (ours(pixel_values=x).pooler_output - want).abs().max().item() <= ATOL, (attn, opts)


@pytest.mark.parametrize("cls_name", ["ViTForImageClassification", "SiglipVisionModel"])
def test_explain_reports_every_attention_layer_of_an_hf_loaded_model(cls_name):
    ours = fastzoo.create(pretrained=_hf(cls_name), attn="sdpa").eval()
    x = _images(cls_name, False)
    labels = torch.tensor([0, 1]) if cls_name in _CLASSIFIERS else None
    loss = (lambda out: out.loss) if labels is not None else (lambda out: out.pooler_output.sum())
    report = fastzoo.explain(ours, pixel_values=x, labels=labels, backward=True, loss=loss)
    attention = [r for r in report.rows if r.kind == "attention"]
    assert len(attention) == 2 + (cls_name == "SiglipVisionModel")  # two blocks (+ the pooling head)
    assert all(r.executed and r.fallback is None for r in attention), report.table()


@pytest.mark.parametrize("cls_name", ["ViTForImageClassification", "SiglipVisionModel", "ResNetForImageClassification"])
def test_recipes_keep_parity_on_an_hf_loaded_model(cls_name):
    """Every recipe the benchmarks run (bf16 autocast, bf16 weights, channels_last), through the
    transformers call, against transformers' model under the same recipe: the low-precision rule
    (at most 3x transformers' own error against fp32, plus 1e-5)."""
    from fastzoo.bench.recipes import Recipe, prepare, prepare_images
    from fastzoo.equivalence import compare_outputs

    ref = _hf(cls_name)
    ours = fastzoo.create(pretrained=ref, attn="sdpa").eval()
    x = _images(cls_name, False)
    key = "logits" if cls_name in _CLASSIFIERS else "pooler_output"
    with torch.no_grad():
        exact = ref(pixel_values=x)[key].float()
        for recipe in (Recipe("bf16 autocast"), Recipe("bf16"), Recipe("fp32", channels_last=True)):
            run = lambda m: prepare(m, recipe, "cpu")(pixel_values=prepare_images(x, recipe, "cpu"))[key].float()
            peer = run(copy.deepcopy(ref)) if recipe.precision != "fp32" else None
            result = compare_outputs(recipe.name, run(copy.deepcopy(ours)), exact, peer)
            assert result.passed, (recipe.name, result)


def test_gradient_checkpointing_as_transformers_enables_it_keeps_gradients():
    ours = fastzoo.create(pretrained=_hf("ViTForImageClassification")).eval()
    x, labels = _images("ViT", False), torch.tensor([0, 1])
    ours(pixel_values=x, labels=labels).loss.backward()
    plain = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ours.grad_checkpointing
    ours(pixel_values=x, labels=labels).loss.backward()
    assert max((p.grad - plain[n]).abs().max().item() for n, p in ours.named_parameters()) <= 1e-6


def test_readme_and_tour_recipe_for_a_transformers_vision_checkpoint(tmp_path):
    """README's "Transformers' vision checkpoints" block and the tour's advice, at tiny size."""
    from fastzoo.bench.tour import BRING

    _hf("ViTForImageClassification").save_pretrained(tmp_path / "vit_dir")
    hf = T.ViTForImageClassification.from_pretrained(tmp_path / "vit_dir")
    x, y = _images("ViT", False), torch.tensor([0, 2])
    for m in (fastzoo.create(pretrained=hf, attn="sdpa"), fastzoo.create(pretrained=tmp_path / "vit_dir")):
        out = m.eval()(pixel_values=x, labels=y)
        assert type(out).__name__ == "ImageClassifierOutput" and out.loss is not None
        assert torch.equal(m(x), out.logits)
    m.save_pretrained(tmp_path / "out")
    back = T.ViTForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert (back(pixel_values=x).logits - out.logits).abs().max().item() <= ATOL
    sd = _hf("Dinov2Model").state_dict()
    d = fastzoo.create("facebook/dinov2-small", pretrained=sd, embed_dim=32, depth=2, num_heads=4, img_size=32, patch_size=8,
                       mlp_ratio=3.0, mlp_layer="swiglu_packed")
    assert d.config.hf_config["architectures"] == ["Dinov2Model"]
    assert "fastzoo.create(pretrained=X)" in BRING and 'fastzoo.create("google/vit-base-patch16-224", pretrained=sd)' in BRING
    vit = fastzoo.create("google/vit-base-patch16-224", pretrained=hf.state_dict(), embed_dim=32, depth=2, num_heads=4,
                         img_size=32, patch_size=8, num_classes=3)
    assert (vit.eval()(x) - hf.eval()(pixel_values=x).logits).abs().max().item() <= ATOL


@pytest.mark.parametrize("cls_name,side", [("Dinov2Model", 48), ("Dinov2Model", 16), ("ViTForImageClassification", 48),
                                           ("SiglipVisionModel", 24)])
def test_another_image_size_resamples_positions_as_transformers_interpolate_pos_encoding(cls_name, side):
    """``create(..., img_size=N)`` from a transformers model equals that model at N px with
    ``interpolate_pos_encoding`` (DINOv2 always interpolates): bicubic without antialias, as it resamples."""
    ref = _hf(cls_name)
    with pytest.warns(UserWarning, match="interpolate_pos_encoding"):
        ours = fastzoo.create(pretrained=ref, img_size=side, attn="eager").eval()
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(3))
    kw = {} if cls_name.startswith("Dinov2") else {"interpolate_pos_encoding": True}
    want, got = ref(pixel_values=x, **kw), ours(pixel_values=x)
    key = "logits" if cls_name in _CLASSIFIERS else "pooler_output"
    assert (got[key] - want[key]).abs().max().item() <= ATOL


@pytest.mark.parametrize("layer_type", ["bottleneck", "basic"])
def test_resnet_with_transformers_own_widths_equals_it(layer_type):
    """transformers' ResNet with a stem and stage widths torchvision's has not (its own tests' config:
    embedding_size 64, hidden_sizes 10/20/30/40): stem_width / out_channels; from the live model, from
    its bare state dict (the widths read from the keys), and back."""
    cfg = T.ResNetConfig(embedding_size=64, hidden_sizes=[10, 20, 30, 40], depths=[1, 1, 2, 1], layer_type=layer_type,
                         num_labels=3)
    torch.manual_seed(0)
    ref = T.ResNetForImageClassification(cfg).eval()
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    for source in (ref, ref.state_dict()):
        ours = (fastzoo.create(pretrained=source) if source is ref else
                fastzoo.create("microsoft/resnet-50", pretrained=source)).eval()
        want, got = ref(pixel_values=x, labels=labels), ours(pixel_values=x, labels=labels)
        assert (got.logits - want.logits).abs().max().item() <= ATOL and abs(got.loss.item() - want.loss.item()) <= ATOL
    fresh = T.ResNetForImageClassification(cfg)
    fresh.load_state_dict(fastzoo.export_state_dict(ours, "hf"), strict=True)
