"""Building blocks shared by the models, one concept per file."""
from fastzoo.layers.activations import ACTIVATIONS, QuickGELU
from fastzoo.layers.attention import Attention, UsesAttention
from fastzoo.layers.drop_path import DropPath
from fastzoo.layers.layer_scale import LayerScale
from fastzoo.layers.attention_pool import AttentionPoolLatent
from fastzoo.layers.mlp import GatedMlp, Mlp, PackedGluMlp
from fastzoo.layers.norm import RMSNorm
from fastzoo.layers.patch_embed import PatchEmbed
from fastzoo.layers.rotary import RotaryEmbedding, apply_rotary

__all__ = ["ACTIVATIONS", "Attention", "AttentionPoolLatent", "DropPath", "GatedMlp", "LayerScale", "Mlp", "PackedGluMlp", "PatchEmbed", "QuickGELU", "RMSNorm",
           "RotaryEmbedding", "UsesAttention", "apply_rotary"]
