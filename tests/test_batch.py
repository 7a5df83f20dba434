"""Continuous batching: sequences joining and leaving a running DecodeBatch decode exactly as they
would alone, and the caches shrink back when they leave."""

import copy

import pytest
import torch

from conftest import tiny_model
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import DecodeBatch, SpeculativeEngine
from verispec.models.loading import LoadedModel
from verispec.models.runners.quantized import quantize_linear_layers
from verispec.models.runners.rowwise import RowwiseRunner
from verispec.models.runners.hf import ModelRunner

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3], [20, 21, 22, 20, 21]]
SEEDS = [11, 12, 13, 14]


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # (T, V)


def test_rows_added_to_a_running_state_equal_single_rows():
    model = tiny_model("llama")
    runner = ModelRunner(model)
    state = runner.new_state(1)
    runner.forward(state, [[5, 6, 7, 8]], [1])
    runner.forward(state, [[9, 10, 11]], [3], [[-1, 0, 1]])  # three drafts
    runner.commit(state, [[0]])  # row 0 holds 5 6 7 8 9
    state.extend(2)
    out = runner.forward(state, [[12], [30, 31, 32], [40]], [1, 3, 1])
    torch.testing.assert_close(out[0, :1], full_logits(model, [5, 6, 7, 8, 9, 12])[-1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :3], full_logits(model, [30, 31, 32]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2, :1], full_logits(model, [40]), atol=1e-5, rtol=1e-5)


def test_dropping_rows_removes_their_columns_and_keeps_the_others_exact():
    model = tiny_model("qwen2")
    runner = ModelRunner(model)
    state = runner.new_state(2)
    runner.forward(state, [[1, 2, 3, 4, 5, 6, 7, 8], [9]], [1, 1])  # row 1 leaves holes in columns 1..7
    runner.forward(state, [[10], [11, 12]], [1, 2])
    state.select(torch.tensor([1]))
    assert state.valid.shape[1] == int(state.lengths[0]) == 3  # only row 1's columns are left
    assert state.cache.get_seq_length() == 3
    out = runner.forward(state, [[13]], [1])
    torch.testing.assert_close(out[0], full_logits(model, [9, 11, 12, 13])[-1:], atol=1e-5, rtol=1e-5)


def make_engine(kind, greedy_pair):
    target, draft = greedy_pair
    if kind == "int8-draft":  # the runner an int8 draft gets when loaded: row by row
        int8 = copy.deepcopy(draft)
        assert quantize_linear_layers(int8) > 0
        runner = LoadedModel("int8 draft", int8, None, "", weights="int8").make_runner()
        assert isinstance(runner, RowwiseRunner)
        return SpeculativeEngine(ModelRunner(target), DraftModelDrafter(runner, 64), set())
    drafter = DraftModelDrafter(ModelRunner(draft), 64) if kind == "draft-model" else PromptLookupDrafter()
    return SpeculativeEngine(ModelRunner(target), drafter, set())


@pytest.mark.parametrize("kind", ["draft-model", "int8-draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sequences_joining_at_different_steps_equal_each_alone(greedy_pair, kind, temperature):
    """Seeded sampling too: a sequence's tokens never depend on the batch it shares. (An int8 draft rounds its
    activations to bfloat16, which turns a batched pass's last-bit differences into a different q, hence
    different draws, unless it runs row by row; see the next test.)"""
    engine = make_engine(kind, greedy_pair)
    sampling = SamplingConfig(temperature=temperature, top_k=20)
    specs = [SpecConfig(num_draft_tokens=k, max_new_tokens=n) for k, n in [(3, 20), (1, 12), (5, 25), (2, 16)]]
    drafting = [True, True, True, False]  # a plainly decoded sequence may share a speculative batch

    def sequence(i):
        seq = engine.make_sequences([PROMPTS[i]], sampling, specs[i], [SEEDS[i]])[0]
        seq.drafting = drafting[i]
        return seq

    alone = []
    for i in range(4):
        single = DecodeBatch(engine)
        single.add([sequence(i)])
        while single:
            (_, seq), = engine.step(single)
        alone.append(seq.generated)
    assert alone[0] == engine.generate([PROMPTS[0]], sampling, specs[0], seeds=[SEEDS[0]])[0].generated
    batch = DecodeBatch(engine)
    joining = [sequence(i) for i in range(4)]
    batch.add(joining[:1])
    for step in range(200):
        if step == 2:
            batch.add(joining[1:3])
        if step == 6:
            batch.add(joining[3:])
        engine.step(batch)
        if not batch and step > 6:
            break
    assert [s.generated for s in joining] == alone
    assert all(s.finish_reason == "length" for s in joining)
    assert joining[3].stats.draft_tokens == 0 and joining[0].stats.draft_tokens > 0


def test_cancel_frees_the_rows_at_once_and_the_rest_continue(greedy_pair):
    engine = make_engine("draft-model", greedy_pair)
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=30)
    alone = engine.generate([PROMPTS[1]], SamplingConfig(temperature=0), spec)[0].generated
    batch = DecodeBatch(engine)
    seqs = engine.make_sequences(PROMPTS[:3], SamplingConfig(temperature=0), spec, None)
    batch.add(seqs)
    engine.step(batch)
    batch.cancel(seqs[0])
    assert seqs[0].finish_reason == "cancelled"
    assert batch.state.batch_size == 2 and engine.drafter.state.batch_size == 2 and len(engine.drafter.cached) == 2
    while batch:
        engine.step(batch)
    assert seqs[1].generated == alone
    assert batch.state is None and engine.drafter.state.batch_size == 0
    assert engine.drafter.state.valid.shape[1] == 0  # the draft cache holds nothing after the batch


def test_cache_stays_bounded_while_sequences_come_and_go(greedy_pair):
    engine = make_engine("draft-model", greedy_pair)
    spec = SpecConfig(num_draft_tokens=2, max_new_tokens=6)
    batch = DecodeBatch(engine)
    widest = 0
    for step in range(60):  # a new sequence every other step: the batch is never empty
        if step % 2 == 0 and step < 50:
            batch.add(engine.make_sequences([PROMPTS[step % 4]], SamplingConfig(temperature=0), spec, None))
        engine.step(batch)
        if batch:
            widest = max(widest, batch.state.valid.shape[1])
    assert not batch
    longest_life = max(len(p) for p in PROMPTS) + spec.max_new_tokens * (spec.num_draft_tokens + 1)
    assert widest <= 4 * longest_life  # without compaction the cache would grow with every step



def test_row_by_row_runner_gives_each_row_bit_for_bit_what_it_gives_alone():
    """RowwiseRunner (what int8 drafts run on): a row's logits never depend on the rows beside it, through
    chain and tree passes and commits. (The batched ModelRunner fails this by ~4e-8 here: padding
    a short row to a long one changes attention's float sums; an int8 draft's bfloat16 activations magnify
    such bits into a different q, and seeded requests then drew other tokens when batched.)"""
    runner = RowwiseRunner(ModelRunner(tiny_model("llama", vocab=64, seed=0)))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (100, 3, 17)]

    def run(indices):
        state = runner.new_state(len(indices))
        outs = [runner.forward(state, [rows[i] for i in indices], [1] * len(indices))]
        outs.append(runner.forward(state, [[5, 6, 7] for _ in indices], [3] * len(indices),
                                   [[-1, 0, 1] for _ in indices]))  # a chain of drafts
        runner.commit(state, [[0] for _ in indices])
        outs.append(runner.forward(state, [[8, 9, 10] for _ in indices], [3] * len(indices),
                                   [[-1, -1, 0] for _ in indices]))  # a tree
        runner.commit(state, [[0, 2] for _ in indices])
        outs.append(runner.forward(state, [[11] for _ in indices], [1] * len(indices)))
        return outs

    together = run([0, 1, 2])
    for i in range(3):
        alone = run([i])
        for t, a in zip(together, alone):
            assert torch.equal(t[i], a[0])


def test_the_engines_loop_admits_between_steps_and_hands_a_stray_fault_on(greedy_pair, monkeypatch):
    """`SpeculativeEngine.run`, the loop every front end drives: rows joining between steps (`between`) decode as they
    would alone; the loop ends when `between` says so; a fault that escapes the step's own guards goes to `on_fault`
    and the loop goes on, and without `on_fault` it is raised."""
    engine = make_engine("draft-model", greedy_pair)
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=12)
    alone = [engine.generate([p], SamplingConfig(temperature=0), spec)[0].generated for p in PROMPTS]
    queue, turns = list(PROMPTS), []

    def between(batch):
        turns.append(len(batch))
        if queue and len(turns) % 2:  # a new row every other turn
            batch.add(engine.make_sequences([queue.pop(0)], SamplingConfig(temperature=0), spec, None))
        return bool(queue or batch)

    done = {}
    batch = DecodeBatch(engine)
    for results in engine.run(batch, between):
        done.update((id(s), s) for _, s in results if s.finish_reason is not None)
    assert sorted(s.generated for s in done.values()) == sorted(alone)
    assert turns[0] == 0 and max(turns) >= 2 and not batch  # rows joined a running batch

    step, faults = engine.step, []

    def broken_once(batch):
        monkeypatch.setattr(engine, "step", step)  # the next step runs as usual
        raise RuntimeError("a bug outside the step's guards")

    batch.add(engine.make_sequences([PROMPTS[0]], SamplingConfig(temperature=0), spec, None))
    monkeypatch.setattr(engine, "step", broken_once)
    steps = list(engine.run(batch, on_fault=faults.append))
    assert [str(f) for f in faults] == ["a bug outside the step's guards"] and steps and not batch
    batch.add(engine.make_sequences([PROMPTS[0]], SamplingConfig(temperature=0), spec, None))
    monkeypatch.setattr(engine, "step", broken_once)
    with pytest.raises(RuntimeError, match="outside the step's guards"):
        next(engine.run(batch))
