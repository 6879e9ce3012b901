"""The zoo: models nobody on the team wrote, for ``tests/test_zoo.py`` (gradients against autograd, float64)
and ``bench/zoo.py`` (a training step against autograd, float32).

Three families:

* ``tv_*``: torchvision's models, built with random weights (no downloads), at small widths and depths
  through their constructors' arguments where they have them; dropout and stochastic depth at 0 so both
  sides of a comparison run the same numbers in train mode (BatchNorm with batch statistics).
* ``timm_*``: ``timm.create_model(name, pretrained=False, num_classes=10, ...)`` at small sizes.
* everything else: code as it is posted in popular repositories (nanoGPT, a LLaMA block, the TCN of
  locuslab/TCN, milesial's U-Net, recurrent taggers and language models, in-place forms), written here as
  people write it, not shaped for the scan.

A :class:`Case` builds a fresh, seeded model (two calls give identical weights) at a ``size``
(``"test"``: small enough for a float64 comparison on two cores; ``"bench"``: what a user would train)
and a batch of its inputs; :attr:`Case.output` picks the tensor a loss reads from what the model returns
(the logits of a model that also returns its state or its loss).

torchvision's wheel on the package index is a CUDA build: next to the CPU torch, ``import torchvision``
fails registering fake kernels of its C++ operators (``torchvision::nms`` ...), which the CPU torch does
not have. :func:`import_torchvision` imports it with those registrations skipped (its model code is pure
Python and needs none of them); timm imports torchvision, so :func:`import_timm` goes through it too.
Neither is ever needed by the library itself.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Case", "CASES", "CASE_NAMES", "BY_NAME", "WordLanguageModel", "import_torchvision", "import_timm",
           "missing"]


# ------------------------------------------------------------------------------------ importing torchvision


def _op_exists(qualname: str) -> bool:
    ns, _, op = qualname.partition("::")
    try:
        getattr(getattr(torch.ops, ns), op.split(".")[0])
        return True
    except (AttributeError, RuntimeError):
        return False


@contextlib.contextmanager
def _skip_missing_torchvision_fakes() -> Iterator[None]:
    """``torch.library.register_fake`` skips ``torchvision::`` operators that do not exist, for the duration
    of the block (the fake kernel is returned undecorated); everything else registers as usual."""
    real = torch.library.register_fake

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::") and not _op_exists(op):
            func = args[0] if args and callable(args[0]) else kwargs.get("func")
            return func if func is not None else (lambda f: f)
        return real(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        yield
    finally:
        torch.library.register_fake = real


def import_torchvision():
    """``torchvision``, imported with the fake kernels of its missing C++ operators skipped (a CUDA wheel
    next to a CPU torch); ``ImportError`` where it is not installed."""
    import sys

    if sys.modules.get("torchvision") is not None:
        return sys.modules["torchvision"]
    with _skip_missing_torchvision_fakes():
        return importlib.import_module("torchvision")


def import_timm():
    """``timm`` (which imports torchvision: through :func:`import_torchvision` first)."""
    import_torchvision()
    return importlib.import_module("timm")


def missing(needs: tuple[str, ...]) -> Optional[str]:
    """Why a case that needs ``needs`` cannot run here (None: it can)."""
    for name in needs:
        try:
            {"torchvision": import_torchvision, "timm": import_timm}[name]()
        except Exception as e:  # noqa: BLE001 - not installed, or installed but broken: the case is skipped
            return f"{name} is not importable here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


# ------------------------------------------------------------------------------------ the case


@dataclass(frozen=True)
class Case:
    """One model of the zoo.

    ``make(size)`` returns a fresh model (float32, train mode); ``inputs(batch, size, generator)`` a batch of
    its inputs (floating images or sequences, or token ids). ``output`` picks the tensor a loss reads from
    what the model returns. ``bench_batch`` is the batch of a benchmark step."""

    name: str
    family: str
    make: Callable[[str], nn.Module]
    inputs: Callable[[int, str, torch.Generator], torch.Tensor]
    needs: tuple[str, ...] = ()
    output: Callable[[Any], torch.Tensor] = field(default=lambda out: out)
    bench_batch: int = 16
    note: str = ""

    def build(self, size: str = "test", seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.make(size)

    def batch(self, batch: int, size: str = "test", seed: int = 0) -> torch.Tensor:
        return self.inputs(batch, size, torch.Generator().manual_seed(seed))


def _images(hw_test: int, hw_bench: Optional[int] = None, channels: int = 3):
    def inputs(b: int, size: str, g: torch.Generator) -> torch.Tensor:
        hw = hw_test if size == "test" else (hw_bench or hw_test)
        return torch.randn(b, channels, hw, hw, generator=g)

    return inputs


def _tokens(vocab: int, t_test: int, t_bench: int):
    def inputs(b: int, size: str, g: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocab, (b, t_test if size == "test" else t_bench), generator=g)

    return inputs


def _first(out):
    return out[0]


# ------------------------------------------------------------------------------------ torchvision


def _tv():
    return import_torchvision().models


def tv_resnet18(size: str) -> nn.Module:
    return _tv().resnet18(num_classes=10)


def tv_mobilenet_v3_small(size: str) -> nn.Module:
    return _tv().mobilenet_v3_small(num_classes=10, dropout=0.0)


def tv_mobilenet_v2(size: str) -> nn.Module:
    return _tv().mobilenet_v2(num_classes=10, dropout=0.0)


def tv_efficientnet_b0(size: str) -> nn.Module:
    return _tv().efficientnet_b0(num_classes=10, dropout=0.0, stochastic_depth_prob=0.0)


def tv_shufflenet_v2_x0_5(size: str) -> nn.Module:
    return _tv().shufflenet_v2_x0_5(num_classes=10)


def tv_squeezenet1_1(size: str) -> nn.Module:
    return _tv().squeezenet1_1(num_classes=10, dropout=0.0)


def tv_densenet(size: str) -> nn.Module:
    """A small DenseNet-BC: three dense blocks of two layers, growth 8."""
    from torchvision.models.densenet import DenseNet

    _tv()
    return DenseNet(growth_rate=8, block_config=(2, 2, 2), num_init_features=16, bn_size=2, num_classes=10)


def tv_mnasnet0_5(size: str) -> nn.Module:
    return _tv().mnasnet0_5(num_classes=10, dropout=0.0)


def tv_regnet_x_400mf(size: str) -> nn.Module:
    return _tv().regnet_x_400mf(num_classes=10)


def tv_vit(size: str) -> nn.Module:
    """torchvision's VisionTransformer, tiny: 32x32 images in 8x8 patches, two layers of width 32."""
    _tv()
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)


def tv_convnext(size: str) -> nn.Module:
    """torchvision's ConvNeXt with two small stages (16 and 32 channels, one block each)."""
    _tv()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.0,
                    num_classes=10)


def tv_swin(size: str) -> nn.Module:
    """torchvision's Swin Transformer, tiny: 4x4 patches of 32x32 images, windows of 4, two stages."""
    _tv()
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[4, 4],
                           stochastic_depth_prob=0.0, num_classes=10)


def tv_googlenet(size: str) -> nn.Module:
    return _tv().googlenet(num_classes=10, aux_logits=False, init_weights=True, dropout=0.0)


def tv_inception_v3(size: str) -> nn.Module:
    return _tv().inception_v3(num_classes=10, aux_logits=False, init_weights=True, dropout=0.0)


# ------------------------------------------------------------------------------------ timm


def _timm(name: str, **kwargs):
    def make(size: str) -> nn.Module:
        return import_timm().create_model(name, pretrained=False, num_classes=10, **kwargs)

    return make


def timm_mixer(size: str) -> nn.Module:
    """timm's MlpMixer, small: 32x32 images in 8x8 patches (16 tokens), two blocks of width 64 (the
    registered ``mixer_*`` names fix patch size, depth and width)."""
    import_timm()
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=64)


# ------------------------------------------------------------------------------------ nanoGPT
# Karpathy's nanoGPT model.py, as it is (the flash / masked attention switch made a config field: the
# original picks it by hasattr(F, "scaled_dot_product_attention"), always true on torch 2)


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True


class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention make GPU go brrrrr but support is only in PyTorch >= 2.0
        self.flash = config.flash
        if not self.flash:
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            # if we are given some desired targets also calculate the loss
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None

        return logits, loss


def nanogpt(size: str) -> nn.Module:
    return GPT(GPTConfig(block_size=32 if size == "test" else 256, n_embd=32 if size == "test" else 128,
                         n_layer=2, n_head=2 if size == "test" else 4, vocab_size=64))


def nanogpt_masked(size: str) -> nn.Module:
    """nanoGPT's attention without flash: the causal mask a ``register_buffer``, softmax by hand."""
    return GPT(GPTConfig(block_size=32 if size == "test" else 256, n_embd=32 if size == "test" else 128,
                         n_layer=2, n_head=2 if size == "test" else 4, vocab_size=64, flash=False))


# ------------------------------------------------------------------------------------ a LLaMA block
# in the style of the popular minimal LLaMA ports (HF's rotate_half rotary, a RMSNorm module, SwiGLU)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x)
        return output * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, device=x.device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = xk.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xv = xv.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(xv, seq_len=seqlen)
        xq, xk = apply_rotary_pos_emb(xq, xk, cos, sin)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int = 32):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, 4 * dim)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Llama(nn.Module):
    def __init__(self, vocab_size=64, dim=32, n_layers=2, n_heads=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return self.output(h)  # Meta's llama adds .float(): left out, the tests compare float64


def llama(size: str) -> nn.Module:
    return Llama(dim=32, n_heads=2) if size == "test" else Llama(dim=128, n_heads=4)


# ------------------------------------------------------------------------------------ TCN (locuslab/TCN)


class Chomp1d(nn.Module):
    def __init__(self, chomp_size):
        super(Chomp1d, self).__init__()
        self.chomp_size = chomp_size

    def forward(self, x):
        return x[:, :, :-self.chomp_size].contiguous()


class TemporalBlock(nn.Module):
    def __init__(self, n_inputs, n_outputs, kernel_size, stride, dilation, padding, dropout=0.2, old=False):
        super(TemporalBlock, self).__init__()
        weight_norm = nn.utils.weight_norm if old else nn.utils.parametrizations.weight_norm
        self.conv1 = weight_norm(nn.Conv1d(n_inputs, n_outputs, kernel_size,
                                           stride=stride, padding=padding, dilation=dilation))
        self.chomp1 = Chomp1d(padding)
        self.relu1 = nn.ReLU()
        self.dropout1 = nn.Dropout(dropout)

        self.conv2 = weight_norm(nn.Conv1d(n_outputs, n_outputs, kernel_size,
                                           stride=stride, padding=padding, dilation=dilation))
        self.chomp2 = Chomp1d(padding)
        self.relu2 = nn.ReLU()
        self.dropout2 = nn.Dropout(dropout)

        self.net = nn.Sequential(self.conv1, self.chomp1, self.relu1, self.dropout1,
                                 self.conv2, self.chomp2, self.relu2, self.dropout2)
        self.downsample = nn.Conv1d(n_inputs, n_outputs, 1) if n_inputs != n_outputs else None
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.net(x)
        res = x if self.downsample is None else self.downsample(x)
        return self.relu(out + res)


class TemporalConvNet(nn.Module):
    def __init__(self, num_inputs, num_channels, kernel_size=2, dropout=0.2, old=False):
        super(TemporalConvNet, self).__init__()
        layers = []
        num_levels = len(num_channels)
        for i in range(num_levels):
            dilation_size = 2 ** i
            in_channels = num_inputs if i == 0 else num_channels[i - 1]
            out_channels = num_channels[i]
            layers += [TemporalBlock(in_channels, out_channels, kernel_size, stride=1, dilation=dilation_size,
                                     padding=(kernel_size - 1) * dilation_size, dropout=dropout, old=old)]

        self.network = nn.Sequential(*layers)

    def forward(self, x):
        return self.network(x)


class TCN(nn.Module):
    def __init__(self, input_size, output_size, num_channels, kernel_size, dropout, old=False):
        super(TCN, self).__init__()
        self.tcn = TemporalConvNet(input_size, num_channels, kernel_size=kernel_size, dropout=dropout, old=old)
        self.linear = nn.Linear(num_channels[-1], output_size)

    def forward(self, inputs):
        """Inputs have to have dimension (N, C_in, L_in)"""
        y1 = self.tcn(inputs)  # input should have dimension (N, C_in, L_in)
        o = self.linear(y1[:, :, -1])
        return F.log_softmax(o, dim=1)


def tcn(size: str) -> nn.Module:
    """locuslab's sequential-MNIST TCN (``parametrizations.weight_norm``), dropout 0."""
    return TCN(1, 10, [8, 8, 8] if size == "test" else [25] * 4, kernel_size=3 if size == "test" else 7, dropout=0.0)


def tcn_old_weight_norm(size: str) -> nn.Module:
    """The same TCN with the old ``torch.nn.utils.weight_norm`` (a forward pre-hook), as locuslab wrote it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        return TCN(1, 10, [8, 8, 8] if size == "test" else [25] * 4, kernel_size=3 if size == "test" else 7,
                   dropout=0.0, old=True)


def _sequence(t_test: int, t_bench: int, features: int = 1, layout: str = "NCL"):
    def inputs(b: int, size: str, g: torch.Generator) -> torch.Tensor:
        t = t_test if size == "test" else t_bench
        shape = (b, features, t) if layout == "NCL" else (b, t, features)
        return torch.randn(*shape, generator=g)

    return inputs


# ------------------------------------------------------------------------------------ U-Net (milesial/Pytorch-UNet)


class DoubleConv(nn.Module):
    """(convolution => [BN] => ReLU) * 2"""

    def __init__(self, in_channels, out_channels, mid_channels=None):
        super().__init__()
        if not mid_channels:
            mid_channels = out_channels
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True)
        )

    def forward(self, x):
        return self.double_conv(x)


class Down(nn.Module):
    """Downscaling with maxpool then double conv"""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.maxpool_conv = nn.Sequential(
            nn.MaxPool2d(2),
            DoubleConv(in_channels, out_channels)
        )

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    """Upscaling then double conv"""

    def __init__(self, in_channels, out_channels, bilinear=True):
        super().__init__()

        # if bilinear, use the normal convolutions to reduce the number of channels
        if bilinear:
            self.up = nn.Upsample(scale_factor=2, mode='bilinear', align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        # input is CHW
        diffY = x2.size()[2] - x1.size()[2]
        diffX = x2.size()[3] - x1.size()[3]

        x1 = F.pad(x1, [diffX // 2, diffX - diffX // 2,
                        diffY // 2, diffY - diffY // 2])
        # if you have padding issues, see
        # https://github.com/HaiyongJiang/U-Net-Pytorch-Unstructured-Buggy/commit/0e854509c2cea854e247a9c615f175f76fbb2e3a
        # https://github.com/xiaopeng-liao/Pytorch-UNet/commit/8ebac70e633bac59fc22bb5195e513d5832fb3bd
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class OutConv(nn.Module):
    def __init__(self, in_channels, out_channels):
        super(OutConv, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x):
        return self.conv(x)


class UNet(nn.Module):
    """milesial's UNet with its base width 64 made an argument ``w`` (8 in the tests)."""

    def __init__(self, n_channels, n_classes, bilinear=False, w=64):
        super(UNet, self).__init__()
        self.n_channels = n_channels
        self.n_classes = n_classes
        self.bilinear = bilinear

        self.inc = (DoubleConv(n_channels, w))
        self.down1 = (Down(w, 2 * w))
        self.down2 = (Down(2 * w, 4 * w))
        self.down3 = (Down(4 * w, 8 * w))
        factor = 2 if bilinear else 1
        self.down4 = (Down(8 * w, 16 * w // factor))
        self.up1 = (Up(16 * w, 8 * w // factor, bilinear))
        self.up2 = (Up(8 * w, 4 * w // factor, bilinear))
        self.up3 = (Up(4 * w, 2 * w // factor, bilinear))
        self.up4 = (Up(2 * w, w, bilinear))
        self.outc = (OutConv(w, n_classes))

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x5 = self.down4(x4)
        x = self.up1(x5, x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        x = self.up4(x, x1)
        logits = self.outc(x)
        return logits


def unet(size: str) -> nn.Module:
    return UNet(3, 2, w=4 if size == "test" else 16)


# ------------------------------------------------------------------------------------ recurrent models


class BiLSTMTagger(nn.Module):
    """A sequence tagger: embeddings, a bidirectional LSTM, a tag score for every token."""

    def __init__(self, vocab_size, embedding_dim, hidden_dim, tagset_size):
        super(BiLSTMTagger, self).__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_dim // 2, num_layers=1, bidirectional=True, batch_first=True)
        self.hidden2tag = nn.Linear(hidden_dim, tagset_size)

    def forward(self, sentence):
        embeds = self.word_embeddings(sentence)
        lstm_out, _ = self.lstm(embeds)
        tag_space = self.hidden2tag(lstm_out)
        tag_scores = F.log_softmax(tag_space, dim=2)
        return tag_scores


class WordLanguageModel(nn.Module):
    """``word_language_model``'s RNNModel as it is posted: time-major token ids ``(T, B)``, the state passed in
    and returned, the logits flattened over time and batch."""

    def __init__(self, rnn_type: str, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.2,
                 tie_weights: bool = False) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ("LSTM", "GRU"):
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity="tanh", dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def bilstm_tagger(size: str) -> nn.Module:
    return BiLSTMTagger(50, 16, 16, 5) if size == "test" else BiLSTMTagger(5000, 64, 128, 17)


class CharRNN(nn.Module):
    """A character-level language model (char-rnn): embedding, a stacked LSTM with dropout between the
    layers, a linear decoder on every step; returns the logits and the hidden state for the next batch."""

    def __init__(self, n_chars, n_hidden=256, n_layers=2, drop_prob=0.0, cell=nn.LSTM):
        super().__init__()
        self.n_layers = n_layers
        self.n_hidden = n_hidden
        self.encoder = nn.Embedding(n_chars, n_hidden)
        self.rnn = cell(n_hidden, n_hidden, n_layers, dropout=drop_prob, batch_first=True)
        self.dropout = nn.Dropout(drop_prob)
        self.fc = nn.Linear(n_hidden, n_chars)

    def forward(self, x, hidden=None):
        r_output, hidden = self.rnn(self.encoder(x), hidden)
        out = self.dropout(r_output)
        out = out.contiguous().view(-1, self.n_hidden)
        out = self.fc(out)
        return out, hidden


def char_lstm_lm(size: str) -> nn.Module:
    return CharRNN(65, n_hidden=16 if size == "test" else 128)


class GRULanguageModel(nn.Module):
    """A word-level GRU language model (PyTorch's word_language_model, batch first, tied decoder off)."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.0):
        super(GRULanguageModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.GRU(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        self.init_weights()
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1)


def gru_lm(size: str) -> nn.Module:
    return GRULanguageModel(100, 16, 16, 1) if size == "test" else GRULanguageModel(1000, 128, 128, 1)


class PixelGRU(nn.Module):
    """Pixel-by-pixel (sequential) MNIST: each image a sequence of its pixels through a GRU, the last
    state into a classifier."""

    def __init__(self, input_size=1, hidden_size=32, num_classes=10):
        super(PixelGRU, self).__init__()
        self.rnn = nn.GRU(input_size, hidden_size, batch_first=True)
        self.fc = nn.Linear(hidden_size, num_classes)

    def forward(self, x):
        x = x.view(x.size(0), -1, 1)  # (B, 1, 28, 28) -> (B, 784, 1)
        out, h = self.rnn(x)
        return self.fc(h[-1])


def pixel_gru(size: str) -> nn.Module:
    return PixelGRU(hidden_size=8 if size == "test" else 32)


class TimeMajorPixelGRU(nn.Module):
    """Pixel-by-pixel MNIST as the recurrent layers take sequences by default, time-major: the pixels
    ``(784, B, 1)``, a GRU, the last layer's final state into a classifier."""

    def __init__(self, hidden_size=32, num_classes=10):
        super().__init__()
        self.rnn = nn.GRU(1, hidden_size)
        self.fc = nn.Linear(hidden_size, num_classes)

    def forward(self, x):
        _, h = self.rnn(x)
        return self.fc(h[-1])


def time_major_pixel_gru(size: str) -> nn.Module:
    return TimeMajorPixelGRU(hidden_size=8 if size == "test" else 32)


def _pixels_time_major(hw_test: int, hw_bench: int):
    def inputs(b: int, size: str, g: torch.Generator) -> torch.Tensor:
        hw = hw_test if size == "test" else hw_bench
        return torch.randn(hw * hw, b, 1, generator=g)

    return inputs


class AddingRNN(nn.Module):
    """The adding problem: a sequence of (value, marker) pairs, the sum of the two marked values read off
    the last output."""

    def __init__(self, hidden_size=128):
        super().__init__()
        self.rnn = nn.RNN(2, hidden_size, batch_first=True)
        self.linear = nn.Linear(hidden_size, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.linear(out[:, -1, :])


def adding_rnn(size: str) -> nn.Module:
    return AddingRNN(hidden_size=8 if size == "test" else 128)


def _adding_inputs(b: int, size: str, g: torch.Generator) -> torch.Tensor:
    t = 20 if size == "test" else 1000
    values = torch.rand(b, t, 1, generator=g)
    markers = torch.zeros(b, t, 1)
    for i in range(b):
        idx = torch.randperm(t, generator=g)[:2]
        markers[i, idx, 0] = 1.0
    return torch.cat([values, markers], dim=2)


# ------------------------------------------------------------------------------------ in-place forms, ties, buffers


class InplaceNet(nn.Module):
    """A small residual classifier written with the in-place forms people use."""

    def __init__(self, c=8, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv3 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(c)
        self.act = nn.Hardswish(inplace=True)
        self.conv4 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * c, num_classes)

    def forward(self, x):
        x = self.bn1(self.conv1(x))
        x.relu_()
        residual = x
        out = F.relu(self.bn2(self.conv2(x)), inplace=True)
        out = self.bn3(self.conv3(out))
        out += residual
        out = self.act(out)
        out.mul_(0.5)
        out = self.conv4(out)
        out.clamp_(min=0)
        out = self.pool(out).flatten(1)
        return self.fc(out)


def inplace_net(size: str) -> nn.Module:
    return InplaceNet(c=8 if size == "test" else 32)


class TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder is its encoder's weight transposed, inputs normalized by buffers, a
    BatchNorm (running statistics) and a layer called twice."""

    def __init__(self, d=16, h=8):
        super().__init__()
        self.register_buffer("mean", torch.linspace(-0.5, 0.5, d))
        self.register_buffer("std", torch.linspace(0.5, 2.0, d))
        self.enc = nn.Linear(d, h)
        self.bn = nn.BatchNorm1d(h)
        self.shared = nn.Linear(h, h)
        self.dec_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        x = (x - self.mean) / self.std
        h = torch.tanh(self.bn(self.enc(x)))
        h = self.shared(torch.relu(self.shared(h)))
        return F.linear(h, self.enc.weight.t(), self.dec_bias)


def tied_autoencoder(size: str) -> nn.Module:
    return TiedAutoencoder() if size == "test" else TiedAutoencoder(d=784, h=128)


def _features(d_test: int, d_bench: int):
    def inputs(b: int, size: str, g: torch.Generator) -> torch.Tensor:
        return torch.randn(b, d_test if size == "test" else d_bench, generator=g)

    return inputs


# ------------------------------------------------------------------------------------ the list

TV, TIMM = ("torchvision",), ("timm",)
_img32 = _images(32)

CASES: list[Case] = [
    # torchvision
    Case("tv_resnet18", "torchvision", tv_resnet18, _img32, TV),
    Case("tv_mobilenet_v3_small", "torchvision", tv_mobilenet_v3_small, _img32, TV),
    Case("tv_mobilenet_v2", "torchvision", tv_mobilenet_v2, _img32, TV),
    Case("tv_efficientnet_b0", "torchvision", tv_efficientnet_b0, _img32, TV),
    Case("tv_shufflenet_v2_x0_5", "torchvision", tv_shufflenet_v2_x0_5, _img32, TV),
    Case("tv_squeezenet1_1", "torchvision", tv_squeezenet1_1, _images(64), TV),
    Case("tv_densenet", "torchvision", tv_densenet, _img32, TV),
    Case("tv_mnasnet0_5", "torchvision", tv_mnasnet0_5, _img32, TV),
    Case("tv_regnet_x_400mf", "torchvision", tv_regnet_x_400mf, _img32, TV),
    Case("tv_vit", "torchvision", tv_vit, _img32, TV),
    Case("tv_convnext", "torchvision", tv_convnext, _img32, TV),
    Case("tv_swin", "torchvision", tv_swin, _img32, TV),
    Case("tv_googlenet", "torchvision", tv_googlenet, _img32, TV),
    Case("tv_inception_v3", "torchvision", tv_inception_v3, _images(75), TV),  # 75x75: its smallest input
    # timm
    Case("timm_resnet10t", "timm", _timm("resnet10t"), _img32, TIMM),
    Case("timm_resnet18d", "timm", _timm("resnet18d"), _img32, TIMM),
    Case("timm_mixer", "timm", timm_mixer, _img32, TIMM),
    Case("timm_vit_tiny", "timm", _timm("vit_tiny_patch16_224", img_size=32, depth=2), _img32, TIMM),
    Case("timm_convnext_atto", "timm", _timm("convnext_atto"), _img32, TIMM),
    Case("timm_efficientnet_b0", "timm", _timm("efficientnet_b0"), _img32, TIMM),
    Case("timm_mobilenetv3_small_050", "timm", _timm("mobilenetv3_small_050"), _img32, TIMM),
    Case("timm_regnetx_002", "timm", _timm("regnetx_002"), _img32, TIMM),
    Case("timm_lcnet_050", "timm", _timm("lcnet_050"), _img32, TIMM),
    Case("timm_deit_tiny", "timm", _timm("deit_tiny_patch16_224", img_size=32, depth=2), _img32, TIMM),
    # as people write them
    Case("nanogpt", "written", nanogpt, _tokens(64, 16, 256), output=_first, note="tied weights"),
    Case("nanogpt_masked", "written", nanogpt_masked, _tokens(64, 16, 256), output=_first,
         note="causal mask from a register_buffer"),
    Case("llama", "written", llama, _tokens(64, 16, 256)),
    Case("tcn", "written", tcn, _sequence(24, 784)),
    Case("tcn_old_weight_norm", "written", tcn_old_weight_norm, _sequence(24, 784)),
    Case("unet", "written", unet, _images(32, 64)),
    Case("bilstm_tagger", "written", bilstm_tagger, _tokens(50, 12, 64)),
    Case("char_lstm_lm", "written", char_lstm_lm, _tokens(65, 16, 128), output=_first),
    Case("gru_lm", "written", gru_lm, _tokens(100, 16, 128)),
    Case("pixel_gru", "written", pixel_gru, _images(4, 28, channels=1)),
    Case("pixel_gru_time_major", "written", time_major_pixel_gru, _pixels_time_major(4, 28),
         note="input (T, B, 1)"),
    Case("adding_rnn", "written", adding_rnn, _adding_inputs),
    Case("inplace_net", "written", inplace_net, _images(16, 32)),
    Case("tied_autoencoder", "written", tied_autoencoder, _features(16, 784), bench_batch=64),
]

CASE_NAMES = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}
