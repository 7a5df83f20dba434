"""Layer 4: the ragged KV cache. Draft round-trips (read as nodes, committed in part), batch rows equal single rows."""

import torch

from conftest import tiny_model
from verispec.models.runners.hf import ModelRunner


def chain(n):
    """The parents of n draft nodes in a chain."""
    return list(range(-1, n - 1))


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # (T, V)


def test_incremental_logits_equal_a_full_pass():
    model = tiny_model("llama")
    runner = ModelRunner(model)
    ids = [3, 9, 27, 17, 51, 25, 11, 33]
    state = runner.new_state(1)
    a = runner.forward(state, [ids[:5]], [5])[0]
    b = runner.forward(state, [ids[5:]], [3])[0]
    torch.testing.assert_close(torch.cat([a, b]), full_logits(model, ids), atol=1e-5, rtol=1e-5)


def test_rejected_drafts_round_trip():
    model = tiny_model("qwen2")
    runner = ModelRunner(model)
    ids = [3, 9, 27, 17, 51]
    state = runner.new_state(1)
    runner.forward(state, [ids], [1])
    before = state.cache.get_seq_length()
    runner.forward(state, [[40, 41, 42, 43]], [4], [chain(4)])  # drafts that will be rejected
    runner.commit(state, [[]])
    assert state.cache.get_seq_length() == before and int(state.lengths[0]) == 5
    after = runner.forward(state, [[7, 8]], [2])[0]
    torch.testing.assert_close(after, full_logits(model, ids + [7, 8])[-2:], atol=1e-5, rtol=1e-5)


def test_partial_commit_keeps_accepted_prefix():
    model = tiny_model("llama")
    runner = ModelRunner(model)
    state = runner.new_state(1)
    runner.forward(state, [[1, 2, 3]], [1])
    runner.forward(state, [[4, 5, 6, 7]], [4], [chain(4)])
    runner.commit(state, [[0, 1]])  # keep 4, 5
    out = runner.forward(state, [[8]], [1])[0]
    torch.testing.assert_close(out, full_logits(model, [1, 2, 3, 4, 5, 8])[-1:], atol=1e-5, rtol=1e-5)


def test_ragged_batch_rows_equal_single_rows_through_commits():
    model = tiny_model("qwen2")
    runner = ModelRunner(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    state = runner.new_state(3)
    runner.forward(state, prompts, [1, 1, 1])
    runner.forward(state, [[20, 21, 22], [23], [24, 25]], [3, 1, 2], [chain(3), chain(1), chain(2)])
    runner.commit(state, [[0], [0], [0]])  # rows keep [20], [23], [24]
    out = runner.forward(state, [[30], [31, 32], []], [1, 2, 0])
    expected = [prompts[0] + [20, 30], prompts[1] + [23, 31, 32]]
    torch.testing.assert_close(out[0, :1], full_logits(model, expected[0])[-1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :2], full_logits(model, expected[1])[-2:], atol=1e-5, rtol=1e-5)
    # Row 2 waited: its next token still sees exactly its own history.
    out = runner.forward(state, [[], [], [40]], [0, 0, 1])
    torch.testing.assert_close(out[2, :1], full_logits(model, prompts[2] + [24, 40])[-1:], atol=1e-5, rtol=1e-5)
    assert state.lengths.tolist() == [9, 5, 6]


def test_select_rows_drops_finished_sequences():
    model = tiny_model("llama")
    runner = ModelRunner(model)
    state = runner.new_state(2)
    runner.forward(state, [[1, 2, 3], [4, 5]], [1, 1])
    state.select(torch.tensor([1]))
    out = runner.forward(state, [[6]], [1])[0]
    torch.testing.assert_close(out, full_logits(model, [4, 5, 6])[-1:], atol=1e-5, rtol=1e-5)


def test_a_sliding_window_model_rolls_back_past_its_window():
    """Gemma 3's sliding-window layers (a window of 4 here) through drafts cut after the window was passed: each pass
    equals a full pass over the committed tokens (the model's own sliding-window mask). One row per cache: in a
    ragged batch the window is counted in cache columns, which a shorter row's holes make longer than its positions
    (a draft's guesses change there, not a target's tokens: run a sliding-window target one sequence at a time)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)
    model = Gemma3ForCausalLM(config).eval()
    runner = ModelRunner(model)
    for b, row in enumerate([[3, 9, 27, 17, 5, 25, 11, 30, 1], [4, 8, 15]]):
        state = runner.new_state(1)
        runner.forward(state, [row], [1])
        for step in range(4):
            draft = [(7 * step + b) % 32, (5 * step + 3) % 32, 2]
            out = runner.forward(state, [draft], [3], [chain(3)])[0]
            torch.testing.assert_close(out, full_logits(model, row + draft)[-3:], atol=1e-4, rtol=1e-4)
            keep = list(range((step + b) % 3))
            runner.commit(state, [keep])
            row = row + [draft[i] for i in keep]
