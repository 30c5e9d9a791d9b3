"""The budget on convolution networks, as the allocator measures it (issue: the allocator's budget).

CPU convolutions allocate scratch inside their kernels (im2col columns, several times their
output); the plan must count it. On a U-Net with concatenated skips, a ResNet with BatchNorm
and a MobileNet-like net (depthwise and grouped convolutions, hardswish), at 100, 50 and 30%
of eager's allocator peak (30%: at the minimum where that is below it), in float32 and
float64: the allocator's peak of the whole step (model and loss) within the budget and within
3% of the prediction (:func:`exactness.check_training`, which names the operation where they
differ), gradients and buffers bitwise equal to eager over three steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exactness import DotLoss, check_training
from rockmate import Rockmate
from zoo import ZOO


class InvertedResidual(nn.Module):
    """MobileNetV2/V3's block: 1x1 expansion, 3x3 depthwise, 1x1 projection, hardswish."""

    def __init__(self, channels: int, expansion: int, stride: int) -> None:
        super().__init__()
        hidden = channels * expansion
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                                    nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), nn.Hardswish())
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))
        self.residual = stride == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.residual else out


class MobileNetLike(nn.Module):
    """A stem, inverted residual blocks (one strided) with a grouped convolution between, a head."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.Hardswish())
        self.blocks = nn.Sequential(
            InvertedResidual(width, 4, 1),
            InvertedResidual(width, 4, 2),
            nn.Conv2d(width, width, 3, 1, 1, groups=2, bias=False),
            InvertedResidual(width, 4, 1),
        )
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(images))
        return self.head(x.mean(dim=(2, 3)))


def _model(name: str, dtype: torch.dtype):
    if name == "mobilenet":
        torch.manual_seed(0)
        model = MobileNetLike().to(dtype)
        generator = torch.Generator().manual_seed(1)
        return model, (torch.randn(2, 3, 32, 32, generator=generator, dtype=dtype),)
    return ZOO[name].build(dtype=dtype)


# (U-Net and ResNet in float32: the zoo's tests, ``test_rockmate.py``, at the same budgets; the
# U-Net in float64 at 100% adds only a slow option grid to those)
CASES = [(name, dtype, fraction) for name, dtype in [("unet", torch.float64), ("resnet", torch.float64),
                                                     ("mobilenet", torch.float32), ("mobilenet", torch.float64)]
         for fraction in (1.0, 0.5, 0.3) if (name, fraction) != ("unet", 1.0)]


@pytest.mark.parametrize("name, dtype, fraction", CASES)
def test_conv_nets_stay_under_the_allocators_budget(name, dtype, fraction):
    model, sample = _model(name, dtype)
    report = check_training(model, sample, fraction, steps=3, at_minimum=True)
    assert report is not None and report.measured_peaks, "no step measured"


def test_plot_memory_draws_predicted_against_measured(tmp_path):
    """``plot_memory`` writes a figure, and its timeline's peak is the allocator's."""
    pytest.importorskip("matplotlib")
    model, sample = _model("mobilenet", torch.float32)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        probe = model(*sample)
    loss = DotLoss(probe)
    rk = Rockmate(model, sample, "10GB", solver="none")  # (the plan's kind does not matter here)
    timeline = rk.memory_timeline(*sample, loss_fn=loss)
    assert len(timeline.labels) == len(rk.plan.schedule.ops) == len(timeline.predicted)
    assert max(m for m in timeline.measured if m is not None) <= timeline.measured_peak
    assert timeline.predicted_peak == rk.plan.predicted_peak
    path = rk.plot_memory(tmp_path / "memory.png", *sample, loss_fn=loss)
    assert path.exists() and path.stat().st_size > 10_000
