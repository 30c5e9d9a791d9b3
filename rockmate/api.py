"""The public face: ``Rockmate(model, sample, budget)`` and ``min_budget(model, sample)``.

The pipeline (Zhao et al., "Rockmate: an Efficient, Fast, Automatic and Generic Tool for
Re-materialization in PyTorch", ICML 2023): the graph builder (:mod:`rkgb`) captures the
model, cuts it into a chain of blocks and measures each class of identical blocks; a solver
(:mod:`solvers`) plans what to keep and what to recompute under the budget; the executor
(:mod:`exec`) runs that plan as generated Python code inside an ``nn.Module``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from exec import CompiledModule
from exec.timeline import Timeline, measure_timeline
from rkgb.build import ModelGraphs, build
from rkgb.capture import CapturedGraph
from rkgb.cdgraph import ComputeKind, parameter_sum_key
from rkgb.disk_cache import MeasureCache
from rkgb.errors import describe_fx_node
from solvers import registry
from solvers.checkmate_ilp import make_pulp_solver
from solvers.option_cache import default_directory
from solvers.bounds import operation_floor
from solvers.schedule import Plan

from .budget import budget_fraction, format_bytes, parse_budget
from .errors import InfeasibleBudget
from .model_state import ModelState
from .signature import CallSignature, FlatModel, loss_entry_index, split_sample

__all__ = ["Rockmate", "min_budget", "BuildOptions"]


@dataclass(frozen=True)
class BuildOptions:
    """How the graph builder measures the model.

    ``cost_model``: ``"measured"`` (fastest of ``repeats`` timings on the model's device, after
    one untimed run) or ``"flops"`` (a deterministic model from FLOPs, bytes and random numbers
    drawn, for reproducible plans). ``grad_accumulation``: the plan counts, for each
    parameter read by several nodes (tied weights, a recurrent cell's weights), the sum of the
    step's contributions that is built apart when ``.grad`` holds values (gradient accumulation
    over micro-batches, as eager's engine does): one parameter-sized buffer during the backward.
    ``False`` leaves it out (a smaller budget where gradients are zeroed before every step); a
    step that then finds values in such a ``.grad`` raises instead of going over the budget.
    ``max_block_nodes``: blocks bigger than this are split where a tensor that many of their
    layers read (an encoder's output, a position bias) is all that joins them, by making it a
    side input (``rkgb.blocks``); None keeps the blocks that 1-separators alone give.
    ``output_gradients``: which of the model's outputs the plan counts a gradient from the user's
    loss for. ``"auto"``: where the model returns its own loss (the entry ``loss`` of a dict or a
    ``ModelOutput``, as transformers' models called with labels do), the training step is the
    backward from that loss alone, as ``outputs.loss.backward()`` runs it, and the other outputs
    (the logits) get none where the loss's backward reaches them: a loss that also reads them is
    warned about at its backward (its gradients are exact, its memory may go over the plan); an
    output that the loss's backward does not reach counts one all the same (its backward runs
    for it alone). Otherwise every output. ``"all"``: every output that requires grad, whatever
    the model returns. ``held_outputs``: what the training step holds of the model's outputs
    through its backward. ``"all"`` (default): everything the model returns (``out = model(x);
    loss_fn(out).backward()`` keeps ``out``). ``"loss"``: the model's own loss alone, or nothing
    (``loss = model(**batch).loss``, as transformers' ``Trainer`` does; ``loss = loss_fn(model(x),
    y)``): the plan frees the outputs made by the model's last block (the logits) where it no
    longer needs them, as eager frees them once the step drops them, and a smaller budget fits.
    A step that still holds one at its backward is warned about (its gradients are exact, its
    memory may go over the plan by that output; a view of it held counts, and a tensor that the
    loss saved for its own backward does not: that backward frees it before the model's runs).
    Outputs made before the last block (hidden states) are counted held either way.
    """

    cost_model: str = "measured"
    repeats: int = 3
    grad_accumulation: bool = True
    max_block_nodes: int | None = 40
    output_gradients: str = "auto"
    held_outputs: str = "all"

    def __post_init__(self) -> None:
        if self.output_gradients not in ("auto", "all"):
            raise ValueError(f"output_gradients={self.output_gradients!r}: 'auto' (the model's own loss alone, "
                             "where it returns one) or 'all' (every output)")
        if self.held_outputs not in ("all", "loss"):
            raise ValueError(f"held_outputs={self.held_outputs!r}: 'all' (the step holds the model's outputs "
                             "through its backward) or 'loss' (it keeps the model's loss alone)")


# whether this thread's build froze the older objects (:func:`_older_objects_frozen`)
_FREEZING = threading.local()


def _older_objects_frozen(function):
    """``function`` (a build: capture, inspection, planning) with the objects alive when it starts
    kept out of Python's full garbage collections (``gc.freeze``; ``gc.unfreeze`` when it ends),
    and those of the captured graph from its capture on (:func:`_captured_objects_frozen`).

    A full collection scans every tracked object: in a process that has imported torch and
    transformers and captured a model, 0.3-0.5 s each, and a build makes several (a 24-layer
    Llama of GPT-2 small's width: 7 in its first build, 1.9 s, 3 in its second, 1.2 s; 0.5 and
    0.3 s with the older objects frozen, builds 0.8 and 0.7 s faster). Garbage among those older
    objects is collected after the build instead of during it. A process that froze objects
    itself (``gc.get_freeze_count()``, before forking workers) or turned collections off is left
    as it is."""

    @functools.wraps(function)
    def frozen(*args, **kwargs):
        if gc.get_freeze_count() or not gc.isenabled():
            return function(*args, **kwargs)
        gc.freeze()
        _FREEZING.on = True
        try:
            return function(*args, **kwargs)
        finally:
            _FREEZING.on = False
            gc.unfreeze()

    return frozen


def _captured_objects_frozen(_captured: CapturedGraph) -> None:
    """In a build that froze the older objects, those made by the capture too (the captured
    graph, alive through the build), after a collection of the young generations (the capture's
    recent garbage): the full collections after the capture scan the build's new objects alone
    (the 24-layer Llama's second build: 2 full collections of 0.09-0.1 s each, 0.2-0.25 s of
    collections in all -> 0.07-0.12 s)."""
    if getattr(_FREEZING, "on", False):
        gc.collect(1)
        gc.freeze()


def _split_options(options: dict) -> tuple[BuildOptions, dict]:
    build_keys = {"cost_model", "repeats", "grad_accumulation", "max_block_nodes", "output_gradients", "held_outputs"}
    build_options = BuildOptions(**{k: v for k, v in options.items() if k in build_keys})
    return build_options, {k: v for k, v in options.items() if k not in build_keys}


@contextlib.contextmanager
def _train_mode(model: nn.Module):
    """Capture in train mode (the graph Rockmate runs is the training one): a model in eval mode
    as ``model.train()`` makes it; a model in train mode as it is (a BatchNorm frozen by its own
    ``.eval()``, as fine-tuning does, stays frozen: eager trains it so)."""
    if model.training:
        yield
        return
    modes = {module: module.training for module in model.modules()}
    model.train()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def _measure_cache() -> MeasureCache | None:
    """The inspection's disk cache, beside the plan cache (None where that is off:
    ``ROCKMATE_CACHE_DIR=off``), read at each build."""
    directory = default_directory()
    return None if directory is None else MeasureCache(os.path.join(directory, "measures"))


def _build_graphs(model: nn.Module, sample, build_options: BuildOptions) -> ModelGraphs:
    def loss_index(captured: CapturedGraph) -> int | None:
        return _model_loss_index(captured, model)

    with _train_mode(model):
        return build(model, sample, cost_model=build_options.cost_model, repeats=build_options.repeats,
                     grad_accumulation=build_options.grad_accumulation,
                     max_block_nodes=build_options.max_block_nodes, measure_cache=_measure_cache(),
                     loss_index=loss_index, output_gradients=build_options.output_gradients,
                     held_outputs=build_options.held_outputs, on_capture=_captured_objects_frozen)


def _held_outputs_hint(graphs: ModelGraphs, build_options: BuildOptions) -> str:
    """Where the plan counts the model's last outputs held through the step (``held_outputs="all"``),
    the option that frees them, for a step that keeps the loss alone; else nothing."""
    whole = graphs.model_chain.whole_graph()
    droppable = sum(whole.size(d) for d in graphs.droppable_outputs if whole.has_data(d))
    if build_options.held_outputs != "all" or not droppable:
        return ""
    return (f"; the plan counts the model's outputs held through the step ({droppable} bytes, "
            f"{format_bytes(droppable)}, of its last block's): if the step keeps the loss alone (loss = "
            "model(**batch).loss, as transformers' Trainer does, or loss = loss_fn(model(x), y)), "
            "held_outputs='loss' plans without them")


def _grad_accumulation_hint(graphs: ModelGraphs, build_options: BuildOptions) -> str:
    """Where the plan counts the gradient sums of parameters that several operations read
    (``grad_accumulation=True``), the option that leaves them out; else nothing. LayoutLM's 2D
    position tables (1024 x 32, each read twice): 256 KiB of sums, its minimum budget above
    eager's peak (432388 B against 417032 B; 185044 B without them)."""
    if not build_options.grad_accumulation:
        return ""
    suffix = parameter_sum_key("")
    sums = {entry.key[:-len(suffix)]: entry.bytes for entries in graphs.model_chain.first_run_bytes.values()
            for entry in entries if entry.key.endswith(suffix)}
    if not sums:
        return ""
    largest = max(sums, key=sums.get)
    path = graphs.captured.parameters.get(largest, largest)
    return (f"; the plan counts a buffer for the gradient sum of each parameter that several operations read "
            f"({len(sums)}, {sum(sums.values())} bytes in all, the largest {path}'s {sums[largest]} bytes), which a "
            "step needs only where .grad holds values when it starts: if .grad is None at each step's start "
            "(optimizer.zero_grad() sets it so), grad_accumulation=False plans without them")


def _output_paths(spec: pytree.TreeSpec) -> list[tuple]:
    """The pytree path of each leaf of an output structure of spec ``spec``."""
    return [path for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))[0]]


def _model_loss_index(captured: CapturedGraph, model: nn.Module) -> int | None:
    """The index among the model's outputs of the loss it returns (:attr:`CallSignature.loss_index`),
    or None: the model's output structure, from the call's signature for a model called with
    keywords (:class:`FlatModel`), else from the capture's."""
    if isinstance(model, FlatModel):
        return model.signature.loss_index
    spec = captured.out_spec
    if spec is None:
        return None
    paths = _output_paths(spec)
    nodes = {node.name: node for node in captured.graph.nodes}
    return loss_entry_index(paths, [nodes[name].meta.get("val") if name in nodes else None
                                    for name in captured.user_outputs])


class Rockmate(nn.Module):
    """``model`` compiled to train within ``budget`` bytes of activation memory.

    The returned module computes the same outputs, parameter gradients and buffer updates as
    ``model`` (bitwise where eager PyTorch is deterministic, dropout included), while the
    memory allocated during one forward + backward stays under ``budget``. In ``eval()`` mode
    or under ``torch.no_grad()`` it runs ``model`` as is.

    Args:
        model: the ``nn.Module`` to train; its parameters receive the gradients.
        sample: the inputs of a training call, with its shapes and dtypes (the plan is
            specific to them): a tensor, a tuple of positional inputs, or a dict of keyword
            inputs (``{"input_ids": ..., "labels": ...}``); ``args=`` and ``kwargs=`` give
            both. Non-tensor arguments are fixed at their sample values. The compiled module
            is called as the model is and returns the model's output structure.
        budget: bytes (int) or a string such as ``"300MiB"`` or ``"1.5GB"``; or a fraction of
            the peak without recomputation (autograd's, on this sample), as PyTorch's
            ``activation_memory_budget``: a float in (0, 1] (``0.5``) or a string (``"50%"``).
            Calls with other shapes are planned within the same bytes (the memory the fraction
            gave: a last smaller batch fits where its own fraction may not).
        solver: ``"rockmate"`` (default), ``"rotor"``, ``"checkmate"`` (whole graph, small
            models), ``"none"`` (no recomputation), or a solver object.
        **options: ``cost_model``, ``repeats``, ``grad_accumulation``, ``max_block_nodes`` and
            ``output_gradients``, ``held_outputs`` for the graph builder (:class:`BuildOptions`); the rest go to the
            solver (e.g. ``slots``, ``time_limit_s``).

    Attributes:
        plan: the :class:`solvers.schedule.Plan` (``budget``, ``predicted_peak``,
            ``predicted_time``, ``baseline_time``, ``solver``, ``schedule``).
        code: the generated Python source of the forward and backward phases.

    Raises:
        InfeasibleBudget: the budget is below the solver's minimum (given in the message).
        ValueError: the budget cannot be read.
        rkgb.errors.CaptureError, rkgb.errors.UnsupportedOperation: the model cannot be
            captured; the message names the module path and the operation.

    Example::

        rk = Rockmate(model, sample, "300MiB")
        loss = loss_fn(rk(*sample), target)
        loss.backward()
    """

    @_older_objects_frozen
    def __init__(self, model: nn.Module, sample=None, budget=None, solver="rockmate", *, args=None, kwargs=None,
                 **options) -> None:
        super().__init__()
        if budget is None:
            raise TypeError("Rockmate needs a budget: Rockmate(model, sample, budget), e.g. budget=\"300MiB\"")
        fraction = budget_fraction(budget)
        budget_bytes = parse_budget(budget) if fraction is None else None
        build_options, solver_options = _split_options(options)
        registry.get_solver(solver, **solver_options)  # unknown options: an error before the build
        if isinstance(solver_options.get("ilp_solver"), str):  # a missing package: the same
            make_pulp_solver(solver_options["ilp_solver"], None)
        self.signature, module, flat_sample = _flat_call(model, sample, args, kwargs)
        # what a copy re-plans from, with the sample's call (copy.deepcopy, pickle, torch.save)
        self._recipe = dict(budget=budget, solver=solver, options=options)
        # plans for calls whose tensors have other shapes than the sample's (a last, smaller
        # batch): input shapes -> a Rockmate of the same model, budget and options
        self._variants: dict[tuple, Rockmate] = {}
        self.graphs = _build_graphs(module, flat_sample, build_options)
        baseline = None  # the peak without recomputation, on this sample (where it is needed)
        if fraction is not None:
            baseline = registry.no_recompute_peak(self.graphs.model_chain)
            budget_bytes = max(1, int(fraction * baseline))
        plan: Plan = registry.solve(self.graphs.model_chain, budget_bytes, solver, **solver_options)
        if not plan.feasible:
            floor, operation = _operation_floor(self.graphs)
            if baseline is None:
                baseline = registry.no_recompute_peak(self.graphs.model_chain)
            raise InfeasibleBudget(budget_bytes, plan.min_budget, plan.solver, floor, operation,
                                   asked=None if fraction is None else budget, baseline=baseline,
                                   hint=_held_outputs_hint(self.graphs, build_options)
                                   + _grad_accumulation_hint(self.graphs, build_options))
        if fraction is not None:
            plan.notes.append(f"budget {budget!r}: {budget_bytes} B, {fraction:.0%} of the {baseline} B "
                              f"({format_bytes(baseline)}) that the plan without recomputation peaks at")
        plan.timings = {**self.graphs.phase_seconds, **plan.timings}
        if self.graphs.measures_from_cache:
            plan.notes.append(f"the blocks' measures (memory and {build_options.cost_model} times) were read from the "
                              f"disk cache ({default_directory()}/measures), taken by an earlier build of this graph "
                              "on this device; ROCKMATE_CACHE_DIR=off measures again")
        self.plan = plan
        whole = self.graphs.model_chain.whole_graph()
        self.compiled = CompiledModule(
            module, self.graphs.simplified, plan.schedule, flat_sample,
            cdgraph=whole, peak_limit=plan.predicted_peak - plan.held_bytes, first_run_bytes=plan.first_run_bytes,
        )
        # the outputs named in the model's structure in errors and warnings (``out['logits']``)
        spec = self.signature.out_spec if isinstance(module, FlatModel) else self.graphs.captured.out_spec
        if spec is not None and spec.num_leaves == len(self.graphs.simplified.outputs):
            self.compiled.output_labels = ["out" + pytree.keystr(path) for path in _output_paths(spec)]
        # what the captured graph holds of the model (a change plans again: _variant)
        self._state = ModelState.of(model, captured_in_train_mode=not model.training)
        # ``rk.forward`` with the model's signature (tools that pass a model only the arguments
        # its forward names read ``inspect.signature(model.forward)``)
        self.forward = _with_signature(type(self).forward.__get__(self), self.model.forward)
        # the state_dict is the model's, under the model's own keys: it loads into the model
        # (and the model's into this module), as the user saves and restores checkpoints
        self.register_state_dict_post_hook(_as_model_keys)
        self.register_load_state_dict_pre_hook(_as_inner_keys)
        self.register_load_state_dict_post_hook(_errors_in_model_keys)

    def _inner_prefix(self) -> str:
        """Where the model's tensors sit among this module's submodules."""
        return "compiled.model." + ("model." if isinstance(self.compiled.model, FlatModel) else "")

    def __reduce__(self):
        """``copy.deepcopy``, ``pickle`` and ``torch.save`` keep the model (its parameters,
        buffers and gradients as they are now), the sample, the budget and the options; the
        copy plans again from them when it is loaded (the compiled code and the captured
        graphs are not data that can be copied). With the disk plan cache this re-solves no
        option; with measured costs the new plan may differ from this one, and it is exact
        and within the budget as any plan is."""
        recipe = self._recipe
        if not isinstance(recipe["solver"], str):
            raise TypeError("a Rockmate built with a solver object cannot be copied or pickled: "
                            "pass the solver by name, or build a new Rockmate on a copy of the model")
        return _rebuilt, (self.model, self.signature.sample_call(), recipe["budget"], recipe["solver"],
                          recipe["options"], self.training)

    def __getattr__(self, name: str):
        """The model's attributes that this module does not have (``rk.config``,
        ``rk.main_input_name``, ``rk.generate``): use rk as the model. Private names are not
        passed on (torch's own probes of a module)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "compiled" not in self.__dict__.get("_modules", {}):
                raise
        model = self.model
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(f"'Rockmate' object (around a {type(model).__name__}) has no attribute "
                                 f"{name!r}, nor has the model") from None

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's call signature (``inspect.signature(rk)``, as tools that pass only the
        arguments a model takes read it)."""
        return inspect.signature(self.model.forward)

    @property
    def model(self) -> nn.Module:
        """The model given to Rockmate (its parameters receive the gradients)."""
        module = self.compiled.model
        return module.model if isinstance(module, FlatModel) else module

    @property
    def code(self) -> str:
        """The generated source of the forward and backward phases (like ``GraphModule.code``)."""
        return self.compiled.code

    @torch.compiler.disable(recursive=True)
    def forward(self, *args, **kwargs):
        """Call as the model is called: the same positional and keyword arguments as the
        sample (tensors of the sample's shapes, dtypes and devices; the sample's non-tensor
        values); returns the model's output structure (a tensor, tuple, dict, ``ModelOutput``).
        ``torch.compile`` of a model around this module runs it as it is (a graph break): its
        schedule frees and recomputes tensors, which a compiled graph would not do."""
        flat = self._flat_inputs(args, kwargs)
        if self.training and self.model.training and torch.is_grad_enabled():  # (else the plain model runs)
            hooked = self._state.hooked()
            if hooked is not None:
                path, kind = hooked
                where = f"module {path!r} of the model" if path else "the model"
                raise RuntimeError(
                    f"Rockmate: {where} has {kind}, registered after Rockmate was built: the "
                    "compiled module runs the captured graph, not the modules' forward methods, so they would "
                    "never run. Register them on the Rockmate module itself, or remove them while training")
            changed = self._state.changed()
            if changed or self.compiled.differs_only_in_shapes(flat):
                return self._variant(flat, args, kwargs, changed)(*args, **kwargs)
        return self._structured(self.compiled(*flat))

    def _variant(self, flat: tuple, args: tuple, kwargs: dict, changed: list) -> "Rockmate":
        """The plan for a call whose tensors have other shapes than the sample's, or for new
        values of the model's Python attributes (``changed``: a temperature, a dropout's ``p``,
        which the captured graph holds as constants): made at the first such call (with the
        same model, budget, solver and options, this call's inputs as the sample), with a
        warning, then reused. A new shape needs a new plan (sizes, and so the schedule, change);
        the last batch of an epoch is the usual case."""
        shapes = tuple(tuple(value.shape) for value in flat if isinstance(value, torch.Tensor))
        key = (shapes, self._state.key())
        variant = self._variants.get(key)
        if variant is None:
            began = time.perf_counter()
            recipe = self._recipe
            sample = [list(shape) for shape in self.compiled.sample_tensors_shapes()]
            new_shapes = list(map(list, shapes)) != sample
            what = f"inputs of shapes {list(map(list, shapes))} where the sample's are {sample}" if new_shapes else ""
            if changed:
                values = ", ".join(_change(*change) for change in changed[:3])
                what += (" and " if what else "") + f"a model changed since the build: {values}"
            if not isinstance(recipe["solver"], str):
                raise ValueError(f"Rockmate: called with {what}; a Rockmate built with a solver object cannot plan "
                                 "again: build one for this call")
            if len(self._variants) >= _MOST_VARIANTS:
                raise RuntimeError(
                    f"Rockmate: called with {what}, after {_MOST_VARIANTS} plans for other calls already: a value "
                    "that changes at every step (an annealed temperature) would be planned again at every step. "
                    "Keep such a value in a tensor the forward reads (register_buffer), which the plan reads "
                    "as it is at each call")
            # (the budget in bytes: a fraction is of the sample's peak, the memory the user has)
            variant = _rebuilt(self.model, (args, kwargs), self.plan.budget, recipe["solver"], recipe["options"],
                               self.training)
            moved = variant._state.changed()
            if moved:  # (planning again would not end)
                raise RuntimeError(f"Rockmate: the model changes while it is planned ({_change(*moved[0])}): "
                                   "build Rockmate again on the model as it will be trained")
            self._variants[key] = variant
            warnings.warn(
                f"Rockmate: called with {what}: planned again, within the same budget "
                f"({time.perf_counter() - began:.1f} s; each is planned once, then reused). "
                + ("A last smaller batch does this once per run; drop_last=True, or padding to the sample's "
                   "shapes, avoids it. " if new_shapes else "")
                + ("The captured graph holds the modules, shapes and Python values its forward read; a value "
                   "that changes often is better kept in a tensor (register_buffer)" if changed else ""),
                UserWarning, stacklevel=3)
        return variant

    def _flat_inputs(self, args: tuple, kwargs: dict) -> tuple:
        """The compiled module's positional inputs for a call of the model."""
        if isinstance(self.compiled.model, FlatModel):
            return tuple(self.signature.tensors(args, kwargs))
        if kwargs:
            raise TypeError(f"Rockmate was built with positional inputs only and received the keyword "
                            f"arguments {sorted(kwargs)}; build it with them in the sample (a dict, or kwargs=)")
        return args

    def _structured(self, outputs):
        """The compiled module's outputs in the structure the model returns."""
        if isinstance(self.compiled.model, FlatModel):
            return self.signature.unflatten_output(outputs)
        spec = self.graphs.captured.out_spec
        if isinstance(outputs, tuple) and spec is not None and spec.type is not tuple:
            return pytree.tree_unflatten(list(outputs), spec)  # a dict or a list, as the model returns
        return outputs

    def memory_timeline(self, *args, loss_fn: Callable[[Any], torch.Tensor] | None = None, **kwargs) -> Timeline:
        """Run one training step on the call ``(*args, **kwargs)`` (``loss_fn(output).backward()``;
        by default the model's own loss where it returns one and the plan counts no gradient for
        its other outputs (``output_gradients``), else the sum of every output's elements) and
        return the memory of each
        operation of the schedule, predicted by the plan against measured by the allocator
        (CPU: the profiler's allocation events). The step's gradients accumulate into the
        parameters as any step's do; parameters whose ``.grad`` is None get theirs allocated
        during the step, which the measure then counts (the budget does not: zero the
        gradients, ``p.grad = torch.zeros_like(p)``, to measure a step after the first)."""
        if loss_fn is None:
            loss_fn = _model_loss if self.graphs.simplified.outputs_without_gradient else _sum_of_outputs
        return measure_timeline(self.compiled, self._flat_inputs(args, kwargs),
                                lambda outputs: loss_fn(self._structured(outputs)), self.plan)

    def plot_memory(self, path, *args, loss_fn: Callable[[Any], torch.Tensor] | None = None, **kwargs) -> Path:
        """Draw :meth:`memory_timeline` of one step on the call ``(*args, **kwargs)`` to ``path``
        with matplotlib: predicted against measured, the budget, and the operation where the
        measured peak is. Returns the path written."""
        from .plot import plot_timeline

        timeline = self.memory_timeline(*args, loss_fn=loss_fn, **kwargs)
        return plot_timeline(timeline, path, budget=self.plan.budget)

    def render(self, directory) -> list[str]:
        """Draw the forward graph, the blocks, the CD-graphs and the schedule with graphviz.

        Returns the paths of the files written. Needs the ``dot`` program (Debian/Ubuntu:
        ``apt-get install graphviz``; macOS: ``brew install graphviz``).
        """
        from .render import render_all

        return render_all(self.graphs, self.plan, directory)

    def extra_repr(self) -> str:
        plan = self.plan
        return (
            f"budget={format_bytes(plan.budget)}, predicted_peak={format_bytes(plan.predicted_peak)}, "
            f"solver={plan.solver!r}, blocks={len(self.graphs.chain.blocks)}, "
            f"classes={len(self.graphs.chain.classes)}"
        )


def _renamed_keys(state_dict, old: str, new: str, keep: str | None = None) -> None:
    """Rename in place the keys (and the metadata entries) of ``state_dict`` that start with
    ``old`` to start with ``new`` instead, the order kept; those starting with ``keep`` stay."""
    def renamed(key: str, dotted: bool) -> str | None:
        name = key if dotted or not key else key + "."  # a metadata entry is a module's prefix
        if not name.startswith(old) or (keep is not None and name.startswith(keep)):
            return None
        name = new + name[len(old):]
        return name if dotted else name.rstrip(".")

    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        name = renamed(key, True)
        state_dict[key if name is None else name] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        entries = list(metadata.items())
        metadata.clear()
        for key, value in entries:
            name = renamed(key, False)
            metadata[key if name is None else name] = value


def _as_model_keys(module: "Rockmate", state_dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: ``compiled.model.0.weight`` becomes the model's ``0.weight``."""
    _renamed_keys(state_dict, prefix + module._inner_prefix(), prefix)


def _as_inner_keys(module: "Rockmate", state_dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    """Load-state-dict pre-hook: the model's keys (or this module's own, as older versions saved
    them) go to the model inside."""
    _renamed_keys(state_dict, prefix, prefix + module._inner_prefix(), keep=prefix + "compiled.")


def _errors_in_model_keys(module: "Rockmate", incompatible) -> None:
    """Load-state-dict post-hook: missing and unexpected keys are named as the model names them."""
    inner = module._inner_prefix()
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [key.replace(inner, "", 1) for key in keys]


def _with_signature(call, like):
    """``call``, shown with the signature of ``like``."""

    def forward(*args, **kwargs):
        return call(*args, **kwargs)

    forward.__signature__ = inspect.signature(like)
    forward.__doc__ = call.__doc__
    return forward


def _change(what: str, then, now) -> str:
    """One change of :meth:`ModelState.changed`, in words."""
    if what.startswith("module "):
        return f"{what} is {'now a ' + now if now != 'nothing' else 'gone'} (built with {then})"
    return f"{what} = {now!r} (built with {then!r})"


# the most plans one Rockmate makes for other shapes and attribute values (torch.compile's
# recompile limit is 8 too)
_MOST_VARIANTS = 8


def _rebuilt(model: nn.Module, call: tuple, budget, solver: str, options: dict, training: bool) -> "Rockmate":
    """A Rockmate planned again for ``model`` (the target of :meth:`Rockmate.__reduce__`)."""
    args, kwargs = call
    with torch.random.fork_rng(devices=[]):  # planning runs the model: leave the user's generator
        rebuilt = Rockmate(model, None, budget, solver, args=args, kwargs=kwargs, **options)
    # (the module's own mode: the model's submodules keep theirs, a frozen BatchNorm its eval)
    rebuilt.training = rebuilt.compiled.training = training
    return rebuilt


def _flat_call(model: nn.Module, sample, args, kwargs) -> tuple[CallSignature, nn.Module, tuple]:
    """The call's signature, the module the pipeline captures and its positional sample: the
    model itself where it is called with positional tensors, else :class:`FlatModel`."""
    call_args, call_kwargs = split_sample(sample, args, kwargs)
    signature = CallSignature.of(call_args, call_kwargs)
    if signature.is_plain:
        return signature, model, call_args
    return signature, FlatModel(model, signature), tuple(signature.leaves[i] for i in signature.tensor_positions)


def _model_loss(outputs) -> torch.Tensor:
    """The loss the model returns (its ``loss`` entry), from which alone its plan's backward runs."""
    return outputs["loss"]


def _sum_of_outputs(outputs) -> torch.Tensor:
    """The default loss of a measured step: the sum of every output's elements."""
    return sum(t.sum() for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad)


def _operation_floor(graphs: ModelGraphs) -> tuple[int, str]:
    """The operation floor of the model (bytes) and the operation that sets it, described with
    its module path and source line."""
    whole = graphs.model_chain.whole_graph()
    floor = operation_floor(whole)
    held = graphs.model_chain.held_bytes  # (first-run memory depends on the plan: not in a floor)
    if not floor.node:
        return held + floor.bytes, "the memory held through the step (copies of buffers)"
    node = whole.compute(floor.node)
    if node.kind is ComputeKind.LOSS:
        return held + floor.bytes, "the loss (with the model's outputs and their gradients)"
    names = {n.name for n in graphs.simplified.nodes}
    what = describe_fx_node(graphs.simplified.node(node.target).main) if node.target in names else node.target
    return held + floor.bytes, ("the backward of " if node.kind is ComputeKind.BACKWARD else "") + what


@_older_objects_frozen
def min_budget(model: nn.Module, sample=None, solver="rockmate", *, args=None, kwargs=None, **options) -> int:
    """The smallest budget (bytes) that ``solver`` can meet for ``model`` on ``sample``
    (given as ``Rockmate`` takes it: a tensor, a tuple, a dict of keyword inputs, or
    ``args=``/``kwargs=``)."""
    build_options, solver_options = _split_options(options)
    _, module, flat_sample = _flat_call(model, sample, args, kwargs)
    graphs = _build_graphs(module, flat_sample, build_options)
    return registry.min_budget(graphs.model_chain, solver, **solver_options)
