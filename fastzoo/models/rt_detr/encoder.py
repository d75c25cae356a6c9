"""RT-DETR's hybrid encoder (Zhao et al. 2024, "DETRs Beat YOLOs on Real-time Object Detection"), as
transformers' ``RTDetrHybridEncoder`` computes it, under its module names: AIFI (a transformer encoder on
the coarsest map only, with a 2-D sine position embedding, attention through fastzoo's backends) and CCFM
(a top-down FPN then a bottom-up PAN of CSP layers made of RepVGG blocks). AIFI's layers are
``GradientCheckpointingLayer`` s, as DETR's (``models/detr/transformer.py`` says how).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from fastzoo.attention.base import AttnContext
from fastzoo.models.detr.transformer import ACTIVATIONS, DetrAttention
from fastzoo.models.rt_detr.config import RTDetrConfig


class RTDetrMLP(nn.Module):
    """fc1 -> activation -> dropout -> fc2 -> dropout."""

    def __init__(self, cfg: RTDetrConfig, width: int, ffn_dim: int, activation: str):
        super().__init__()
        self.fc1 = nn.Linear(width, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, width)
        self.act, self.activation_dropout, self.dropout = ACTIVATIONS[activation], cfg.activation_dropout, cfg.dropout

    def forward(self, x):
        x = F.dropout(self.act(self.fc1(x)), self.activation_dropout, self.training)
        return F.dropout(self.fc2(x), self.dropout, self.training)


class RTDetrConvNormLayer(nn.Module):
    """conv (no bias) -> BatchNorm (``batch_norm_eps``) -> activation (or none)."""

    def __init__(self, cfg: RTDetrConfig, cin: int, cout: int, kernel_size: int, stride: int, padding: int | None = None,
                 activation: str | None = None):
        super().__init__()
        padding = (kernel_size - 1) // 2 if padding is None else padding
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride, padding=padding, bias=False)
        self.norm = nn.BatchNorm2d(cout, cfg.batch_norm_eps)
        self.act = None if activation is None else ACTIVATIONS[activation]

    def forward(self, x):
        x = self.norm(self.conv(x))
        return x if self.act is None else self.act(x)


class RTDetrRepVggBlock(nn.Module):
    """RepVGG (Ding et al. 2021): a 3x3 and a 1x1 conv-norm summed, then the activation."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        c = int(cfg.encoder_hidden_dim * cfg.hidden_expansion)
        self.conv1 = RTDetrConvNormLayer(cfg, c, c, 3, 1, padding=1)
        self.conv2 = RTDetrConvNormLayer(cfg, c, c, 1, 1, padding=0)
        self.act = ACTIVATIONS[cfg.activation_function]

    def forward(self, x):
        return self.act(self.conv1(x) + self.conv2(x))


class RTDetrCSPRepLayer(nn.Module):
    """Cross Stage Partial: two 1x1 branches of the concatenated maps, one through three RepVGG blocks,
    summed (and a 1x1 back to the width when ``hidden_expansion`` changed it)."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        cin, cout, act = 2 * cfg.encoder_hidden_dim, cfg.encoder_hidden_dim, cfg.activation_function
        hidden = int(cout * cfg.hidden_expansion)
        self.conv1 = RTDetrConvNormLayer(cfg, cin, hidden, 1, 1, activation=act)
        self.conv2 = RTDetrConvNormLayer(cfg, cin, hidden, 1, 1, activation=act)
        self.bottlenecks = nn.Sequential(*[RTDetrRepVggBlock(cfg) for _ in range(3)])
        self.conv3 = RTDetrConvNormLayer(cfg, hidden, cout, 1, 1, activation=act) if hidden != cout else nn.Identity()

    def forward(self, x):
        return self.conv3(self.bottlenecks(self.conv1(x)) + self.conv2(x))


class RTDetrEncoderLayer(GradientCheckpointingLayer):
    """AIFI's transformer layer: self-attention (position embedding on queries and keys; its
    probabilities' dropout is ``dropout``, as transformers'), MLP; post-norm (``normalize_before``: pre-norm,
    transformers' variant of it)."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        d = cfg.encoder_hidden_dim
        self.normalize_before = cfg.normalize_before
        self.self_attn = DetrAttention(d, cfg.encoder_attention_heads, cfg.dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = RTDetrMLP(cfg, d, cfg.encoder_ffn_dim, cfg.encoder_activation_function)
        self.final_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.dropout = cfg.dropout

    def forward(self, x_BSD, pos_BSD, ctx: AttnContext):
        h = self.self_attn_layer_norm(x_BSD) if self.normalize_before else x_BSD
        x_BSD = x_BSD + F.dropout(self.self_attn(h, pos_BSD, ctx), self.dropout, self.training)
        if not self.normalize_before:
            x_BSD = self.self_attn_layer_norm(x_BSD)
        # pre-norm: the MLP's residual is the normalised input (transformers'), post-norm: the layer's
        x_BSD = self.final_layer_norm(x_BSD) if self.normalize_before else x_BSD
        x_BSD = x_BSD + self.mlp(x_BSD)
        if not self.normalize_before:
            x_BSD = self.final_layer_norm(x_BSD)
        if self.training:  # transformers clamps non-finite values (after a host read): the same, without it
            big = torch.finfo(x_BSD.dtype).max - 1000
            x_BSD = x_BSD.clamp(-big, big)
        return x_BSD


def sine_embedding_2d(h: int, w: int, dim: int, temperature: float, device, dtype) -> torch.Tensor:
    """``[1, h*w, dim]``: per position (row-major) ``[sin(y w_k) | cos(y w_k) | sin(x w_k) | cos(x w_k)]``,
    ``w_k = temperature^(-k / (dim/4))``, computed in fp64 (transformers' ``build_2d_sinusoidal_position_embedding``)."""
    n = dim // 4
    omega = 1.0 / temperature ** (torch.arange(n, dtype=torch.float64, device=device) / n)
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64, device=device),
                          torch.arange(w, dtype=torch.float64, device=device), indexing="ij")
    ey, ex = y.flatten().outer(omega), x.flatten().outer(omega)
    return torch.cat([ey.sin(), ey.cos(), ex.sin(), ex.cos()], dim=1).to(dtype)[None]


class RTDetrAIFILayer(nn.Module):
    """Attention-based intra-scale feature interaction: the map's tokens through the encoder layers."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(RTDetrEncoderLayer(cfg) for _ in range(cfg.encoder_layers))

    def forward(self, x_BCHW):
        cfg = self.config
        B, C, H, W = x_BCHW.shape
        x_BSD = x_BCHW.flatten(2).transpose(1, 2)
        pos = None  # transformers drops the embedding in eval mode when eval_size is set
        if self.training or cfg.eval_size is None:
            pos = sine_embedding_2d(H, W, C, cfg.positional_encoding_temperature, x_BSD.device, x_BSD.dtype)
        ctx = AttnContext()
        for layer in self.layers:
            x_BSD = layer(x_BSD, pos, ctx)
        return x_BSD.transpose(1, 2).reshape(B, C, H, W).contiguous()


class RTDetrHybridEncoder(nn.Module):
    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        self.config = cfg
        d, act, n = cfg.encoder_hidden_dim, cfg.activation_function, len(cfg.encoder_in_channels) - 1
        self.aifi = nn.ModuleList(RTDetrAIFILayer(cfg) for _ in cfg.encode_proj_layers)
        self.lateral_convs = nn.ModuleList(RTDetrConvNormLayer(cfg, d, d, 1, 1, activation=act) for _ in range(n))
        self.fpn_blocks = nn.ModuleList(RTDetrCSPRepLayer(cfg) for _ in range(n))
        self.downsample_convs = nn.ModuleList(RTDetrConvNormLayer(cfg, d, d, 3, 2, activation=act) for _ in range(n))
        self.pan_blocks = nn.ModuleList(RTDetrCSPRepLayer(cfg) for _ in range(n))

    def forward(self, maps: list[torch.Tensor]) -> list[torch.Tensor]:
        """The projected backbone maps (finest first) -> the encoder's maps, finest first."""
        maps = list(maps)
        if self.config.encoder_layers > 0:
            for aifi, i in zip(self.aifi, self.config.encode_proj_layers):
                maps[i] = aifi(maps[i])
        n = len(self.lateral_convs)
        fpn = [maps[-1]]  # top-down
        for idx, (lateral, block) in enumerate(zip(self.lateral_convs, self.fpn_blocks)):
            top = lateral(fpn[-1])
            fpn[-1] = top
            up = F.interpolate(top, scale_factor=2.0, mode="nearest")
            fpn.append(block(torch.concat([up, maps[n - idx - 1]], dim=1)))
        fpn.reverse()
        pan = [fpn[0]]  # bottom-up
        for idx, (down, block) in enumerate(zip(self.downsample_convs, self.pan_blocks)):
            pan.append(block(torch.concat([down(pan[-1]), fpn[idx + 1]], dim=1)))
        return pan
