"""Classes of one CD-graph but their measured costs share one option grid (solvers.twin_classes)."""

import dataclasses
import random

import pytest

from rkgb.cdgraph import CDGraph
from solvers import RockmateSolver, min_budget, simulate, solve
from solvers.options import autograd_option, option_from_schedule
from solvers.registry import no_recompute_peak
from solvers.schedule import Compute, Schedule
from solvers.toy_graphs import attention_like_graph, chain_of
from solvers.twin_classes import MAX_OVERHEAD_DIFFERENCE, twin_leads


def _remeasured(graph: CDGraph, rng: random.Random, spread: float, extra_overhead: int = 0) -> CDGraph:
    """``graph`` with each node's time scaled by a draw in [1 - spread, 1 + spread] (the
    measures' noise) and ``extra_overhead`` bytes more temporary memory on its first forward."""
    nodes = []
    for i, node in enumerate(graph.compute_nodes):
        changes = {"time_s": node.time_s * rng.uniform(1 - spread, 1 + spread)}
        if i == 0:
            changes["overhead_bytes"] = node.overhead_bytes + extra_overhead
        nodes.append(dataclasses.replace(node, **changes))
    return CDGraph(name=graph.name + "_twin", compute_nodes=nodes, data_nodes=list(graph.data_nodes),
                   input_data=list(graph.input_data), input_grads=list(graph.input_grads),
                   output_data=list(graph.output_data), output_grads=list(graph.output_grads))


def _attention(**kwargs) -> CDGraph:
    return attention_like_graph(batch=1, seq=32, hidden=32, heads=2, **kwargs)


def test_twins_are_graphs_of_one_structure_whose_costs_are_close():
    """A class is the twin of the first class of its structure whose costs are close: node times
    within the measures' noise (the option cache's ``similar_times``) and temporary memories within
    a few percent of the peak; a graph of other sizes, or costs far apart, has a grid of its own."""
    lead = _attention()
    peak = autograd_option(lead).peak_bytes
    rng = random.Random(3)
    noisy = _remeasured(lead, rng, 0.3, extra_overhead=int(0.5 * MAX_OVERHEAD_DIFFERENCE * peak))
    slower = _remeasured(lead, rng, 0.0)
    max(slower.compute_nodes, key=lambda node: node.time_s).time_s *= 100  # (one op far slower: another kernel)
    bigger_scratch = _remeasured(lead, rng, 0.0, extra_overhead=int(2 * MAX_OVERHEAD_DIFFERENCE * peak))
    other_sizes = attention_like_graph(batch=1, seq=16, hidden=32, heads=2)
    leads = twin_leads({0: lead, 1: noisy, 2: slower, 3: bigger_scratch, 4: other_sizes, 5: noisy})
    assert leads == {0: 0, 1: 0, 2: 2, 3: 3, 4: 4, 5: 0}


def test_a_twin_class_gets_its_leads_schedules_measured_on_its_own_graph(monkeypatch):
    """The chain's twin classes are planned from one grid (one grid solved, not two); each of the
    twin's options is its schedule measured on the twin's own graph, so every plan is within its
    budget as the simulator judges it; and the plans are as fast as those of the twins' own
    grids within 1% over the budgets, at the same minimum budget within 1%."""
    import solvers.registry as registry

    lead = _attention()
    twin = _remeasured(lead, random.Random(5), 0.25, extra_overhead=4096)
    chain = chain_of([lead, twin], [0, 1, 0, 1])
    grids = []
    real = registry.solve_class_options

    def counted(graph, **kwargs):
        grids.append(graph.name)
        return real(graph, **kwargs)

    monkeypatch.setattr(registry, "solve_class_options", counted)
    shared = RockmateSolver(peak_steps=5, save_steps=5, cache=None)
    own = RockmateSolver(peak_steps=5, save_steps=5, cache=None, share_twin_grids=False)
    low = min_budget(chain, shared)
    assert low <= min_budget(chain, own) * 1.01
    assert grids.count(lead.name) == 2 and grids.count(twin.name) == 1  # (the second solver's)
    options = shared._options_of(chain, 1)
    assert options.graph is twin and options.notes[0].startswith("the grid of its twin class 0")
    for option in options.options:
        schedule = Schedule(option.forward_ops + [Compute("loss")] + option.backward_ops)
        assert option.key() == option_from_schedule(twin, schedule).key()
    top = no_recompute_peak(chain)
    for i in range(7):
        budget = int(low + (top - low) * i / 6)
        plan = solve(chain, budget, shared)
        assert plan.feasible and simulate(chain.whole_graph(), plan.schedule).peak_bytes == plan.predicted_peak <= budget
        reference = solve(chain, budget, own)
        assert plan.predicted_time <= reference.predicted_time * 1.01 if reference.feasible else True


def test_the_twins_of_t5_share_a_grid():
    """T5 (3 + 3 layers): the encoder's and the decoder's first self-attention blocks compute
    their position biases with other operations, so they are classes of their own, of one
    CD-graph: one grid between them."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    from rockmate import Rockmate

    config = transformers.T5Config(vocab_size=64, num_layers=3, d_model=16, d_kv=4, d_ff=32, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    top = Rockmate(model, kwargs=dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False),
                   budget=10**12, solver="none",
                   cost_model="flops")
    chain = top.graphs.model_chain
    classes = sorted({b.class_index for b in chain.blocks})
    assert all(RockmateSolver(share_twin_grids=False).twin_lead(chain, index) == index for index in classes)
    solver = RockmateSolver(peak_steps=2, save_steps=2, cache=None)
    twins = {index: solver.twin_lead(chain, index) for index in classes if solver.twin_lead(chain, index) != index}
    assert sum(len(chain.classes[i].compute_nodes) >= 40 for i in twins) == 2  # (and 5-compute ones)
    plan = solve(chain, min_budget(chain, solver), solver)
    assert plan.feasible
    assert all(solver._options_of(chain, index).notes[0] == f"the grid of its twin class {lead} (the same "
               "CD-graph but measured costs), measured on its own" for index, lead in twins.items())
