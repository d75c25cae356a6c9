"""Building blocks shared by the models, one concept per file."""
from fastzoo.layers.activations import ACTIVATIONS, QuickGELU
from fastzoo.layers.attention import Attention, UsesAttention
from fastzoo.layers.drop_path import DropPath
from fastzoo.layers.layer_scale import LayerScale
from fastzoo.layers.mlp import Mlp
from fastzoo.layers.patch_embed import PatchEmbed

__all__ = ["ACTIVATIONS", "Attention", "DropPath", "LayerScale", "Mlp", "PatchEmbed", "QuickGELU", "UsesAttention"]
