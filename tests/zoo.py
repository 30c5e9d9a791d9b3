"""The model zoo of the tests and benchmarks: small hand-written models and their sample inputs.

Every entry of :data:`ZOO` is a :class:`ZooEntry` that makes a model and a sample input for
it, from a configuration dataclass whose defaults are tiny (a forward + backward takes a few
milliseconds on two CPU threads) and whose presets make bigger ones for benchmarks::

    from zoo import ZOO, weighted_loss
    entry = ZOO["gpt"]
    model = entry.make_model()                           # tiny, float32, seeded
    sample = entry.make_sample()                         # a tuple of tensors
    loss = weighted_loss(model(*sample))                 # sum of outputs * fixed weights
    model, sample = entry.build("bench", dtype=torch.float64)   # a preset, another dtype
    model = entry.make_model(n_layer=4, d_model=64)      # any field of the configuration

Every model is written with ``torch.nn`` only, is capturable by
``torch.export.export(model, sample, strict=False)`` in train mode (and its
``run_decompositions({})``), and converts to float64 with ``.to(dtype)``. The models cover
what the compiler must handle: tied weights (gpt), buffers mutated in train mode and in-place
ReLUs (resnet, unet), dropout (gpt, transformer_encoder, mlp), concatenated skips (unet), a
loop unrolled over time (rnn), several inputs and outputs (multi_io).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = [
    "ZOO",
    "ZooEntry",
    "weighted_loss",
    "Attention",
    "GPTConfig",
    "gpt_config",
    "ResNetConfig",
    "TransformerEncoderConfig",
    "MixerConfig",
    "UNetConfig",
    "RNNConfig",
    "MultiIOConfig",
    "MLPConfig",
]


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo: how to make it, its sample input and its configurations.

    Attributes
    ----------
    name:
        The key in :data:`ZOO`.
    config_type:
        The configuration dataclass; its defaults are the tiny model of the tests.
    module_type:
        The ``nn.Module`` class, built from one configuration.
    sample_fn:
        ``sample_fn(config, dtype, device, generator) -> tuple of tensors``.
    presets:
        Named overrides of the configuration: ``"tiny"`` (the defaults) and ``"bench"`` (a
        size for benchmarks) in every entry, more in some (gpt: ``"small"``, GPT-2 small).
    has_dropout:
        Whether the model draws random numbers in train mode.
    """

    name: str
    config_type: type
    module_type: type[nn.Module]
    sample_fn: Callable[..., tuple[torch.Tensor, ...]]
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    has_dropout: bool = False

    def config(self, preset: str = "tiny", **overrides: Any) -> Any:
        """The configuration of ``preset`` with ``overrides`` (fields of ``config_type``)."""
        if preset not in self.presets:
            raise KeyError(
                f"{self.name}: unknown preset {preset!r}; the presets are {sorted(self.presets)}"
            )
        names = {f.name for f in dataclasses.fields(self.config_type)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(
                f"{self.name}: unknown configuration fields {unknown}; "
                f"the fields of {self.config_type.__name__} are {sorted(names)}"
            )
        return self.config_type(**{**self.presets[preset], **overrides})

    def make_model(
        self,
        dtype: torch.dtype = torch.float32,
        *,
        preset: str = "tiny",
        seed: int = 0,
        **overrides: Any,
    ) -> nn.Module:
        """A new model in train mode, its parameters drawn from ``seed`` (global RNG untouched)."""
        config = self.config(preset, **overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.module_type(config)
        return model.to(dtype).train()

    def make_sample(
        self,
        dtype: torch.dtype = torch.float32,
        *,
        preset: str = "tiny",
        seed: int = 0,
        device: torch.device | str = "cpu",
        **overrides: Any,
    ) -> tuple[torch.Tensor, ...]:
        """A sample input: a tuple of tensors, floating ones in ``dtype``, drawn from ``seed``."""
        config = self.config(preset, **overrides)
        generator = torch.Generator().manual_seed(seed)
        return tuple(t.to(device) for t in self.sample_fn(config, dtype, generator))

    def build(
        self,
        preset: str = "tiny",
        dtype: torch.dtype = torch.float32,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        **overrides: Any,
    ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """``(model, sample)`` of one configuration, on ``device``."""
        model = self.make_model(dtype, preset=preset, seed=seed, **overrides).to(device)
        sample = self.make_sample(dtype, preset=preset, seed=seed, device=device, **overrides)
        return model, sample


def weighted_loss(outputs: Any, seed: int = 0) -> torch.Tensor:
    """``sum_i (outputs_i * W_i).sum()`` with fixed random weights ``W_i`` drawn from ``seed``.

    The loss of the tests: every element of every floating output gets a different gradient,
    so a wrong gradient anywhere shows. ``outputs`` is a tensor or a structure of tensors;
    non-floating outputs are ignored. The weights depend only on the seed, shapes and dtypes.
    """
    generator = torch.Generator().manual_seed(seed)
    total = None
    for output in tree_flatten(outputs)[0]:
        if not (isinstance(output, torch.Tensor) and output.is_floating_point()):
            continue
        weights = torch.randn(output.shape, generator=generator, dtype=output.dtype)
        term = (output * weights.to(output.device)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("weighted_loss: the outputs contain no floating-point tensor")
    return total


# --------------------------------------------------------------------------------------------
# 1. gpt: GPT-2-like decoder, lm head tied to the token embedding
# --------------------------------------------------------------------------------------------


class Attention(enum.Enum):
    """How the GPT computes causal self-attention."""

    MASKED = "masked"  # explicit: scores, masked_fill with a causal mask buffer, softmax, dropout
    SDPA = "sdpa"  # F.scaled_dot_product_attention(is_causal=True, dropout_p=...)


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    d_model: int = 32
    n_head: int = 4
    seq_len: int = 16
    vocab: int = 64
    batch: int = 2
    dropout: float = 0.1
    attention: Attention = Attention.MASKED

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", Attention(self.attention))
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be a multiple of n_head={self.n_head}"
            )


_GPT_PRESETS = {
    "tiny": {},
    "bench": dict(n_layer=4, d_model=256, n_head=8, seq_len=128, vocab=1024, batch=4),
    "small": dict(n_layer=12, d_model=768, n_head=12, seq_len=256, vocab=50257, batch=2),
}


def gpt_config(preset: str = "tiny", **overrides: Any) -> GPTConfig:
    """The GPT configuration of a preset: ``"tiny"``, ``"bench"`` or ``"small"`` (GPT-2 small:
    12 layers, d_model 768, 12 heads, vocabulary 50257; here sequences of 256, batch 2)."""
    return ZOO["gpt"].config(preset, **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.attention = config.attention
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        if self.attention is Attention.MASKED:
            causal = torch.tril(torch.ones(config.seq_len, config.seq_len, dtype=torch.bool))
            self.register_buffer("mask", causal.view(1, 1, config.seq_len, config.seq_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        if self.attention is Attention.SDPA:
            dropout_p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            scores = scores.masked_fill(~self.mask[:, :, :seq, :seq], float("-inf"))
            y = self.attn_dropout(F.softmax(scores, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(batch, seq, d_model)
        return self.resid_dropout(self.proj(y))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, pre-LayerNorm blocks, final LayerNorm, tied lm head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.drop(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt_sample(config: GPTConfig, dtype: torch.dtype, generator: torch.Generator):
    shape = (config.batch, config.seq_len)
    return (torch.randint(config.vocab, shape, generator=generator, dtype=torch.int64),)


# --------------------------------------------------------------------------------------------
# 2. resnet: BasicBlocks with BatchNorm and in-place ReLUs, a strided 1x1-conv shortcut
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResNetConfig:
    batch: int = 2
    channels: int = 3
    image: int = 16
    width: int = 8  # channels of the first stage, doubled at each next stage
    stages: tuple[int, ...] = (1, 1)  # BasicBlocks per stage; stages after the first downsample
    classes: int = 10


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(config.channels, config.width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(config.width),
            nn.ReLU(inplace=True),
        )
        blocks = []
        in_channels = config.width
        for stage, n_blocks in enumerate(config.stages):
            out_channels = config.width * 2**stage
            for index in range(n_blocks):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, config.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(self.stem(images)))
        return self.fc(torch.flatten(x, 1))


def _image_sample(config: Any, dtype: torch.dtype, generator: torch.Generator):
    shape = (config.batch, config.channels, config.image, config.image)
    return (torch.randn(shape, generator=generator, dtype=dtype),)


# --------------------------------------------------------------------------------------------
# 3. transformer_encoder: torch.nn.TransformerEncoder, pre-norm, dropout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerEncoderConfig:
    batch: int = 2
    seq_len: int = 8
    d_model: int = 32
    n_head: int = 4
    d_ff: int = 64
    n_layer: int = 2
    dropout: float = 0.1


class TransformerEncoder(nn.Module):
    """``nn.TransformerEncoder`` (norm_first, batch_first); its fast path is eval-only."""

    def __init__(self, config: TransformerEncoderConfig) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            config.d_model,
            config.n_head,
            config.d_ff,
            config.dropout,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, config.n_layer, enable_nested_tensor=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def _sequence_sample(config: TransformerEncoderConfig, dtype, generator):
    shape = (config.batch, config.seq_len, config.d_model)
    return (torch.randn(shape, generator=generator, dtype=dtype),)


# --------------------------------------------------------------------------------------------
# 4. mixer: MLP-Mixer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixerConfig:
    batch: int = 2
    channels: int = 3
    image: int = 16
    patch: int = 4
    d_model: int = 32
    token_hidden: int = 32
    channel_hidden: int = 64
    n_layer: int = 2
    classes: int = 10


def _mlp(features: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, features))


class MixerBlock(nn.Module):
    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        tokens = (config.image // config.patch) ** 2
        self.norm_tokens = nn.LayerNorm(config.d_model)
        self.token_mlp = _mlp(tokens, config.token_hidden)
        self.norm_channels = nn.LayerNorm(config.d_model)
        self.channel_mlp = _mlp(config.d_model, config.channel_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, d_model)
        x = x + self.token_mlp(self.norm_tokens(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm_channels(x))


class Mixer(nn.Module):
    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.channels, config.d_model, config.patch, stride=config.patch
        )
        self.blocks = nn.Sequential(*(MixerBlock(config) for _ in range(config.n_layer)))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(images).flatten(2).transpose(1, 2)
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


# --------------------------------------------------------------------------------------------
# 5. unet: U-Net with concatenated skips, max-pool down, transposed convolutions up
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UNetConfig:
    batch: int = 2
    channels: int = 3
    image: int = 16  # a multiple of 2**depth
    width: int = 8
    depth: int = 2  # number of down (and up) steps
    out_channels: int = 2


def _double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        widths = [config.width * 2**level for level in range(config.depth + 1)]
        self.inc = _double_conv(config.channels, widths[0])
        self.down = nn.ModuleList(
            _double_conv(widths[level], widths[level + 1]) for level in range(config.depth)
        )
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[level + 1], widths[level], 2, stride=2)
            for level in reversed(range(config.depth))
        )
        self.up_conv = nn.ModuleList(
            _double_conv(2 * widths[level], widths[level])
            for level in reversed(range(config.depth))
        )
        self.outc = nn.Conv2d(widths[0], config.out_channels, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.inc(images)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(self.pool(x))
        for up, up_conv, skip in zip(self.up, self.up_conv, reversed(skips)):
            x = up_conv(torch.cat([skip, up(x)], dim=1))
        return self.outc(x)


# --------------------------------------------------------------------------------------------
# 6. rnn: an RNN cell unrolled over the sequence
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RNNConfig:
    batch: int = 2
    steps: int = 8
    features: int = 16
    hidden: int = 32


class UnrolledRNN(nn.Module):
    """``h_t = tanh(W x_t + U h_{t-1} + b)`` for t < steps; returns the last hidden state."""

    def __init__(self, config: RNNConfig) -> None:
        super().__init__()
        self.hidden = config.hidden
        self.cell = nn.RNNCell(config.features, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, steps, features)
        h = x.new_zeros(x.size(0), self.hidden)
        for t in range(x.size(1)):
            h = self.cell(x[:, t], h)
        return h


def _rnn_sample(config: RNNConfig, dtype: torch.dtype, generator: torch.Generator):
    shape = (config.batch, config.steps, config.features)
    return (torch.randn(shape, generator=generator, dtype=dtype),)


# --------------------------------------------------------------------------------------------
# 7. multi_io: two inputs of different shapes, a tuple of two outputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultiIOConfig:
    batch: int = 2
    features_a: int = 16
    tokens_b: int = 4
    features_b: int = 8
    hidden: int = 32
    classes: int = 4


class MultiIO(nn.Module):
    """``(a: (batch, features_a), b: (batch, tokens_b, features_b)) -> (logits, b')``."""

    def __init__(self, config: MultiIOConfig) -> None:
        super().__init__()
        self.encode_a = nn.Linear(config.features_a, config.hidden)
        self.encode_b = nn.Linear(config.features_b, config.hidden)
        self.classify = nn.Linear(config.hidden, config.classes)
        self.decode_b = nn.Linear(config.hidden, config.features_b)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        encoded_a = torch.relu(self.encode_a(a))
        encoded_b = self.encode_b(b).mean(dim=1)
        joint = encoded_a * encoded_b + encoded_a
        logits = self.classify(joint)
        refined_b = b + self.decode_b(torch.tanh(joint)).unsqueeze(1)
        return logits, refined_b


def _multi_io_sample(config: MultiIOConfig, dtype: torch.dtype, generator: torch.Generator):
    a = torch.randn(config.batch, config.features_a, generator=generator, dtype=dtype)
    b = torch.randn(
        config.batch, config.tokens_b, config.features_b, generator=generator, dtype=dtype
    )
    return a, b


# --------------------------------------------------------------------------------------------
# 8. mlp: Linear / ReLU / Dropout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLPConfig:
    batch: int = 4
    features: int = 16
    hidden: int = 32
    n_layer: int = 3  # hidden layers
    classes: int = 10
    dropout: float = 0.1


class MLP(nn.Sequential):
    def __init__(self, config: MLPConfig) -> None:
        layers: list[nn.Module] = []
        features = config.features
        for _ in range(config.n_layer):
            layers += [nn.Linear(features, config.hidden), nn.ReLU(), nn.Dropout(config.dropout)]
            features = config.hidden
        layers.append(nn.Linear(features, config.classes))
        super().__init__(*layers)


def _mlp_sample(config: MLPConfig, dtype: torch.dtype, generator: torch.Generator):
    return (torch.randn(config.batch, config.features, generator=generator, dtype=dtype),)


# --------------------------------------------------------------------------------------------

ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in [
        ZooEntry("gpt", GPTConfig, GPT, _gpt_sample, _GPT_PRESETS, has_dropout=True),
        ZooEntry(
            "resnet",
            ResNetConfig,
            ResNet,
            _image_sample,
            {"tiny": {}, "bench": dict(batch=8, image=64, width=32, stages=(2, 2, 2))},
        ),
        ZooEntry(
            "transformer_encoder",
            TransformerEncoderConfig,
            TransformerEncoder,
            _sequence_sample,
            {"tiny": {}, "bench": dict(batch=8, seq_len=256, d_model=256, n_head=8, d_ff=1024,
                                       n_layer=6)},
            has_dropout=True,
        ),
        ZooEntry(
            "mixer",
            MixerConfig,
            Mixer,
            _image_sample,
            {"tiny": {}, "bench": dict(batch=8, image=64, patch=8, d_model=256, token_hidden=128,
                                       channel_hidden=1024, n_layer=8)},
        ),
        ZooEntry(
            "unet",
            UNetConfig,
            UNet,
            _image_sample,
            {"tiny": {}, "bench": dict(batch=4, image=128, width=32, depth=4)},
        ),
        ZooEntry(
            "rnn",
            RNNConfig,
            UnrolledRNN,
            _rnn_sample,
            {"tiny": {}, "bench": dict(batch=32, steps=64, features=256, hidden=512)},
        ),
        ZooEntry(
            "multi_io",
            MultiIOConfig,
            MultiIO,
            _multi_io_sample,
            {"tiny": {}, "bench": dict(batch=64, features_a=512, tokens_b=64, features_b=256,
                                       hidden=1024)},
        ),
        ZooEntry(
            "mlp",
            MLPConfig,
            MLP,
            _mlp_sample,
            {"tiny": {}, "bench": dict(batch=256, features=1024, hidden=4096, n_layer=6)},
            has_dropout=True,
        ),
    ]
}
"""The models of the zoo by name: gpt, resnet, transformer_encoder, mixer, unet, rnn, multi_io,
mlp."""
