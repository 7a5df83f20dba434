"""Tree passes through the runner: one pass over a tree gives each root-to-leaf chain's logits, and
compaction leaves the cache a plain decoding of the accepted path would have."""

import pytest
import torch

from conftest import forward_tree, tiny_model
from verispec.models.runners.packed import pack_linear_layers
from verispec.models.runners.hf import ModelRunner
from verispec.tree import static_parents, tree_from_parents


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # (T, V)


def check_tree_logits(model, prefix, tokens, parents, logits):
    """logits: (N + 1, V) from a tree pass whose root is prefix[-1]."""
    torch.testing.assert_close(logits[0], full_logits(model, prefix)[-1], atol=1e-5, rtol=1e-5)
    tree = tree_from_parents(tuple(parents))
    for i in range(len(tokens)):
        path = [tokens[j] for j in tree.path_to(i)]
        torch.testing.assert_close(logits[i + 1], full_logits(model, prefix + path)[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,attention", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_one_tree_pass_equals_a_chain_pass_per_path(arch, attention):
    model = tiny_model(arch)
    model.set_attn_implementation(attention)
    runner = ModelRunner(model)
    state = runner.new_state(1)
    prompt = [3, 9, 27, 17, 51]
    runner.forward(state, [prompt[:3]], [1])
    parents = list(static_parents((3, 2, 1)))
    tokens = [(7 * i + 5) % 64 for i in range(len(parents))]
    logits = forward_tree(runner, state, [prompt[3:]], [tokens], [parents])[0]
    check_tree_logits(model, prompt, tokens, parents, logits[: len(tokens) + 1])
    assert state.lengths.tolist() == [5]  # tree entries are not committed


def test_tree_pass_through_packed_linears():
    model = tiny_model("qwen2")
    reference = tiny_model("qwen2")
    if pack_linear_layers(model) == 0:
        pytest.skip("oneDNN packing is not available here")
    runner = ModelRunner(model)
    state = runner.new_state(1)
    parents = [-1, -1, 0, 0, 1, 2]
    tokens = [4, 8, 15, 16, 23, 42]
    logits = forward_tree(runner, state, [[1, 2, 3]], [tokens], [parents])[0]
    check_tree_logits(reference, [1, 2, 3], tokens, parents, logits[:7])


def test_tree_pass_through_int8_draft_linears():
    """The int8 draft path only replaces linears: a tree pass equals that model's own chain passes."""
    from verispec.models.runners.quantized import int8_supported, quantize_linear_layers

    if not int8_supported():
        pytest.skip("int8 linears are not available here")
    model = tiny_model("llama")
    quantize_linear_layers(model)
    runner = ModelRunner(model)
    state = runner.new_state(1)
    parents = [-1, -1, 0, 1, 1]
    tokens = [4, 8, 15, 16, 23]
    logits = forward_tree(runner, state, [[1, 2, 3]], [tokens], [parents])[0]
    check_tree_logits(model, [1, 2, 3], tokens, parents, logits[:6])


def test_tree_grown_over_several_passes_and_ragged_rows():
    """Like a draft model: depth by depth, the earlier levels already in the cache, rows of different lengths."""
    model = tiny_model("llama")
    runner = ModelRunner(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    state = runner.new_state(2)
    runner.forward(state, prompts, [1, 1])
    # pass 1: level 1 (row 0: two nodes, row 1: one node); pass 2: children of some of them
    first = forward_tree(runner, state, [[], []], [[20, 21], [22]], [[-1, -1], [-1]])
    second = forward_tree(runner, state, [[], []], [[30, 31, 32], [33]], [[0, 1, 1], [0]])
    expect = {  # (row, logits row) -> path after the prompt
        (0, first, 0): [20], (0, first, 1): [21], (1, first, 0): [22],
        (0, second, 0): [20, 30], (0, second, 1): [21, 31], (0, second, 2): [21, 32], (1, second, 0): [22, 33],
    }
    for (b, out, j), path in expect.items():
        torch.testing.assert_close(out[b, j], full_logits(model, prompts[b] + path)[-1], atol=1e-5, rtol=1e-5)


def test_compaction_leaves_the_cache_of_the_accepted_path():
    model = tiny_model("qwen2")
    runner = ModelRunner(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16]]
    state = runner.new_state(3)
    runner.forward(state, [p[:-1] for p in prompts], [1, 1, 1])
    parents = [[-1, -1, 0, 1, 1, 4], [-1, 0], []]
    tokens = [[20, 21, 22, 23, 24, 25], [26, 27], []]
    forward_tree(runner, state, [[p[-1]] for p in prompts], tokens, parents)
    accepted = [[1, 4, 5], [0], []]  # row 0 keeps 21 -> 24 -> 25, row 1 keeps 26, row 2 had no tree
    runner.commit(state, accepted)
    paths = [[tokens[b][i] for i in accepted[b]] for b in range(3)]
    assert state.lengths.tolist() == [len(p) + len(a) for p, a in zip(prompts, paths)]
    assert not state.speculative
    assert int(state.valid.sum(1)[0]) == len(prompts[0]) + 3
    # The cache now answers exactly like a plain decoding of prompt + path.
    out = runner.forward(state, [[40], [41, 42], [43]], [1, 2, 1])
    for b, new in enumerate([[40], [41, 42], [43]]):
        full = full_logits(model, prompts[b] + paths[b] + new)[-len(new):]
        torch.testing.assert_close(out[b, : len(new)], full, atol=1e-5, rtol=1e-5)
    # and the keys/values of the kept entries equal a direct decoding's, column for column
    direct = runner.new_state(1)
    runner.forward(direct, [prompts[0] + paths[0] + [40]], [1])
    live = state.valid[0].nonzero().squeeze(1)
    for mine, ref in zip(state.cache.layers, direct.cache.layers):
        torch.testing.assert_close(mine.keys[0, :, live], ref.keys[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values[0, :, live], ref.values[0], atol=1e-5, rtol=1e-5)


def test_single_chain_tree_gives_the_chain_pass_bit_for_bit():
    model = tiny_model("qwen2")
    runner = ModelRunner(model)
    a, b = runner.new_state(1), runner.new_state(1)
    chain = runner.forward(a, [[1, 2, 3, 4, 5, 6]], [4])[0]
    tree = forward_tree(runner, b, [[1, 2, 3]], [[4, 5, 6]], [[-1, 0, 1]])[0]
    assert torch.equal(chain, tree)


def test_bad_tree_calls_are_refused():
    runner = ModelRunner(tiny_model("llama"))
    state = runner.new_state(1)
    with pytest.raises(ValueError, match="parent"):
        forward_tree(runner, state, [[1, 2]], [[3, 4]], [[-1, 5]])
    assert not state.speculative and state.valid.shape[1] == 0  # a refused call leaves the state as it was
    forward_tree(runner, state, [[1, 2]], [[3, 4]], [[-1, -1]])
    with pytest.raises(ValueError, match="commit first"):
        runner.forward(state, [[5]], [1])
    with pytest.raises(ValueError, match="not a path"):
        runner.commit(state, [[0, 1]])
    runner.commit(state, [[1]])
    assert state.lengths.tolist() == [3]
