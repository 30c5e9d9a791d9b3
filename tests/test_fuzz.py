"""Property-based fuzzing of the whole pipeline on random models (:mod:`random_models`).

Property: for a random model, random dtype and input, at a random fraction of eager's peak,
either Rockmate trains it exactly (bitwise outputs, parameter and input gradients and buffers
over two steps) within the budget as the allocator measures it, at the fraction or at the
minimum that ``InfeasibleBudget`` gives; or it raises a named ``CaptureError`` or
``UnsupportedOperation``. Any other exception is a failure, and so is a plan without
recomputation predicted above eager's allocator peak, or a minimum above that plan's peak.

The ``ci`` profile (the default) runs a fixed-seed set of examples; ``--hypothesis-profile=long``
runs 2000 (``benchmarks/fuzz.py`` reports that run's figures).
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import torch  # noqa: E402

from random_models import check_program, programs  # noqa: E402
from random_models import program as written  # noqa: E402

# the profiles ("ci", the default, and "long") are registered in conftest.py

# small option grids: the property is about exactness and the budget, not the plan's quality
GRID = dict(peak_steps=3, save_steps=3)


# The CI set of random programs is fixed by this seed (not by the test's source, which every new
# regression example would change). Failures of other sets (none open: README, Figures,
# fuzzing) are found by benchmarks/fuzz.py, which reports them.
@seed(20261123)
# programs that failed once (benchmarks/fuzz.py), run first
@given(program=programs(), fraction=st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]))
# sixteenth session: a dropout of values made from constants alone, read by two nodes, drew a
# mask in each reader (XLNet's positional encoding: every later mask another); values that
# carry gradients written into a zeros made from constants (a KeyError in the inspection)
# seventeenth session: an expand read by two nodes (a trained parameter's, Perceiver's latents; a
# result's, made after another reader) had its backward run by each reader's island apart,
# where eager sums the readers' gradients first (1 ulp off)
# twenty-first session (fuzz seed 137): slices of an add's result read by a cat and a tanh, the
# add passing its gradient on to an expanded parameter and a mul: the inspection took that one
# storage off the backward's peak twice (as first-run memory and as the parts' shared storage),
# so the slices' second input-sized tensor went uncounted: 6928 B measured against 6336 B
@example(written([("transpose_tanh", [0]), ("dropout", [1]), ("linear_frozen", [2]), ("expanded_query", [3]),
                  ("halves", [4]), ("transpose_tanh", [5])], [2, 6], batch=3, seq=6, dim=8, dtype=torch.float64,
                 seed=31349), 0.5)
@example(written([("linear", [0]), ("expanded_query", [1]), ("layer_norm", [2]), ("expanded_query", [3])], [4],
                 seq=4, dim=8, seed=7), 1.0)
@example(written([("linear", [0]), ("broadcast_mean", [1]), ("tanh", [2])], [3], batch=3, seq=4, dim=8,
                 input_requires_grad=True, seed=8), 0.0)
# disjoint slices of a result stay its exported views where several nodes read them (q, k, v of
# nn.MultiheadAttention): fuzz seed 105 found a cat of two slices of a convolution's result, one
# reader, 576 B over the budget when they stayed exported too
@example(written([("linear", [0]), ("sigmoid", [1]), ("add", [2, 0]), ("conv2d", [3]), ("cat_time", [4, 4]),
                  ("add", [5, 5]), ("add", [6, 6]), ("counter", [5])], [8], batch=2, seq=4, dim=8,
                 dtype=torch.float64, seed=19432), 0.3)
@example(written([("linear", [0]), ("positions_dropout", [1]), ("dropout", [2]), ("linear", [3])], [4], seq=6,
                 dim=8, seed=3), 1.0)
@example(written([("linear", [0]), ("gate_write", [1]), ("tanh", [2]), ("gate_write", [3])], [4], seq=4, dim=8,
                 input_requires_grad=True, seed=5), 0.0)
# fuzz seed 65: a result read by its own island's view (returned) and by dropouts whose results
# are unused gets no gradient from outside its island (the inspection gave it one, and
# credited its free: 1056 B over the budget at the minimum)
@example(written([("cat_linear", [0, 0]), ("dropout_unused", [1]), ("split_swap", [2]), ("identity_view", [2]),
                  ("identity_view", [4]), ("hardswish", [5]), ("dropout", [6])], [5], seq=4, dim=16,
                 dtype=torch.float64, seed=0), 0.0)
# fuzz seed 67: a block's output whose view part only the block's own nodes read gets no
# gradient from the loss there (its first contribution, a matmul's, is a view of the bmm's
# gradient, summed out of place: 288 B over the budget; the first build also planned another
# minimum than the next ones)
@example(written([("inplace_mul", [0, 0]), ("batch_norm", [0]), ("linear_tied", [2]), ("mean_scale", [3]),
                  ("identity_view", [4]), ("attention", [5, 5]), ("identity_view", [6])], [4, 6, 7], dim=16,
                 input_requires_grad=True, seed=50), 0.8)
# fuzz seed 65: two adds pass one gradient on to `tanh(x)` and to `x` (returned): both sums are
# made while that gradient lives (272 B over the budget at the minimum)
@example(written([("tanh", [0]), ("add", [1, 0]), ("add", [2, 1])], [0, 3], batch=2, seq=4, dim=8,
                 input_requires_grad=True, seed=65536), 0.3)
# a view of a result that the user gets, made after another reader of the result: eager adds the
# view's gradient first (exec.codegen._result_views_made_late); also where the result's node is
# merged with its producer (an in-place relu after a linear) and another node reads the view
# a step counter incremented three times (the restored in-place addition of rkgb.capture must leave
# values computed from buffers alone functional: the counter's new value lost an increment)
@example(written([("attention", [0, 0]), ("softmax", [1]), ("counter", [2]), ("index_assign", [3, 3]), ("sub", [4, 4]),
                  ("counter", [4]), ("counter", [6]), ("add", [7, 7])], [2], batch=2, seq=6, dim=16,
                 dtype=torch.float64, input_requires_grad=True), 1.0)
# islands that read a leaf twice: each released alias viewed a new scalar (8 bytes per read per
# step, uncounted): 72 B above the budget at the loss of this 6 KB model (fuzz seed 21)
@example(written([("add", [0, 0]), ("add", [1, 1]), ("attention", [2, 2]), ("attention", [3, 3])], [1, 4], batch=2,
                 seq=6, dim=8, dtype=torch.float64, input_requires_grad=True), 1.0)
# a returned view of the input that readers split: eager sums the pieces in its split node, then
# adds that sum to the user's gradient of the view (exec.codegen._group_argument, "<view>.pieces")
@example(written([("identity_view", [0]), ("chunk_mul", [1])], [1, 2], batch=3, seq=6, dim=8, dtype=torch.float64,
                 input_requires_grad=True), 0.3)
# a split of a tensor written in place (functionalization makes one split per piece: merged again,
# rkgb.capture.merge_regenerated_views; two splits summed a relu's -0.0 into +0.0)
@example(written([("inplace_mul", [0, 0]), ("split_swap", [1]), ("copy_into", [2]), ("relu", [3])], [4], batch=3,
                 seq=6, dim=8, dtype=torch.float64, input_requires_grad=True), 1.0)
@example(written([("linear", [0]), ("mul", [1, 1]), ("identity_view", [1])], [2, 3], batch=2, seq=6, dim=8,
                 dtype=torch.float64, input_requires_grad=True), 1.0)
@example(written([("linear_relu_inplace", [0]), ("mul", [1, 1]), ("identity_view", [1]), ("conv1d", [3])],
                 [1, 2, 3], batch=2, seq=6, dim=8, dtype=torch.float64, input_requires_grad=True), 1.0)
# a transposed view of a linear's result read by a conv, the result itself by another op: the
# view's gradient reaches the linear's first and the sum is transposed, as in eager
@example(written([("conv1d", [0]), ("dropout", [1]), ("linear", [2]), ("copy_into", [3]), ("mean_scale", [4]),
                  ("conv1d", [3])], [5, 6], dim=16, input_requires_grad=True, seed=126), 0.0)
# a slice of an output read by the next op (index assignment), after the op's clone
@example(written([("relu", [0]), ("linear", [0]), ("softmax", [2]), ("gelu", [3]), ("index_assign", [4, 4])],
                 [2, 4, 5], seq=6, dim=16, input_requires_grad=True, seed=26791), 0.0)
@example(written([("chunk_mul", [0]), ("index_assign", [1, 1]), ("add", [1, 2]), ("add", [3, 3]), ("add", [4, 4]),
                  ("conv2d", [5]), ("linear_tied", [5])], [2, 3], batch=3, dim=16, input_requires_grad=True,
                 seed=268), 0.5)
# a view of the input read twice by one op (attention's transposed key and its value)
@example(written([("attention", [0, 0]), ("layer_norm_plain", [0]), ("silu", [2]), ("sub", [3, 3]), ("relu", [4])],
                 [1, 4, 5], batch=3, input_requires_grad=True), 0.3)
# a gradient that is its own contribution again: an add's backward passes one tensor to both
# inputs (x.grad was added into itself)
@example(written([("add", [0, 0]), ("add", [1, 0]), ("add", [2, 2]), ("add", [3, 3])], [4],
                 batch=2, seq=4, dim=8, input_requires_grad=True), 1.0)
# a view of the input read by several nodes (chunk): its gradient summed apart, as eager's buffer
@example(written([("chunk_mul", [0])], [0, 1], batch=2, seq=4, dim=16, input_requires_grad=True), 0.5)
# a view of the input whose backward eager runs after the nodes made after it
@example(written([("identity_view", [0]), ("sum_add", [0]), ("gelu", [1])], [2, 3], batch=2, seq=4,
                 dim=16, dtype=torch.float64, input_requires_grad=True), 0.5)
# the DP's peak above the simulator's: the plan is the simulator's, not an internal error
@example(written([("linear_tied", [0]), ("cat_time", [0, 0]), ("batch_norm", [2]), ("batch_norm", [3]),
                  ("attention", [4, 4])], [0, 5], batch=2, seq=4, dim=16), 0.0)
# a model output computed again in the backward: the user's tensor keeps the first storage
@example(written([("attention", [0, 0]), ("reshape_softmax", [0]), ("copy_into", [2]), ("conv1d", [3]),
                  ("conv1d", [4]), ("mean_scale", [5]), ("conv1d", [6])], [3, 7], dim=16, dtype=torch.float64), 0.0)
# a CPU batch norm's backward of a transposed input gives a contiguous gradient (its meta
# function says transposed): the convolution before it measured with the real layout
@example(written([("transpose_tanh", [0]), ("gelu", [1]), ("sum_add", [0]), ("chunk_mul", [3]), ("conv2d", [4]),
                  ("batch_norm", [5]), ("sigmoid", [6])], [6, 7], dim=16, dtype=torch.float64,
                 input_requires_grad=True, seed=65536), 0.8)
# the real layout corrected block after block, backward (three passes of inspection)
@example(written([("cat_linear", [0, 0]), ("batch_norm_unused", [1]), ("copy_into", [2]), ("batch_norm", [3]),
                  ("add", [4, 4]), ("add", [5, 2]), ("linear_relu_inplace", [6])], [4], batch=3, seq=6, dim=16,
                 seed=65535), 0.3)
# the minimum where the DP's figure and the simulator's differ: the budget the whole solve meets
@example(written([("cat_linear", [0, 0]), ("layer_norm", [1]), ("split_swap", [2]), ("index_assign", [1, 1]),
                  ("index_assign", [4, 4]), ("layer_norm", [5]), ("add", [6, 6]), ("add", [7, 7])], [2, 5, 7],
                 dtype=torch.float64), 0.0)
# a view of the input that the user gets and one op reads twice (cat): the loss's gradient
# opens the view's sum, then each read's in turn, as eager's view buffer adds them
@example(written([("identity_view", [0]), ("identity_view", [0]), ("cat_linear", [2, 2])], [2, 3], batch=3,
                 seq=6, input_requires_grad=True, seed=73), 0.3)
# a view of a node's result (chunk) that two nodes read, the result itself read by a node made
# before the view: the view's gradient joins the result's where eager runs the view's backward
@example(written([("conv1d", [0]), ("linear_tied", [1]), ("chunk_mul", [1])], [1, 2, 3], dtype=torch.float64,
                 seed=43), 0.3)
@example(written([("attention", [0, 0]), ("mean_scale", [1]), ("add", [0, 2]), ("chunk_mul", [1]), ("silu", [4])],
                 [3, 4, 5], batch=3, seq=6, input_requires_grad=True, seed=1367), 0.8)
# a view of a node's result read by one node, and the result read by a node made between the
# view and its reader: the view's gradient joins the result's at the view's place
@example(written([("linear", [0]), ("identity_view", [1]), ("scale", [1]), ("tanh", [2])], [1, 3, 4], seed=1), 1.0)
# a view of the input made in an island after its own read of the input (index assignment): its
# gradient joins in the order of the island's reads, the returned input's first
@example(written([("index_assign", [0, 0]), ("index_assign", [1, 1]), ("index_assign", [2, 1])], [0, 1, 2], seq=6,
                 dim=16, input_requires_grad=True, seed=2098), 0.8)
# the input's gradient made by one view group alone: the group's sum is that gradient (the plan
# without recomputation counted it twice, above eager's peak)
@example(written([("chunk_mul", [0])], [1], batch=3, seq=6, dim=16, dtype=torch.float64, input_requires_grad=True,
                 seed=500), 0.0)
# a slice of a cat's gradient (a leaf's only contribution) kept as eager's buffer keeps it, a
# view: silu's backward of a strided gradient rounds otherwise than of a contiguous copy
@example(written([("linear_frozen", [0]), ("linear_frozen", [1]), ("sub", [0, 2]), ("silu", [3]),
                  ("cat_linear", [4, 3])], [0, 5], batch=2, seq=4, dim=8, input_requires_grad=True, seed=6), 0.5)
@example(written([("sub", [0, 0]), ("mean_scale", [1]), ("layer_norm", [2]), ("chunk_mul", [3]), ("gelu", [4]),
                  ("silu", [5])], [3, 5], dim=16, dtype=torch.float64), 0.0)
# that slice as a block's input gradient: it holds the whole cat gradient's storage
@example(written([("conv2d", [0]), ("cat_linear", [0, 1])], [2], seq=6, dim=16, dtype=torch.float64, seed=30755),
         0.8)
# a view of a node's result that its reader makes after its own operation (the slice written
# into the reader's clone): made there, its backward runs before the clone's, as in eager
@example(written([("conv1d", [0]), ("index_assign", [1, 1])], [2], batch=3, dim=8, dtype=torch.float64,
                 input_requires_grad=True, seed=1010), 0.0)
# a returned view of the input (a view group's alias of a global): no reference cycle keeps the
# input's gradient after the step, so that autograd hands it to the user without a copy
@example(written([("identity_view", [0]), ("relu", [1]), ("dropout", [2])], [1], batch=3, dim=16,
                 input_requires_grad=True, seed=1882), 0.8)
# views of another node's result made in a node after its own operation, a view of such a view
# among them: a block input synthesized for the inspection rebuilds only its own views
@example(written([("reshape_softmax", [0]), ("square_plus", [0]), ("reshape_softmax", [2]), ("index_assign", [2, 3]),
                  ("mul", [4, 4]), ("add", [5, 5]), ("add", [4, 6]), ("add", [7, 4])], [5], dim=16,
                 dtype=torch.float64), 0.5)
# a batch norm's CPU kernel returns another layout than its meta function: a block measured
# again in a later inspection pass (a corrected gradient layout) gets its input with the real
# one, so the next linear's contiguous copy of its input (kept for its backward) is counted
@example(written([("batch_norm", [0]), ("linear", [1]), ("batch_norm", [2]), ("add", [0, 3])], [4]), 0.5)
# a `cat` of two nodes' results: its backward hands each a slice of one gradient made inside
# the island; a slice kept as a node's gradient holds the whole of it, and is counted so
@example(written([("gelu", [0]), ("chunk_mul", [0]), ("chunk_mul", [2])], [1, 3], batch=2, seq=4, dim=16,
                 dtype=torch.float64, input_requires_grad=True, seed=6263), 0.8)
# a backward merged into its reader's island (exec/merge.py): the contributions of the merged
# call join their gradients after the forgets that follow it, as the simulator replays it
@example(written([("batch_norm", [0]), ("identity_view", [1]), ("attention", [2, 2]), ("batch_norm", [3]),
                  ("linear_frozen", [4]), ("cat_linear", [3, 5]), ("linear_frozen", [6]), ("batch_norm_unused", [7])],
                 [0, 4], batch=2, seq=6, dim=16, dtype=torch.float64, input_requires_grad=True), 1.0)
# a node's pieces read by a `cat` each (across blocks): their gradients are slices of the cat's
# gradient and count that storage once between them, not once each
@example(written([("mul", [0, 0]), ("chunk_mul", [1]), ("split_swap", [1])], [2, 3], seq=6, dim=16,
                 input_requires_grad=True), 1.0)
# a split of the input read by two islands, one reading both pieces, one the first: the
# group sums only the pieces each island read, as eager's split node does (a sum of whole
# gradients added the +0.0 of the unread piece to a -0.0 of relu's zeros)
@example(written([("chunk_mul", [0]), ("relu", [1])], [2], batch=2, seq=6, dim=8, input_requires_grad=True,
                 seed=11663), 1.0)
# a view of the input that the user gets, beside a `cat` of the input: its gradient joins the
# input's after the cat's contributions, where eager runs the view's backward (a view group)
@example(written([("identity_view", [0]), ("cat_linear", [0, 0])], [1, 2], batch=3, seq=6, dim=8, dtype=torch.float64,
                 input_requires_grad=True, seed=23634), 0.3)
# two view groups of the input (a returned view, a transpose read by a node) and a direct read:
# the groups still open at the backward's end join in the order eager's engine runs the views'
# backwards (the view made last first)
@example(written([("identity_view", [0]), ("transpose_tanh", [0]), ("cat_linear", [2, 0])], [1, 3], batch=3, seq=6,
                 dim=8, dtype=torch.float64, input_requires_grad=True, seed=23634), 0.3)
# a split of a node's result whose pieces one other node alone reads: made in that node, as
# eager makes it, so that its contribution joins the result's gradient before those of the
# nodes made before the split (eager's engine order), not after all of them
@example(written([("cat_linear", [0, 0]), ("linear", [1]), ("split_swap", [1]), ("attention", [3, 2])], [1, 4],
                 batch=3, seq=6, dim=8, dtype=torch.float64, input_requires_grad=True, seed=2712), 0.5)
# an input and a view of it, both returned: the view's group sum joins the input's gradient out
# of place when the backward ends (a third input-sized tensor; seed 15)
@example(written([("identity_view", [0])], [0, 1], batch=3, seq=4, dim=16, dtype=torch.float64,
                 input_requires_grad=True, seed=381), 0.8)
# a value returned twice and a copy of it written in place returned twice: each is one tensor
# behind one output gate, whose two gradients the engine sums as they come (seed 33: all four
# gradients and two sums were held at once, 776 B above the plan at the loss)
@example(written([("relu", [0]), ("batch_norm_unused", [1]), ("dropout_unused", [2]), ("index_assign", [3, 3]),
                  ("dropout_unused", [4])], [1, 2, 4, 5], batch=3, input_requires_grad=True), 0.8)
# a result read by a node made before its view (h + h), the view split by one node and sliced by
# another (fuzz seed 193): the split's pieces, exported by the result's node, passed their
# gradients to the node's backward after h + h's, where eager sums them into the view's first
@example(written([("linear", [0]), ("add", [1, 1]), ("identity_view", [1]), ("chunk_mul", [3]),
                  ("cat_time", [4, 3])], [2, 5], batch=3, seq=6, dim=16, dtype=torch.float64, seed=11581), 1.0)
# ... the view read twice by one cat beside a slice of it in another node (fuzz seed 193): the
# island's engine summed the cat's two contributions before the group's first
@example(written([("conv1d", [0]), ("add", [1, 1]), ("identity_view", [1]), ("cat_linear", [3, 3]),
                  ("conv1d", [4]), ("cat_time", [5, 3])], [2, 6], batch=3, seq=6, dim=16, dtype=torch.float64,
                 seed=11581), 0.3)
def test_random_models_are_exact_and_within_budget(program, fraction):
    check_program(program, fraction, **GRID)



# the plan without recomputation holds what eager holds: gradients that a backward passes on (an
# add's to each of its inputs, a model input's among them) share the storage of its own incoming
# gradient and are counted once (these plans were predicted one or two tensors above eager's peak)
NO_RECOMPUTATION_AT_EAGER = [
    written([("add", [0, 0])], [0, 1], batch=3, seq=4, dim=16, input_requires_grad=True),
    written([("silu", [0]), ("add", [0, 1]), ("add", [2, 2])], [1, 3], batch=3, seq=6, dim=16, dtype=torch.float64,
            input_requires_grad=True),
    written([("square_plus", [0])], [1], batch=2, seq=6, dim=8, dtype=torch.float64, input_requires_grad=True),
    # a view of the input read by one node: its gradient waits apart until the view's place in
    # the backward, after an add passed the input its own gradient (counted so, not less)
    written([("identity_view", [0]), ("sum_add", [0]), ("gelu", [1])], [2, 3], batch=2, seq=4, dim=16,
            dtype=torch.float64, input_requires_grad=True),
    # an in-place product where no autograd runs, on the value returned (written in place, as
    # eager does: 1.485x eager's peak before, the highest of fuzz seed 25)
    written([("transpose_tanh", [0]), ("inplace_mul", [1, 1])], [2], batch=3, seq=6, dim=8),
    # the input returned three times (seed 35: 2048 B planned against eager's 1552 B)
    written([("dropout_unused", [0]), ("dropout_unused", [1])], [0, 1, 2], dtype=torch.float64,
            input_requires_grad=True),
    # two unused batch norms: the functional op's new running statistics, held to the forward's
    # end (seed 57: 1.40x eager's peak, now the statistics are written in place as eager does)
    written([("batch_norm_unused", [0]), ("batch_norm_unused", [1])], [0], batch=2, seq=4, dim=8,
            input_requires_grad=True),
    # a tied linear whose second reader gets no gradient (it feeds an unused batch norm): no
    # sum of the weight's contributions to count (seed 61: 2160 B above eager's peak)
    written([("conv1d", [0]), ("linear_tied", [1]), ("conv2d", [0]), ("linear_tied", [3]),
             ("batch_norm_unused", [4]), ("add", [5, 5])], [0, 2], batch=2, seq=4, dim=16, dtype=torch.float64),
    # a slice written into a copy (`out = v.clone(); out[:, 0] = v[:, -1]`): the copy's island
    # hands its incoming gradient over to the engine, which frees it once `CopySlices` has run,
    # as eager's does (seed 63: 6240 B planned, 6264 B measured against eager's 5296 B)
    written([("layer_norm_plain", [0]), ("index_assign", [1, 1])], [0, 2], batch=3, seq=6, dim=8,
            dtype=torch.float64, input_requires_grad=True, seed=121),
    # a `cat`'s gradient sliced by its backward for two nodes (a mul and a linear's split): one
    # storage between them, counted twice before (fuzz seed 123: 8640 B planned, 8092 B measured
    # against eager's 8072 B)
    written([("chunk_mul", [0]), ("linear_tied", [1]), ("chunk_mul", [2]), ("chunk_mul", [3])], [1, 4], batch=3,
            seq=6, dim=16, seed=3604),
    # ... and an add's two incoming gradients summed by the engine in the island (the add and its
    # returned view), passed to the mul and to the expanded parameter's sum: one tensor (fuzz seed
    # 123: 13824 B planned, 11552 B measured against eager's 11536 B)
    written([("expanded_query", [0]), ("identity_view", [1])], [0, 1, 2], batch=3, seq=6, dim=16,
            dtype=torch.float64, seed=4252),
    # ... which a later contribution is added into in place once the mul has let go of it (fuzz
    # seed 125: 9216 B planned, and the mul and tanh islands merged up to it, 9264 B measured,
    # against eager's 7696 B)
    written([("expanded_query", [0]), ("cat_time", [1, 1])], [2], batch=2, seq=6, dim=16, dtype=torch.float64,
            input_requires_grad=True, seed=45881),
    written([("batch_norm_unused", [0]), ("transpose_tanh", [1]), ("batch_norm_unused", [2]),
             ("batch_norm_unused", [3]), ("index_assign", [4, 4])], [5], batch=3, seq=4, dim=8,
            dtype=torch.float64, input_requires_grad=True, seed=1300),
    # eighteenth session: disjoint slices of a returned result, read by a cat and a tanh, each
    # summed in a view group at the result's size (seed 111: 1.246x eager's peak); and a part of
    # a view of a result that other nodes read too (`a[:, 0, 0]`), kept in the result's node,
    # added its gradient after theirs where eager adds it among them (seed 113: input gradient
    # not bitwise; 1.118x eager's peak before the slices of the returned result went ungrouped)
    written([("split_swap", [0]), ("halves", [1])], [1, 2], batch=3, seq=4, dim=8, input_requires_grad=True, seed=1),
    written([("linear_frozen", [0]), ("hardswish", [1]), ("attention", [2, 2]), ("broadcast_mean", [3]),
             ("gate_write", [2]), ("halves", [5]), ("add", [6, 4])], [5, 6, 7], batch=2, seq=4, dim=16,
            input_requires_grad=True, seed=238),
    # a model input read twice in one node (`out = x.clone(); out[:, 0] = x[:, -1]`): the second
    # contribution to its gradient was counted as summed into a new tensor, where the sink adds
    # it in place into the first, a dense tensor of its own (seed 113: 1.193x eager's peak)
    written([("index_assign", [0, 0]), ("batch_norm_unused", [1])], [1], batch=2, seq=6, dim=8,
            input_requires_grad=True, seed=178),
    # two layers of one class, each with a trained vector expanded and read by two nodes (`q *
    # tanh(a) + q`): the second layer's contribution that passes the add's gradient on was not
    # taken for an alias (the class's measures name the first layer's view), and the sum into
    # such an alias was counted as a new tensor where the sink adds into it in place (seed 117:
    # 1.165x eager's peak)
    written([("expanded_query", [0]), ("expanded_query", [1]), ("add", [2, 2])], [3], batch=3, seq=6, dim=16,
            dtype=torch.float64, seed=249),
]


@pytest.mark.parametrize("program", NO_RECOMPUTATION_AT_EAGER, ids=range(len(NO_RECOMPUTATION_AT_EAGER)))
def test_plans_without_recomputation_hold_what_eager_holds(program):
    import copy

    from exactness import DotLoss, eager_peak
    from random_models import make
    from rockmate import Rockmate

    model, x = make(program)
    with torch.no_grad():
        probe = copy.deepcopy(model)(x)
    eager = eager_peak(model, (x,), DotLoss(probe))
    none = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", cost_model="flops")
    assert none.plan.predicted_peak <= eager, program.source()
    for fraction in (1.0, 0.5):
        check_program(program, fraction, **GRID)


# twenty-first session: slices and splits of a model input that requires grad, read by islands
# that each ran the view's backward apart, making an input-sized gradient per read (or per
# reading island) held until the view's place in the backward, where eager sums each view's
# gradient at its own size and makes one input-sized tensor when the view's backward runs
# (`cat([x[:, :4], x[:, 4:]])` beside `tanh(x)`: 6152 B measured against eager's 5128 B; a
# `chunk` read by two islands, 6152 B against 5640 B). Summed at the view's size now, a split's
# pieces in slots of their own (rkgb.simplify.summed_input_views, GradientQueue.alias's piece)
SLICED_INPUTS = [
    # (fuzz seed 143: a parameter read by two linears, `.grad` holding values: the sum of its
    # contributions was added into `.grad` when the backward ended, where eager adds it as soon
    # as the last contribution is in; held through a convolution's backward: 19168 B measured
    # against eager's 16992 B; exec.codegen.restore_points)
    written([("tanh", [0]), ("conv2d", [0]), ("identity_view", [2]), ("linear_tied", [3]), ("tanh", [4]),
             ("tanh", [5]), ("copy_into", [6]), ("linear_tied", [5])], [8], dim=16, dtype=torch.float64),
    written([("cat_time", [0, 0]), ("tanh", [0])], [1, 2], seq=8, dim=16, input_requires_grad=True),
    written([("chunk_mul", [0]), ("tanh", [0])], [1, 2], seq=8, dim=16, input_requires_grad=True),
    written([("chunk_mul", [0]), ("cat_time", [0, 1])], [2], seq=8, dim=16, input_requires_grad=True),
    written([("split_swap", [0]), ("chunk_mul", [0])], [1, 2], seq=8, dim=16, input_requires_grad=True),
    written([("halves", [0]), ("tanh", [0])], [1, 2], seq=8, dim=16, input_requires_grad=True),
    # (fuzz seed 143: both slices' groups delivered at the backward's end, the first one's sum
    # counted until the second had joined: 5184 B predicted against eager's 4624 B)
    written([("halves", [0])], [1], batch=3, seq=6, dim=8, dtype=torch.float64, input_requires_grad=True,
            seed=549),
    # (fuzz seeds 139 and 143: the input returned too, its loss gradient a view of the loss's
    # own: the split's gradient joined it as a new sum while the pieces' sums still lived, where
    # eager's engine frees the split node's input buffer first: 1928 B measured against 1544 B)
    written([("split_swap", [0])], [0, 1], batch=3, seq=4, dim=8, input_requires_grad=True, seed=1),
    written([("tanh", [0]), ("split_swap", [0]), ("batch_norm_unused", [2])], [0, 3], batch=2, seq=6, dim=16,
            input_requires_grad=True, seed=1548),
    written([("split_swap", [0]), ("linear_frozen", [0])], [1, 2], batch=3, seq=6, dim=8, dtype=torch.float64,
            input_requires_grad=True, seed=2),
    written([("halves", [0])], [0, 1], batch=2, seq=4, dim=8, input_requires_grad=True),
    written([("cat_time", [0, 0]), ("chunk_mul", [0]), ("tanh", [0])], [1, 2, 3], seq=8, dim=16,
            dtype=torch.float64, input_requires_grad=True, seed=3),
]


def _peaks_without_recomputation(program) -> tuple[int, int, int]:
    """(eager's allocator peak, the plan without recomputation's predicted and measured peaks)."""
    import copy

    from exactness import DotLoss, eager_peak, step_peak
    from random_models import make
    from rockmate import Rockmate

    model, x = make(program)
    with torch.no_grad():
        probe = copy.deepcopy(model)(x)
    loss = DotLoss(probe)
    eager = eager_peak(model, (x,), loss)
    none = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", cost_model="flops")
    return eager, none.plan.predicted_peak, step_peak(none, (x,), loss)


def _holds_what_eager_holds(program) -> None:
    """The plan without recomputation predicted and measured at most eager's allocator peak,
    measured within 16 B of its prediction; bitwise at 1.0 and 0.5 of eager's peak."""
    eager, predicted, measured = _peaks_without_recomputation(program)
    # (the allocator's figures count 8 B more than the plan's: the aliases' one scalar)
    assert predicted <= eager and measured <= eager, (predicted, measured, eager, program.source())
    assert measured - predicted <= 16, (measured, predicted)
    for fraction in (1.0, 0.5):
        check_program(program, fraction, **GRID)


@pytest.mark.parametrize("program", SLICED_INPUTS, ids=range(len(SLICED_INPUTS)))
def test_slices_of_an_input_hold_what_eager_holds(program):
    _holds_what_eager_holds(program)


def test_contributions_through_a_view_of_the_input_alias_the_incoming_gradient():
    """``x.view(...) + x``: the add's backward passes its incoming gradient to both reads; the
    one through the view (summed apart in the view's group) is that gradient, not a new tensor
    (rkgb.build._input_grad_aliases): the plan's memory during the add's backward is what was
    there plus the one sum into the loss's gradient of ``x`` (3072 B; 3840 B before)."""
    import copy

    from exactness import DotLoss
    from random_models import make
    from rockmate import Rockmate

    program = written([("identity_view", [0]), ("identity_view", [1]), ("add", [2, 0])], [0, 3],
                      batch=2, seq=6, dim=8, dtype=torch.float64, input_requires_grad=True)
    model, x = make(program)
    with torch.no_grad():
        probe = copy.deepcopy(model)(x)
    none = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", cost_model="flops")
    timeline = none.memory_timeline(x, loss_fn=DotLoss(probe))
    during = dict(zip(timeline.labels, timeline.predicted))
    tensor = x.numel() * x.element_size()
    assert during["Compute(node='bwd_add', with_grad=True)"] == during["Compute(node='loss', with_grad=True)"] + tensor
    assert all(m <= p + 16 for p, m in zip(timeline.predicted, timeline.measured)), timeline
    for fraction in (1.0, 0.5):
        check_program(program, fraction, **GRID)


# a split of a node's result whose pieces two nodes read (fuzz seed 145: `chunk_mul` beside a
# `scale` of the same result): each reader made the split itself, its backward a result-sized
# gradient, and the group's sum result-sized from the first contribution (8080 B measured,
# 8064 B predicted, eager 7064 B); kept in the result's node where every gradient sum has at
# most two terms (rkgb.simplify._split_summed_exactly), grouped otherwise (three reads of a piece)
SPLIT_RESULTS = [
    written([("add", [0, 0]), ("add", [1, 0]), ("scale", [2]), ("chunk_mul", [2]), ("gate_write", [4])], [3, 4],
            batch=3, seq=6, dim=16, input_requires_grad=True, seed=397),
    written([("tanh", [0]), ("scale", [1]), ("chunk_mul", [1])], [2, 3], seq=8, dim=16),
    written([("tanh", [0]), ("scale", [1]), ("chunk_mul", [1]), ("chunk_mul", [1])], [2, 3, 4], seq=8, dim=16,
            dtype=torch.float64),
    written([("tanh", [0]), ("chunk_mul", [1]), ("scale", [1]), ("cat_time", [2, 1])], [3, 4], seq=8, dim=16,
            input_requires_grad=True, seed=5),
    # (the result also read three times by `a * a + a`: more than two terms, grouped as before)
    written([("tanh", [0]), ("scale", [1]), ("chunk_mul", [1]), ("square_plus", [1])], [2, 3, 4], seq=8, dim=16,
            dtype=torch.float64),
]


@pytest.mark.parametrize("program", SPLIT_RESULTS, ids=range(len(SPLIT_RESULTS)))
def test_splits_of_a_result_read_by_two_nodes(program):
    _holds_what_eager_holds(program)


# side inputs on random programs (``max_block_nodes=3``: most programs get some), found by
# `benchmarks/fuzz.py --max-block-nodes 3` (seed 29): a model output made before the last block
# and returned twice gets two gradients from the loss (counted once before: 768 B over the budget);
# one that is the next block's chain input is not forgotten after a no-grad run (seed 31)
SIDE_INPUT_PROGRAMS = [
    (written([("sum_add", [0]), ("layer_norm", [1]), ("linear_relu_inplace", [2]), ("sum_add", [3]), ("counter", [4]),
              ("split_swap", [5]), ("batch_norm", [6]), ("dropout", [7])], [2, 3, 8], batch=2, seq=6, dim=16,
             dtype=torch.float64, seed=65536), 0.8),
    (written([("dropout", [0]), ("batch_norm_unused", [1]), ("silu", [2]), ("batch_norm", [1])], [1, 2, 3],
             batch=2, seq=6, dim=16, input_requires_grad=True, seed=21750), 0.3),
    (written([("attention", [0, 0]), ("linear_relu_inplace", [1]), ("identity_view", [1]), ("cat_linear", [1, 0]),
              ("linear", [4]), ("square_plus", [5]), ("linear_relu_inplace", [3]), ("transpose_tanh", [4])],
             [1, 7, 8], batch=3, seq=6, dim=16, dtype=torch.float64, input_requires_grad=True, seed=49114), 0.5),
]


@pytest.mark.parametrize("case", SIDE_INPUT_PROGRAMS, ids=range(len(SIDE_INPUT_PROGRAMS)))
def test_random_models_with_side_inputs(case):
    program, fraction = case
    check_program(program, fraction, max_block_nodes=3, **GRID)


def test_nested_views_of_a_result_both_returned():
    """Found by fuzz seed 31 (failed the same way without side inputs): ``conv1d`` returns its
    result transposed (a view) and the user also gets a view of that view, while ``mul`` reads
    the first. Eager adds the inner view's gradient into the outer view's buffer where its
    engine runs the inner view's backward, before ``mul``'s contribution; the node's island
    added it after (a late view of a view: ``exec.codegen._result_views_made_late``)."""
    program = written([("inplace_mul", [0, 0]), ("sum_add", [1]), ("linear_frozen", [2]), ("softmax", [3]),
                       ("conv1d", [1]), ("mul", [5, 2]), ("square_plus", [5]), ("identity_view", [5])],
                      [4, 5, 6, 8], batch=2, seq=6, dim=16, dtype=torch.float64, input_requires_grad=True, seed=2075)
    check_program(program, 1.0, solver="none")


def test_a_returned_view_of_a_tensor_written_in_place_is_exact():
    """``out = x * 1.5; out.mul_(x); v = out.view(...); return v, out * out.mean(-1)``: the view
    is made before the product's reads in eager (its backward runs last), but functionalization
    re-makes it after them (``view_1`` has no stack trace), so ``exec.codegen`` takes it for a
    view made late, and the input's gradient was not bitwise (every solver, every budget): the
    capture now moves the view back to its place (``rkgb.capture.place_regenerated_views``)."""
    check_program(written([("inplace_mul", [0, 0]), ("identity_view", [1]), ("mean_scale", [1])], [2, 3],
                          batch=3, seq=6, dim=8, input_requires_grad=True), 1.0, solver="none")


def test_a_returned_result_read_through_chunks_holds_what_eager_holds():
    """``v1 = conv2d(x); left, right = v1.chunk(2, -1); return gelu(cat(...)), ..., v1`` (fuzz seed
    47): the conv's island has three outputs (the result and the two chunks the program reads),
    and one engine call from them held their incoming gradients and their sum until it ended,
    where eager's engine frees each once added: the plan without recomputation predicted 8016 B
    (measured 7792 B) against eager's 6752 B. The engine now holds them alone
    (:func:`rkgb.gradsink.handoff_backward`): 6992 B predicted (the chunks' gradients, two views of
    one storage, are not credited by the inspection), 6768 B measured."""
    import copy

    from exactness import DotLoss, eager_peak
    from random_models import make
    from rockmate import Rockmate

    program = written([("conv2d", [0]), ("chunk_mul", [1]), ("gelu", [2]), ("gelu", [3]), ("dropout_unused", [1])],
                      [3, 4, 5], batch=2, seq=4, dim=8, dtype=torch.float64, seed=165)
    model, x = make(program)
    with torch.no_grad():
        probe = copy.deepcopy(model)(x)
    eager = eager_peak(model, (x,), DotLoss(probe))
    none = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", cost_model="flops")
    assert none.plan.predicted_peak <= eager + 2 * 512, (none.plan.predicted_peak, eager)
    check_program(program, 1.0, solver="none")


def test_a_merged_layer_norm_and_softmax_stay_within_the_budget():
    program = written([("index_assign", [0, 0]), ("reshape_softmax", [1]), ("layer_norm_plain", [2]),
                       ("attention", [0, 3])], [0, 3, 4], batch=2, seq=4, dim=16, dtype=torch.float64,
                      input_requires_grad=True, seed=65536)
    check_program(program, 0.3)


def test_a_conv_read_by_a_chain_of_doublings_stays_within_the_budget_at_the_minimum():
    program = written([("conv2d", [0]), ("add", [1, 1]), ("add", [2, 2]), ("add", [3, 3]), ("add", [4, 4]),
                       ("dropout_unused", [5]), ("batch_norm", [4]), ("conv1d", [4])], [0, 7], batch=2, seq=4,
                      dim=8, dtype=torch.float64, seed=0)
    check_program(program, 0.0)


def test_a_slice_of_a_cat_gradient_reaching_a_split_island_is_credited_when_freed():
    """A convolution's result split in its own island (`chunk`), one piece and the whole read by
    `cat`s: the island's incoming gradients are slices of the cats' gradients, which the engine
    frees once used. The inspection copied only dense gradients into its recording, so it
    measured the slices' storages held through the convolution's backward (the CPU allocator
    does not report the free of a block allocated before): predicted 1.224x eager's peak, which
    it measures (fuzz seed 87). Now 1.044x."""
    import copy

    from exactness import DotLoss, eager_peak
    from random_models import make
    from rockmate import Rockmate

    program = written([("conv2d", [0]), ("chunk_mul", [1]), ("identity_view", [2]), ("linear", [3]),
                       ("cat_linear", [4, 1]), ("add", [3, 5]), ("sigmoid", [6]), ("layer_norm_plain", [6])],
                      [0, 8], batch=3, seq=6, dim=8, dtype=torch.float64, seed=1772)
    model, x = make(program)
    with torch.no_grad():
        probe = copy.deepcopy(model)(x)
    eager = eager_peak(model, (x,), DotLoss(probe))
    none = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", cost_model="flops")
    assert none.plan.predicted_peak <= 1.05 * eager
    check_program(program, 1.0, **GRID)


def test_building_leaves_the_models_gradients_alone_over_several_inspection_passes():
    """The inspection sets the user's gradients aside while it runs its backwards; a program
    whose gradient layouts are corrected over three passes of inspection had them back (and
    accumulated into, in place) from the second pass on."""
    from random_models import make
    from rockmate import Rockmate

    program = written([("cat_linear", [0, 0]), ("batch_norm_unused", [1]), ("copy_into", [2]), ("batch_norm", [3]),
                       ("add", [4, 4]), ("add", [5, 2]), ("linear_relu_inplace", [6])], [4], batch=3, seq=6, dim=16,
                      seed=65535)
    model, x = make(program)
    model(x).sum().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    Rockmate(model, x, 10**12, solver="none", cost_model="flops")
    assert len(before) == sum(p.grad is not None for p in model.parameters())
    for a, p in zip(before, [p for p in model.parameters() if p.grad is not None]):
        assert torch.equal(a, p.grad)


def test_the_same_program_is_measured_the_same_in_every_build():
    """The inspection told an alias of a backward's incoming gradient by its storage's address
    alone: where the engine had freed the incoming gradient and the allocator gave its address to
    the new input gradient, a build took that for a pass-through alias (boundary aliases, another
    overhead), and its minimum budget differed (6992 B against 6748 B), refused by the next build
    (the clean-clone CI of the seventeenth session; 1 build in 3 to 10 in one process)."""
    import copy

    from random_models import make
    from rockmate import Rockmate
    from solvers import registry

    program = written([("linear", [0]), ("halves", [1]), ("conv2d", [2]), ("halves", [3])], [4], batch=2,
                      seq=4, dim=8, dtype=torch.float64, seed=2)
    model, x = make(program)
    seen = set()
    for _ in range(12):
        chain = Rockmate(copy.deepcopy(model), x, 10**12, solver="none", cost_model="flops").graphs.model_chain
        seen.add((repr(chain), registry.min_budget(chain, "rockmate")))
    assert len(seen) == 1, sorted(minimum for _, minimum in seen)
    check_program(program, 0.0)


def test_a_gradient_summed_inside_an_island_is_summed_in_place_as_eager():
    """Fuzz seed 207: ``v1 - v1`` after ``silu`` (one island): the sub's backward passes its
    incoming gradient on to ``silu``'s, where the other contribution joins it. Eager's engine adds
    it in place; a sink that had made the gradient's storage a Python object (torch keeps it and
    its reference for the storage's life) left the engine a new sum to make: 4624 B measured
    against eager's 3472 B. Measured at most eager's peak, and bitwise."""
    program = written([("silu", [0]), ("sub", [1, 1]), ("add", [2, 2])], [3], batch=3, seq=6, dim=8,
                      dtype=torch.float64, input_requires_grad=True)
    eager, _, measured = _peaks_without_recomputation(program)
    assert measured <= eager, (measured, eager)
    for fraction in (1.0, 0.5):
        check_program(program, fraction, **GRID)


def test_a_result_and_its_view_returned_with_a_reader_of_the_view():
    """Fuzz seed 231 (failing the same way at the twenty-ninth session's start, with or without
    side inputs, every solver): ``v2 = v1.clone(); v2[:, 0] = v1[:, -1]``, ``v3 =
    v2.view(v2.shape)``, ``v4 = conv(v3.unsqueeze(1)).squeeze(1)``, all three returned.
    Functionalization made the view twice from the written value (one copy returned, one read by
    the conv): the conv's contribution reached ``v2``'s gradient apart from the user's gradient
    of ``v3``, in another order than eager's, and the first linear's weight gradient was not
    bitwise. The copies are one node again (``rkgb.capture._merge_view_copies``)."""
    program = written([("linear", [0]), ("index_assign", [1, 1]), ("identity_view", [2]), ("conv2d", [3])],
                      [2, 3, 4], batch=3, seq=4, dim=16, dtype=torch.float32, input_requires_grad=False, seed=1862)
    for fraction in (1.0, 0.0):
        check_program(program, fraction)
    check_program(program, 1.0, solver="none")


def test_a_view_group_of_the_input_joins_its_gradient_at_the_views_place():
    """Fuzz seed 243: ``v1 = x.clone(); v1[:, 0] = x[:, -1]`` and ``batch_norm(x.transpose(1, 2))``.
    The transpose's group joins the input's gradient at the view's place, before the clone's
    backward, and becomes the gradient there (a transposed view, its base alive: not added into
    in place); the clone's two contributions then make a new sum while all three live. The plan
    counted the group apart to the end and the clone's contributions added in place: measured
    2312 B against a predicted 2112 B."""
    program = written([("index_assign", [0, 0]), ("copy_into", [1]), ("batch_norm", [0]), ("sum_add", [3])],
                      [1, 4], batch=3, seq=4, dim=8, dtype=torch.float32, input_requires_grad=True)
    for fraction in (1.0, 0.5):
        check_program(program, fraction)


def test_a_returned_result_read_in_the_next_block_keeps_the_losss_gradient_layout():
    """Fuzz seed 249 (side inputs, blocks of at most 3 nodes; failing the same at the
    thirty-second session's start): a convolution's output, returned and read by a batch norm
    in the next block, gets the loss's contiguous gradient first and the batch norm's transposed
    one after: the sum is contiguous, and the convolution's backward copies it to its own
    layout. Its block was measured with the batch norm's layout (the next block's backward's
    received layout replaced the whole graph's), its backward 392 B above the plan at 100%."""
    program = written([("transpose_tanh", [0]), ("scale", [1]), ("gate_write", [2]), ("positions_dropout", [3]),
                       ("conv1d", [1]), ("batch_norm", [5])], [2, 5, 6], batch=3, seq=4, dim=8,
                      dtype=torch.float32, input_requires_grad=True)
    check_program(program, 1.0, max_block_nodes=3)


# models that return their own loss ({"loss": ..., "outputs": ...}, as transformers' models called
# with labels): the step's backward from that loss alone, the outputs it reaches counted without a
# gradient from the user (output_gradients="auto"); benchmarks/fuzz.py --loss-inside runs more
@seed(20261129)
@settings(max_examples=12)
@given(program=programs(), fraction=st.sampled_from([0.0, 0.5, 1.0]))
# the model's loss reads the input alone, which the model also returns (a reached input)
@example(written([("chunk_mul", [0])], [0], batch=2, seq=4, dim=8, input_requires_grad=True, seed=1), 0.0)
# an output that the loss does not read nor reach (an odd seed): it counts a gradient all the same
@example(written([("linear", [0]), ("gelu", [1]), ("linear", [0])], [2, 3], batch=2, seq=4, dim=8,
                 input_requires_grad=True, seed=3), 0.5)
# fuzz seed 271: the unread output `v2 = v1 + v1` sums its gradient with v1's, a view of the dot's,
# into a dense tensor that the next contributions are added into in place; a step that gives v2 no
# gradient keeps the view, and they make new sums (776 B above the plan at the minimum before)
@example(written([("expanded_query", [0]), ("add", [1, 1]), ("add", [2, 2])], [1, 2], batch=3, seq=4, dim=8,
                 dtype=torch.float64, input_requires_grad=True, seed=1), 0.0)
# fuzz seed 283: the input returned twice, read by the model's loss and by a softmax through views:
# a view group's first contribution came before another group joined the input's gradient, and the
# plan added it into that group (256 B above the plan at the minimum); each such group apart now
@example(written([("batch_norm_unused", [0]), ("broadcast_mean", [1]), ("reshape_softmax", [1]),
                  ("batch_norm_unused", [0]), ("reshape_softmax", [4])], [0, 3, 4], batch=2, seq=4, dim=8,
                 seed=0), 0.0)
def test_random_models_that_return_their_loss(program, fraction):
    check_program(program, fraction, loss_inside=True, **GRID)


# steps that keep the model's loss alone (held_outputs="loss", transformers' Trainer): the plan frees
# the last block's outputs where it no longer needs them; eager's step and the compiled one drop them
@seed(20261130)
@settings(max_examples=8)
@given(program=programs(), fraction=st.sampled_from([0.0, 0.5, 1.0]))
def test_random_models_whose_step_keeps_the_loss_alone(program, fraction):
    check_program(program, fraction, loss_inside=True, held_outputs="loss", **GRID)


def test_a_returned_input_read_by_the_models_loss_through_views():
    """Fuzz seed 277: a returned input that the model's loss reads gets no gradient from that loss,
    but the plan's first-run figures counted one, a dense sum that the next contribution was taken
    to add into in place, where the step's gradient is a reshape's view group and the contribution
    makes a new sum (1196 B above the plan at the minimum). Counting only the loss's gradients
    needs the view groups open together to be counted apart (fuzz seed 283, the regression example
    of ``test_random_models_that_return_their_loss``)."""
    program = written([("broadcast_mean", [0]), ("straight_through", [1]), ("broadcast_mean", [2]),
                       ("broadcast_mean", [3]), ("broadcast_mean", [3])], [0, 2], batch=3, seq=6, dim=16,
                      dtype=torch.float32, seed=2994)
    check_program(program, 0.0, loss_inside=True, held_outputs="loss", **GRID)


def test_identical_blocks_whose_inputs_come_in_other_layouts_are_classes_of_their_own():
    """Fuzz seed 295: two identical linears (blocks of one class), the first reading a CPU batch
    norm's result in its transposed layout, the second the first's contiguous result. The first's
    reshape of its input is a copy, saved as its own phantom; the second's a view of its input,
    whose data its backward needs. Measured on the first alone, the class's plan forgot the
    second's input after its forward, and the step's backward failed
    (``PhantomFreedError: the backward of 'linear_1' needs the data of 'linear'``), at every
    budget, the plan without recomputation included."""
    program = written([("batch_norm", [0]), ("grad_reverse", [1]), ("index_assign", [2, 1]), ("linear", [2]),
                       ("linear_relu_inplace", [4]), ("broadcast_mean", [5])], [5, 6], batch=3, seq=4, dim=16,
                      dtype=torch.float64, seed=80)
    from random_models import make
    from rockmate import Rockmate

    model, x = make(program)
    compiled = Rockmate(model, x, 10**12, solver="none", cost_model="flops")
    linears = [block for block in compiled.graphs.chain.blocks if block.nodes in (["linear"], ["linear_1"])]
    assert len(linears) == 2 and linears[0].class_index != linears[1].class_index
    for fraction in (1.0, 0.0):
        check_program(program, fraction, **GRID)
    # twice over: the inspection does not run the last pair (it synthesizes the inputs of the
    # last classes), whose second linear's input layout is that of its producer's class
    twice = written([("batch_norm", [0]), ("grad_reverse", [1]), ("linear", [2]), ("linear", [3]),
                     ("batch_norm", [4]), ("grad_reverse", [5]), ("linear", [6]), ("linear", [7])], [8], batch=3,
                    seq=4, dim=16, dtype=torch.float64, seed=80)
    check_program(twice, 0.0, **GRID)
