"""torch.nn modules with fast paths or fused kernels, captured in training mode: an
encoder-decoder ``nn.Transformer`` (the encoder's output, which every decoder layer reads, is a
side input: ``rkgb.blocks``), multi-layer ``nn.LSTM`` and ``nn.GRU`` with dropout between the
layers (one fused operation each: nothing inside to recompute). Outputs, gradients bitwise
equal to eager's over 3 steps, peak under the budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exactness import check_training


class _EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=64, batch_first=True)

    def forward(self, source, target):
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1])
        return self.transformer(source, target, tgt_mask=mask, tgt_is_causal=True)


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(16, 32, num_layers=2, batch_first=True, dropout=0.1)

    def forward(self, x):
        return self.rnn(x)[0]


def _inputs(*shapes):
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=generator) for shape in shapes)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.3])
def test_nn_transformer_is_exact_and_under_budget(fraction):
    torch.manual_seed(0)
    report = check_training(_EncoderDecoder(), _inputs((2, 10, 32), (2, 7, 32)), fraction)
    assert report is not None
    chain = report.compiled.graphs.chain
    assert max(len(b.nodes) for b in chain.blocks) <= 40
    assert sum(bool(b.side_inputs) for b in chain.blocks) >= 2  # the decoder layers read the memory


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_multi_layer_rnns_are_exact(cell):
    torch.manual_seed(0)
    assert check_training(_Recurrent(cell), _inputs((2, 10, 16)), 0.5) is not None
