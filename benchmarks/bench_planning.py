"""Where planning time goes, per model: capture, inspection, each class's option grid, the DP;
then the same build again with the plan cache and the inspection's cache (a new process's
view: empty memory, the disk entries of the first build: the plan itself is read,
:mod:`solvers.plan_cache`).

    .venv/bin/python benchmarks/bench_planning.py                      # every model below
    .venv/bin/python benchmarks/bench_planning.py --models gpt2 llama  # some

Models: the zoo's bench GPT, and transformers models from tiny configs (4 layers, or 4 + 4 for
the encoder-decoders T5, BART and Whisper; d=64; random init, called with keywords and labels
as their users call them); ``gpt2-small-12``, ``llama-12`` (and ``-24``): GPT-2 small's
shape and a Llama of its width, full size (d=768, sequence 256, batch 2). ``--max-block-nodes 0``: without side inputs (``rkgb.blocks``). One intra-op thread; measured costs (the
default cost model). The cache directory is a temporary one, so that the first build solves.
``--retrace``: the capture lowers its graph by ``run_decompositions``' retrace, as before
:mod:`rkgb.decompose`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rockmate import InfeasibleBudget, Rockmate  # noqa: E402
from solvers import registry  # noqa: E402
from solvers.option_cache import OptionCache  # noqa: E402


def _transformers_model(name: str):
    import transformers

    common = dict(vocab_size=256, attn_implementation="eager")
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, **common)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "bert":
        config = transformers.BertConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=64, **common)
        model = transformers.BertForMaskedLM(config)
    elif name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                          **common)
        model = transformers.LlamaForCausalLM(config)
    elif name == "t5":
        config = transformers.T5Config(num_layers=4, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                                       decoder_start_token_id=0, pad_token_id=0, **common)
        model = transformers.T5ForConditionalGeneration(config)
    elif name == "bart":
        config = transformers.BartConfig(d_model=64, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                         max_position_embeddings=64, **common)
        model = transformers.BartForConditionalGeneration(config)
    elif name == "whisper":
        config = transformers.WhisperConfig(d_model=64, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                                            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                            num_mel_bins=16, max_source_positions=32, max_target_positions=64,
                                            decoder_start_token_id=1, pad_token_id=0, **common)
        model = transformers.WhisperForConditionalGeneration(config)
        features = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
        labels = torch.randint(2, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        return model.train(), dict(input_features=features, labels=labels, use_cache=False)
    else:
        raise ValueError(name)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    if name != "bert":
        call["use_cache"] = False
    return model.train(), call


def _full_size_model(name: str):
    """GPT-2 small's shape (d=768, 12 heads, vocabulary 50257) or a Llama of the same width
    (d=768, 12 heads, 4 key-value heads, MLP 2048, vocabulary 32000), at the depth the name
    ends with (``gpt2-small-12``, ``llama-24``); batch 2, sequence 256."""
    import transformers

    family, _, depth = name.rpartition("-")
    layers = int(depth)
    if family == "gpt2-small":
        config = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=256,
                                         attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config)
    elif family == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=768, num_attention_heads=12,
                                          num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=256,
                                          vocab_size=32000, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(name)
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0))
    return model.train(), dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False)


def _model(name: str):
    if name.startswith(("gpt2-small-", "llama-")):
        model, call = _full_size_model(name)
        return model, {"kwargs": call}
    if name == "gpt":
        from zoo import ZOO

        model, sample = ZOO["gpt"].build("bench")
        return model, {"args": sample}
    model, call = _transformers_model(name)
    return model, {"kwargs": call}


def _build(model, given, budget_fraction: float, cache: OptionCache, max_block_nodes):
    """A build at ``budget_fraction`` of the no-recomputation plan's peak; (Rockmate, seconds of
    the Rockmate build alone: capture, inspection, options, DP)."""
    cache_directory = os.environ.get("ROCKMATE_CACHE_DIR")
    os.environ["ROCKMATE_CACHE_DIR"] = "off"  # (this build's measures are not the timed build's)
    try:
        top = Rockmate(copy.deepcopy(model), **given, budget=10**13, solver="none", max_block_nodes=max_block_nodes)
    finally:
        if cache_directory is None:
            del os.environ["ROCKMATE_CACHE_DIR"]
        else:
            os.environ["ROCKMATE_CACHE_DIR"] = cache_directory
    budget = int(top.plan.predicted_peak * budget_fraction)
    # the timed build as a user's, without this build's copy of the model alive beside it: the
    # 24-layer Llama's inspection took 0.5-0.6 s more with it (its lm head's and embedding's
    # blocks: 3.4-3.5 s against 2.9 s), the 12-layer one's the same
    del top
    gc.collect()
    start = time.perf_counter()
    try:
        compiled = Rockmate(model, **given, budget=budget, solver=registry.RockmateSolver(cache=cache),
                            max_block_nodes=max_block_nodes)
    except InfeasibleBudget as error:  # planned at its minimum instead (the grids are cached by then)
        print(f"{'':>7} infeasible at {budget_fraction}: minimum {error.minimum / top.plan.predicted_peak:.3f} "
              f"of the no-recomputation peak (found in {time.perf_counter() - start:.1f} s)")
        compiled = Rockmate(model, **given, budget=error.minimum, solver=registry.RockmateSolver(cache=cache),
                            max_block_nodes=max_block_nodes)
    return compiled, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt", "gpt2", "bert", "llama"])
    parser.add_argument("--fraction", type=float, default=0.5, help="of the no-recomputation peak")
    parser.add_argument("--max-block-nodes", type=int, default=40, help="0: no side inputs")
    parser.add_argument("--retrace", action="store_true",
                        help="capture with run_decompositions' retrace (before rkgb.decompose), to compare")
    args = parser.parse_args()
    if args.retrace:
        import rkgb.capture

        rkgb.capture.LOWER_FUNCTIONAL_GRAPHS = False
    max_block_nodes = args.max_block_nodes or None
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"ILP backend of the option grids: {registry.RockmateSolver().ilp_solver}")
    print(f"{'model':>7} {'blocks':>6} {'classes':>7} {'largest':>7} {'capture':>8} {'inspect':>8} {'options':>8} "
          f"{'dp':>6} {'total':>7} {'slowest class':>36} {'2nd build':>9} {'2nd capture':>11} {'2nd options':>11}")
    for name in args.models:
        model, given = _model(name)
        with tempfile.TemporaryDirectory() as directory:
            os.environ["ROCKMATE_CACHE_DIR"] = directory  # the inspection's cache too (rockmate.api)
            compiled, total = _build(model, given, args.fraction, OptionCache(directory=directory), max_block_nodes)
            timings = compiled.plan.timings
            options = {k: v for k, v in timings.items() if k.startswith("options of")}
            slowest = max(options.items(), key=lambda kv: kv[1], default=("-", 0.0))
            second = OptionCache(directory=directory)
            again, total_again = _build(model, given, args.fraction, second, max_block_nodes)
            options_again = again.plan.timings.get("options", 0.0)  # (classes' grids overlap: the phase's wall time)
        chain = compiled.graphs.chain
        print(f"{name:>7} {len(chain.blocks):>6} {len(chain.classes):>7} {max(len(b.nodes) for b in chain.blocks):>7} "
              f"{timings.get('capture', 0):>8.1f} {timings.get('inspect', 0):>8.1f} {timings.get('options', 0):>8.1f} "
              f"{timings.get('dp', 0):>6.2f} {total:>7.1f} {slowest[0][11:] + f' {slowest[1]:.1f} s':>36} "
              f"{total_again:>9.1f} {again.plan.timings.get('capture', 0):>11.1f} {options_again:>11.2f} "
              + (f"(plan read from the plan cache in {again.plan.timings['plan cache']:.2f} s)"
                 if "plan cache" in again.plan.timings else f"(cache: {second.hits} hits, {second.misses} misses)"),
              flush=True)


if __name__ == "__main__":
    main()
