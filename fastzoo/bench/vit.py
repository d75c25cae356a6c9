"""ViT suite: fastzoo per attention backend vs timm's own ``VisionTransformer`` on the same
weights, plus FlexAttention vs eager on masks only a flexible kernel expresses (logit
soft-capping, 2-D neighbourhood attention over the patch grid)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache

import torch

import fastzoo
from fastzoo.bench.harness import Case, Group, Suite
from fastzoo.bench.steps import check_mode, classification_loss, model_step


@dataclass(frozen=True)
class ViTSetting:
    name: str
    img_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    num_classes: int = 1000

    @property
    def tokens(self) -> int:
        return (self.img_size // self.patch_size) ** 2

    def describe(self) -> str:
        return (f"{self.depth} layers x {self.num_heads} heads x {self.embed_dim // self.num_heads} dims, "
                f"{self.img_size}/{self.patch_size} ({self.tokens} tokens)")


# The articles' configurations: ViT-L/16 shape at 224, and a long-sequence ViT at patch 4.
ARTICLE_SETTINGS = (
    ViTSetting("L/16 224", 224, 16, 1024, 24, 16),
    ViTSetting("long seq, patch 4", 224, 4, 768, 6, 12),
)
# Quick (2-core CPU in minutes): the same layer shapes with fewer layers and, for the long
# one, patch 8; a ViT's step time is linear in depth, so backend ratios carry over.
QUICK_SETTINGS = (
    ViTSetting("L/16 224, 2 of 24 layers", 224, 16, 1024, 2, 16),
    ViTSetting("long seq, 1 of 6 layers, patch 8", 224, 8, 768, 1, 12),
)
MASK_VARIANTS = {  # name -> backend options (the same preset on eager and flex)
    "softcap 50": {"score_mod": "softcap", "softcap": 50.0},
    "2-D neighbourhood r=3": {"mask_mod": "neighborhood", "radius": 3},
}


def setting_from_model(name: str) -> ViTSetting:
    """The registry's config of a named ViT (``vit_b16``...)."""
    from fastzoo.registry import get_entry

    cfg = get_entry(name).config
    img = cfg.get("img_size", 224)
    return ViTSetting(name, img if isinstance(img, int) else img[0], cfg.get("patch_size", 16), cfg["embed_dim"],
                      cfg["depth"], cfg["num_heads"])


def _timm_model(s: ViTSetting, seed: int):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    return VisionTransformer(img_size=s.img_size, patch_size=s.patch_size, embed_dim=s.embed_dim, depth=s.depth,
                             num_heads=s.num_heads, num_classes=s.num_classes).eval()


def _fastzoo_model(timm_model, s: ViTSetting, attn: str, device, dtype, options=None):
    model = fastzoo.create("vit_b16", attn="eager", pretrained=timm_model, patch_size=s.patch_size,
                           embed_dim=s.embed_dim, depth=s.depth, num_heads=s.num_heads)
    model.set_attention(attn, device=device, dtype=dtype, **(options or {}))
    return model.to(device=device, dtype=dtype)


def _flex_trains_on(device) -> bool:
    from fastzoo.attention import backend_class

    return device.type in backend_class("flex").capabilities.backward


def _timm_copy(timm_model, fused: bool, device, dtype):
    m = copy.deepcopy(timm_model)
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = fused
    return m.to(device=device, dtype=dtype)


def vit_suite(
    settings=ARTICLE_SETTINGS,
    *,
    backends: list[str],
    modes=("eval", "train"),
    compile_modes=(False,),
    batch_size: int = 8,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    masks: bool = True,
    seed: int = 0,
) -> Suite:
    device = torch.device(device)
    groups = []
    for s in settings:
        timm_model = _timm_model(s, seed)
        g = torch.Generator().manual_seed(seed)
        images = torch.randn(batch_size, 3, s.img_size, s.img_size, generator=g).to(device, dtype)
        labels = torch.randint(0, s.num_classes, (batch_size,), generator=g).to(device)
        loss = classification_loss(labels)

        def step(model, mode, compiled, images=images, loss=loss):
            return model_step(model, (images,), mode=mode, loss=loss, items=batch_size, compile=compiled)

        @cache
        def reference(mode, options=(), s=s, timm_model=timm_model, images=images, loss=loss):
            model = _fastzoo_model(timm_model, s, "eager", device, torch.float32, dict(options))
            return model_step(model, (images.float(),), mode=mode, loss=loss, items=batch_size).outputs()

        for mode in map(check_mode, modes):
            for compiled in compile_modes:
                suffix = f"{s.name} | {mode}" + (" | compiled" if compiled else "")
                cases = [
                    Case("timm (sdpa)", lambda t=timm_model, m=mode, c=compiled: step(_timm_copy(t, True, device, dtype), m, c),
                         peer=True, compiled=compiled),
                    Case("timm (eager)", lambda t=timm_model, m=mode, c=compiled: step(_timm_copy(t, False, device, dtype), m, c),
                         compiled=compiled),
                ]
                for b in backends:
                    cases.append(Case(
                        f"fastzoo {b}",
                        lambda t=timm_model, s=s, b=b, m=mode, c=compiled: step(_fastzoo_model(t, s, b, device, dtype), m, c),
                        reference=b == "eager", compiled=compiled))
                groups.append(Group(suffix, cases, reference=lambda m=mode, ref=reference: ref(m)))
                if not masks or "flex" not in backends or (mode == "train" and not _flex_trains_on(device)):
                    continue
                for variant, opts in MASK_VARIANTS.items():
                    cases = [
                        Case(f"fastzoo {b}", lambda t=timm_model, s=s, b=b, m=mode, c=compiled, o=opts: step(
                            _fastzoo_model(t, s, b, device, dtype, o), m, c), peer=b == "eager", reference=b == "eager",
                            compiled=compiled)
                        for b in ("eager", "flex")
                    ]
                    key = tuple(sorted(opts.items()))
                    groups.append(Group(f"{suffix} | {variant}", cases, reference=lambda m=mode, k=key, ref=reference: ref(m, k)))
    config = {s.name: s.describe() for s in settings}
    config.update({"batch size": batch_size, "peer": "timm VisionTransformer (fused_attn=True: sdpa)"})
    if masks and "flex" in backends:
        config["mask variants"] = "flex vs eager (the peer there: no library has these masks)" + (
            "" if _flex_trains_on(device) else f"; eval only: flex has no backward on {device.type}")
    if "flex" in backends and device.type == "cpu":
        config["flex on CPU"] = ("not compiled: PyTorch runs it unfused (materialises the scores); compiled flex on CPU "
                                 "is refused (wrong results seen with torch 2.14.1), so its compiled rows say so")
    return Suite("vit", groups, config=config, dtype=dtype, device=device)
