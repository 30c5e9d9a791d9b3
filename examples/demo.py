"""Demo: train a GPT-like model with half of its activation memory, exactly.

Builds a small GPT (tied embedding and head, dropout, causal attention) and its loss (a
cross-entropy), measures eager PyTorch's peak of a training step with the allocator, plans model
and loss together with Rockmate at 50% of it (``WithLoss``: the budget bounds the whole step),
trains a few steps of both side by side from the same initial weights and random state, and
prints each step's peak, whether outputs and weights are bitwise equal, and both step times
(interleaved steps after a warm-up, one thread).

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

from rkgb.memory import measure_allocator_peak  # noqa: E402
from rockmate import Rockmate, WithLoss, format_bytes  # noqa: E402


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


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def forward_backward(module, tokens, targets, losses=None):
    """The measured part of a step: the loss (``module`` returns it) and its backward."""
    loss = module(tokens, targets)
    loss.backward()
    if losses is not None:
        losses.append(loss.detach())


def main(steps: int = 4, timed_steps: int = 10) -> bool:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    tokens = torch.randint(512, (4, 128))
    targets = torch.randint(512, (4, 128))
    step_module = WithLoss(model, cross_entropy)  # model and loss: one training step
    reference = copy.deepcopy(step_module)
    for p in list(model.parameters()) + list(reference.parameters()):
        p.grad = torch.zeros_like(p)  # gradients allocated as after a first step (not activations)

    # eager's peak of a step, model and loss, as the allocator sees it (its own copy and RNG)
    with torch.random.fork_rng():
        eager_peak = measure_allocator_peak(forward_backward, copy.deepcopy(reference), tokens, targets)
    budget = eager_peak // 2
    print(f"eager's peak of a training step (model and loss): {format_bytes(eager_peak)}; "
          f"planning at 50%: {format_bytes(budget)}")

    start = time.perf_counter()
    compiled = Rockmate(step_module, (tokens, targets), budget)
    print(f"planned in {time.perf_counter() - start:.1f} s: {compiled.extra_repr()}")
    print(f"predicted peak {format_bytes(compiled.plan.predicted_peak)}, predicted time "
          f"{compiled.plan.predicted_time * 1e3:.1f} ms (without recomputation "
          f"{compiled.plan.baseline_time * 1e3:.1f} ms)")

    eager_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    rock_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exact, eager_peaks, rock_peaks = True, [], []
    for step in range(steps):
        state = torch.get_rng_state()
        eager_opt.zero_grad(set_to_none=False)
        losses = []
        peak_eager = measure_allocator_peak(forward_backward, reference, tokens, targets, losses)
        torch.set_rng_state(state)  # the same dropout masks for both
        rock_opt.zero_grad(set_to_none=False)
        peak_rock = measure_allocator_peak(forward_backward, compiled, tokens, targets, losses)
        same = torch.equal(*losses) and all(torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), model.parameters()))
        eager_opt.step()
        rock_opt.step()
        same &= all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
        exact &= same
        eager_peaks.append(peak_eager), rock_peaks.append(peak_rock)
        print(f"step {step}: peak eager {format_bytes(peak_eager)} | rockmate {format_bytes(peak_rock)} | "
              f"loss, gradients and weights bitwise equal: {same}")
    within = max(rock_peaks) <= budget
    print(f"peak of a training step (model and loss, the allocator's): eager {format_bytes(max(eager_peaks))}, "
          f"rockmate {format_bytes(max(rock_peaks))}; budget {format_bytes(budget)} (predicted "
          f"{format_bytes(compiled.plan.predicted_peak)}): {'kept' if within else 'EXCEEDED'}")

    # step times: interleaved, after a warm-up, without any memory measure around them
    eager_times, rock_times = [], []
    for step in range(2 + timed_steps):
        for module, times in ((reference, eager_times), (compiled, rock_times)):
            start = time.perf_counter()
            forward_backward(module, tokens, targets)
            if step >= 2:
                times.append(time.perf_counter() - start)
    eager_ms, rock_ms = statistics.median(eager_times) * 1e3, statistics.median(rock_times) * 1e3
    print(f"median step time (forward and backward, {timed_steps} interleaved steps, one thread): "
          f"eager {eager_ms:.0f} ms, rockmate {rock_ms:.0f} ms ({rock_ms / eager_ms:.2f}x)")
    print(f"loss, gradients and weights bitwise equal to eager at every step: {exact}")
    return exact and within


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
