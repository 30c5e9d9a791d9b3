"""Demo: train a GPT-like model with half of its activation memory, exactly.

Builds a small GPT (tied embedding and head, dropout, causal attention), measures eager
PyTorch's activation peak, plans with Rockmate at 50% of it, trains a few steps of both side by
side from the same initial weights and random state, and prints peak memory, step time and
whether outputs and gradients are bitwise equal.

    python examples/demo.py
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rkgb.memory import AllocationTracker  # noqa: E402
from rockmate import Rockmate, format_bytes  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.out(y.transpose(1, 2).reshape(b, t, w)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=512, width=128, heads=4, layers=4, context=128, dropout=0.1) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        return self.head(self.norm(self.blocks(x)))


def train_step(module, tokens, targets, optimizer):
    """One step; returns (logits, peak bytes allocated during forward+backward, seconds)."""
    optimizer.zero_grad(set_to_none=False)  # gradients allocated as after a first step
    start = time.perf_counter()
    with AllocationTracker() as tracker:
        logits = module(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    seconds = time.perf_counter() - start
    optimizer.step()
    return logits.detach(), tracker.peak_bytes, seconds


def main(steps: int = 4) -> bool:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    tokens = torch.randint(512, (4, 128))
    targets = torch.randint(512, (4, 128))
    reference = copy.deepcopy(model)

    # eager's activation peak, with gradients already allocated (they are not activations)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with AllocationTracker() as tracker:
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    eager_peak = tracker.peak_bytes
    budget = eager_peak // 2
    print(f"eager activation peak: {format_bytes(eager_peak)}; planning at 50%: {format_bytes(budget)}")

    start = time.perf_counter()
    compiled = Rockmate(model, (tokens,), budget)
    print(f"planned in {time.perf_counter() - start:.1f} s: {compiled.extra_repr()}")
    print(f"predicted peak {format_bytes(compiled.plan.predicted_peak)}, predicted time "
          f"{compiled.plan.predicted_time * 1e3:.1f} ms (without recomputation "
          f"{compiled.plan.baseline_time * 1e3:.1f} ms)")

    # the loss (cross-entropy) allocates its own memory on top of the module's: measure it
    logits = torch.randn(4, 128, 512, requires_grad=True)
    with AllocationTracker() as tracker:
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    loss_bytes = tracker.peak_bytes - logits.numel() * logits.element_size()  # its grad is planned
    del logits

    eager_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    rock_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in reference.parameters():
        p.grad = torch.zeros_like(p)
    exact = True
    eager_times, rock_times, eager_peaks, rock_peaks = [], [], [], []
    for step in range(steps):
        state = torch.get_rng_state()
        out_eager, peak_eager, t_eager = train_step(reference, tokens, targets, eager_opt)
        torch.set_rng_state(state)  # same dropout masks for both
        out_rock, peak_rock, t_rock = train_step(compiled, tokens, targets, rock_opt)
        same = torch.equal(out_eager, out_rock) and all(
            torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters())
        )
        exact &= same
        eager_times.append(t_eager), rock_times.append(t_rock)
        eager_peaks.append(peak_eager), rock_peaks.append(peak_rock)
        print(f"step {step}: eager {format_bytes(peak_eager)} {t_eager * 1e3:.0f} ms | "
              f"rockmate {format_bytes(peak_rock)} {t_rock * 1e3:.0f} ms | bitwise equal: {same}")
    within = max(rock_peaks) <= budget + loss_bytes
    print(f"peak memory (model + loss): eager {format_bytes(max(eager_peaks))}, rockmate "
          f"{format_bytes(max(rock_peaks))}; budget of the model {format_bytes(budget)} (predicted "
          f"{format_bytes(compiled.plan.predicted_peak)}) + the loss's own at most "
          f"{format_bytes(loss_bytes)}: {'kept' if within else 'EXCEEDED'}")
    print(f"median step time: eager {statistics.median(eager_times) * 1e3:.0f} ms, rockmate "
          f"{statistics.median(rock_times) * 1e3:.0f} ms")
    print(f"outputs, gradients and weights bitwise equal to eager at every step: {exact}")
    return exact and within


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
