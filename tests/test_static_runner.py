"""The static-cache runner (`models/runners/static.py`, the GPU decode path, run here on the CPU): its logits equal
`ModelRunner`'s through ragged passes, dropped drafts, rows leaving and joining, trees and compaction; dropping drafts only
moves the cache's length; decoding with it gives plain decoding's tokens; and the compiled passes equal the eager
ones (logits to float tolerance, greedy tokens exactly)."""

import pytest
import torch

from conftest import chain, forward_tree, noisy_copy, tiny_model
from drafting import drafts_accepted
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner
from verispec.models.runners.static import StaticRunner

TOL = dict(atol=1e-5, rtol=1e-5)
GREEDY = SamplingConfig(temperature=0)


def both(model, capacity=256, compile=False):
    return ModelRunner(model), StaticRunner(model, capacity=capacity, compile=compile)


def length(state) -> int:
    return int(state.cache.layers[0].cumulative_length)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ragged_passes_and_dropped_drafts_give_the_dynamic_runners_logits(arch):
    model = tiny_model(arch, seed=1)
    dynamic, static = both(model)
    states = dynamic.new_state(3), static.new_state(3)
    # (tokens, logits wanted, None: committed, or how many of each row's tokens to keep: they are read as drafts)
    calls = [([[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]], [1, 2, 1], None),
             ([[20, 21, 22], [23], [24, 25]], [3, 1, 2], [1, 1, 1]),
             ([[30], [31, 32], []], [1, 2, 0], [0, 0, 0]),
             ([[40, 41, 42, 43, 44], [45], [46]], [5, 1, 1], None)]
    for tokens, wanted, keep in calls:
        parents = None if keep is None else [chain(len(row)) for row in tokens]
        a = dynamic.forward(states[0], tokens, wanted, parents)
        b = static.forward(states[1], tokens, wanted, parents)
        for row, n in enumerate(wanted):
            torch.testing.assert_close(b[row, :n], a[row, :n], **TOL)
        if keep is not None:
            dynamic.commit(states[0], [list(range(k)) for k in keep])
            static.commit(states[1], [list(range(k)) for k in keep])
    assert torch.equal(states[0].lengths, states[1].lengths)
    assert length(states[1]) == states[1].valid.shape[1]  # the write position follows the live columns


def test_dropping_drafts_moves_the_length_and_keeps_the_buffers():
    _, static = both(tiny_model("qwen2"))
    state = static.new_state(1)
    static.forward(state, [[3, 9, 27, 17, 51]], [1])  # 5 tokens at width 8: 3 holes after them
    keys = state.cache.layers[0].keys
    assert length(state) == 8 and keys.shape[2] == 256
    static.forward(state, [[40, 41, 42]], [3], [chain(3)])
    static.commit(state, [[]])
    assert length(state) == 5 and state.cache.layers[0].keys is keys  # nothing copied or freed


def test_rows_leaving_and_joining_and_compaction_keep_each_rows_logits():
    model = tiny_model("llama", seed=2)
    dynamic, static = both(model, capacity=64)
    states = dynamic.new_state(2), static.new_state(2)
    for runner, state in zip((dynamic, static), states):
        runner.forward(state, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11]], [1, 1])
        state.select(torch.tensor([1]))  # the first row leaves
        state.extend(1)  # another joins
    outs = []
    for runner, state in zip((dynamic, static), states):
        out = runner.forward(state, [[12, 13], [14, 15, 16]], [2, 3])
        for _ in range(12):  # passes of width 4 whose drafts are dropped: holes pile up until compaction is forced
            runner.forward(state, [[17, 18, 19], [20, 21, 22]], [3, 3], [chain(3), chain(3)])
            runner.commit(state, [[], []])
        outs.append((out, runner.forward(state, [[23], [24]], [1, 1])))
    torch.testing.assert_close(outs[1][0][0, :2], outs[0][0][0, :2], **TOL)
    torch.testing.assert_close(outs[1][0][1, :3], outs[0][0][1, :3], **TOL)
    torch.testing.assert_close(outs[1][1], outs[0][1], **TOL)
    assert length(states[1]) <= 64


def test_a_pass_past_the_capacity_is_one_clear_line():
    _, static = both(tiny_model("llama"), capacity=64)
    state = static.new_state(1)
    static.forward(state, [list(range(1, 63))], [1])  # 62 live columns, 2 holes
    with pytest.raises(VerispecError, match="static cache holds 64 columns per row and this pass needs 66"):
        static.forward(state, [[1, 2, 3]], [1])


def test_tree_passes_give_the_dynamic_runners_logits():
    model = tiny_model("qwen2", seed=3)
    dynamic, static = both(model)
    outs = []
    for runner in (dynamic, static):
        state = runner.new_state(2)
        runner.forward(state, [[1, 2, 3, 4], [5, 6]], [1, 1])
        a = forward_tree(runner, state, [[7], [8]], [[9, 10, 11], [12, 13]], [[-1, -1, 0], [-1, 0]])
        runner.commit(state, [[0, 2], [0]])
        b = runner.forward(state, [[14], [15]], [1, 1])
        outs.append((a, b))
    torch.testing.assert_close(outs[1][0], outs[0][0], **TOL)
    torch.testing.assert_close(outs[1][1], outs[0][1], **TOL)


def decode_sequences(target, draft, tree=None):
    engine = SpeculativeEngine(target, DraftModelDrafter(draft, 64) if draft is not None else None, set())
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=24, stop_at_eos=False, tree=tree)
    return engine.generate([[1, 2, 3, 4, 5, 6], [7, 8, 9]], GREEDY, spec)


def decode(target, draft, tree=None):
    return [s.generated for s in decode_sequences(target, draft, tree)]


@pytest.mark.parametrize("tree", [None, TreeConfig(shape=(2, 2, 1))], ids=["chain", "tree"])
def test_speculative_decoding_on_static_runners_gives_plain_decodings_tokens(tree):
    target = tiny_model("llama", seed=4, sharpness=4.0)
    draft = noisy_copy(target, 0.5)
    plain = decode(StaticRunner(target, 256, compile=False), None)  # the same runner, plainly
    assert plain == decode(ModelRunner(target), None)
    seqs = decode_sequences(StaticRunner(target, 256, compile=False), StaticRunner(draft, 256, compile=False), tree)
    assert [s.generated for s in seqs] == plain
    drafts_accepted(seqs)


def test_compiled_passes_equal_the_eager_ones():
    target = tiny_model("qwen2", seed=5, sharpness=4.0)
    eager, compiled = StaticRunner(target, 128, compile=False), StaticRunner(target, 128, compile=True)
    outs = []
    for runner in (eager, compiled):
        state = runner.new_state(2)
        a = runner.forward(state, [[1, 2, 3, 4, 5], [6, 7]], [1, 2])
        b = runner.forward(state, [[8, 9, 10], [11]], [3, 1], [chain(3), chain(1)])
        runner.commit(state, [[0], [0]])
        c = runner.forward(state, [[12], [13, 14, 15]], [1, 3])
        outs.append(torch.cat([a[:, :1], b[:, :1], c[:, :1]], 1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # compiled, not run eagerly
    plain = decode(ModelRunner(target), None)
    assert decode(compiled, None) == plain


def test_one_graph_per_batch_size_and_width():
    """The cache is allocated with the state: a width compiles once, whether or not it is a request's first pass, and
    a second request compiles nothing (a graph traced on a cache whose layers were not yet initialized used to be
    traced again for the same width once they were)."""
    runner = StaticRunner(tiny_model("llama", seed=6), 128, compile=True)
    counters = torch._dynamo.utils.counters["stats"]

    def one_request():
        state = runner.new_state(1)
        runner.forward(state, [[1, 2, 3]], [1])  # the prompt: width 4, compiled
        runner.forward(state, [[4, 5, 6]], [3])  # width 4 again, on a cache that now holds tokens
        runner.forward(state, [[7]], [1], [chain(1)])  # width 1, a draft dropped again
        runner.commit(state, [[]])

    before = counters["unique_graphs"]
    one_request()
    assert counters["unique_graphs"] - before == 2
    one_request()
    assert counters["unique_graphs"] - before == 2


def test_an_unknown_compile_backend_is_one_clear_line():
    with pytest.raises(VerispecError, match="unknown compile backend 'tensorrt'"):
        StaticRunner(tiny_model("llama"), 128, backend="tensorrt")
