"""Online adaptation of draft heads (`--adapt` with `--draft medusa` / `eagle`, `drafters.head_adapt`): the logged
windows hold the target's own features and tokens at their positions (chains and trees), adapting raises
acceptance while greedy output stays plain decoding's, the target's distribution is unchanged with updates
between steps (chi-square, chains and trees), and the CLI wiring."""

import json

import pytest
import torch

from test_eagle import AUX, PROMPTS, pair, plain, random_head  # noqa: F401 - fixtures
from test_medusa import random_heads, second_token_distribution, small  # noqa: F401 - a fixture
from verispec.adapt import ExampleBuffer, OnlineAdapter
from verispec.chisquare import chi_square_test
from verispec.config import AdaptConfig, SamplingConfig, SpecConfig, TreeConfig
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.head_adapt import MIN_WINDOW, FeatureLog
from verispec.drafters.medusa import MedusaDrafter
from verispec.engine import DecodeBatch, SpeculativeEngine
from verispec.models.heads.medusa import MedusaHeads
from verispec.models.runners.hf import ModelRunner

GREEDY = SamplingConfig(temperature=0)


def test_a_feature_log_cuts_windows_with_context_and_starts_again_after_a_gap():
    out = ExampleBuffer(100)
    log = FeatureLog(window=4, context=2)
    tokens = list(range(100, 130))
    features = torch.arange(30.0)[:, None]  # position t's feature is t

    def step(end, n, finished=False):  # the sequence holds tokens[:end]; the target read n positions
        log.add(tokens[:end], 5, features[end - 1 - n : end - 1], finished, out)

    step(6, 5)  # a prompt of 5 tokens read, one token committed: the prompt's last position is the first labelled
    assert (log.start, log.count, log.labelled) == (2, 3, 1)  # two prompt positions kept as context
    step(8, 2)
    assert not out.drain()
    step(10, 2)
    (w,) = out.drain()
    assert (w.position, w.labelled, w.tokens.tolist(), w.features[:, 0].tolist()) == (2, 2, tokens[2:9], [2, 3, 4, 5, 6, 7])
    assert (log.start, log.count, log.labelled) == (6, 3, 1)  # context 6, 7; position 8 not learned from yet
    step(20, 3)  # positions 16-18: the log ends at 8, so it starts again (the one labelled position is too few)
    assert not out.drain() and (log.start, log.labelled) == (16, 3)
    log.add(tokens[:25], 5, features[19:24], False, out)
    windows = [(w.position, w.labelled, w.tokens.tolist()) for w in out.drain()]
    assert windows == [(16, 0, tokens[16:21]), (18, 2, tokens[18:25])]
    step(27, 4, finished=True)  # the last step read 4 positions but the sequence kept only 2 tokens after them
    assert (log.start, log.count, log.labelled, log.tokens) == (22, 4, 2, tokens[22:27])
    log.flush(out)
    assert not out.drain() and log.count == 0  # too few to learn from


def expected_features(kind, model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model.model(torch.tensor([tokens]), output_hidden_states=True)
    if kind == "eagle":
        return torch.cat([out.hidden_states[i][0] for i in AUX], -1)  # (T, 3E) the states entering the layers
    return out.last_hidden_state[0]  # (T, E)


def drafter_for(kind, model, runner, **kw):
    if kind == "eagle":
        return EagleDrafter(runner, random_head(model, scale=0.05), **kw)
    return MedusaDrafter(runner, random_heads(model))


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("tree", [None, TreeConfig(shape=(2, 2, 1))], ids=["chain", "tree"])
def test_logged_windows_hold_the_targets_features_at_their_positions(pair, kind, tree):
    model, _ = pair
    runner = ModelRunner(model)
    drafter = drafter_for(kind, model, runner)
    engine = SpeculativeEngine(runner, drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, head_window=16))
    seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree))
    windows = adapter.buffer.drain()
    assert len(windows) >= 4 and adapter.buffer.collected == len(windows)
    covered = 0
    for w in windows:
        T = w.features.shape[0]
        seq = next(s for s in seqs if s.tokens[w.position : w.position + T + 1] == w.tokens.tolist())
        want = expected_features(kind, model, seq.tokens)[w.position : w.position + T]
        torch.testing.assert_close(w.features.float(), want, rtol=1e-2, atol=1e-2)  # logged in float16
        assert w.position + w.labelled >= len(seq.tokens) - len(seq.generated) - 1  # never a prompt token's label
        covered += T - w.labelled
    # every position whose next token the target chose is learned from once, but for a leftover under MIN_WINDOW
    read = [len(s.generated) for s in seqs]
    assert covered == sum(16 * (n // 16) + (n % 16 if n % 16 >= MIN_WINDOW else 0) for n in read)
    if kind == "eagle":  # windows after the first carry the 16 positions before as context
        assert all(w.labelled == 16 for w in windows if w.position > 16)


def acceptance(seqs) -> float:
    return sum(s.stats.accepted_tokens for s in seqs) / max(1, sum(s.stats.draft_tokens for s in seqs))


def adapting_raises_acceptance(target_runner, drafter, config, rounds=6, tree=None):
    """Decode the same prompts `rounds` times, updating between rounds: greedy output stays plain decoding's and
    acceptance rises. Returns the rates."""
    engine = SpeculativeEngine(target_runner, drafter, set())
    adapter = OnlineAdapter(engine, config)
    want = plain(target_runner, tokens=40)
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=40, stop_at_eos=False, tree=tree)
    rates = []
    for _ in range(rounds):
        seqs = engine.generate(PROMPTS, GREEDY, spec)
        assert [s.generated for s in seqs] == want
        rates.append(acceptance(seqs))
        adapter.adapt_now()
    assert adapter.updates == rounds
    return rates


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_eagle_adaptation_raises_acceptance_and_greedy_output_stays_plain(pair, native):
    model, native_runner = pair
    runner = native_runner if native else ModelRunner(model)
    drafter = EagleDrafter(runner, random_head(model, draft_vocab=64, scale=0.05))
    first = drafter.head
    rates = adapting_raises_acceptance(runner, drafter, AdaptConfig(background=False, min_examples=1, head_window=16,
                                                                    lr=1e-2, batch_size=4, epochs=8, max_steps=64))
    assert drafter.head is not first and type(drafter.head.fc) is type(first.fc)  # swapped, on the same kernels
    assert max(rates[3:]) > rates[0] + 0.3, rates


@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied"])
def test_medusa_adaptation_raises_acceptance_and_greedy_output_stays_plain(pair, tied):
    model, native_runner = pair
    if tied:
        heads = MedusaHeads(3, 1, model.config.hidden_size, model.config.vocab_size, tied_rows=64)
    else:
        heads = random_heads(model, noise=1.5)
    drafter = MedusaDrafter(native_runner, heads.eval())
    rates = adapting_raises_acceptance(native_runner, drafter, AdaptConfig(background=False, min_examples=1,
                                       head_window=16, lr=1e-2, batch_size=4, epochs=4, max_steps=64),
                                       tree=TreeConfig(shape=(2, 2, 1)))
    assert drafter.heads is not heads
    assert max(rates[2:]) > rates[0] + 0.15, rates


def second_tokens_with_updates_between_steps(runner, drafter, sampling, prompt=(1, 2, 3), runs=400):
    """Chi-square of the second generated token, the drafter updated after every step (chains and trees)."""
    prompt = list(prompt)
    p = second_token_distribution(runner, prompt, sampling)
    engine = SpeculativeEngine(runner, drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, min_examples=1, head_window=2, lr=0.05,
                                                batch_size=8, max_steps=1))
    for tree in (None, TreeConfig(shape=(2, 2))):
        counts, drafted = torch.zeros(p.numel()), 0
        for seed in range(runs):
            batch = DecodeBatch(engine)
            (seq,) = engine.make_sequences([prompt], sampling, SpecConfig(num_draft_tokens=2, max_new_tokens=5, tree=tree),
                                           [seed])
            batch.add([seq])
            while batch:
                engine.step(batch)
                adapter.adapt_now()
            counts[seq.generated[1]] += 1
            drafted += seq.stats.draft_tokens
        assert drafted > 0
        assert chi_square_test(counts, p).p_value > 1e-3, tree
    assert adapter.updates > runs  # the head changed between steps, not only between requests


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_sampled_output_follows_the_target_with_the_head_updated_between_steps(small, kind):
    model, runner = small
    if kind == "eagle":
        drafter = EagleDrafter(runner, random_head(model, draft_vocab=6, aux=(0, 1, 1), seed=2, scale=0.5))
    else:
        drafter = MedusaDrafter(runner, random_heads(model, noise=1.0, seed=4))
    first = drafter.head if kind == "eagle" else drafter.heads
    second_tokens_with_updates_between_steps(runner, drafter, SamplingConfig(temperature=1.0))
    assert (drafter.head if kind == "eagle" else drafter.heads) is not first


def test_closing_the_adapter_stops_logging(pair):
    model, _ = pair
    runner = ModelRunner(model)
    engine = SpeculativeEngine(runner, drafter_for("eagle", model, runner), set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, head_window=4))
    engine.generate(PROMPTS[:1], GREEDY, SpecConfig(max_new_tokens=10))
    collected = adapter.buffer.collected
    assert collected > 0
    adapter.close()
    engine.generate(PROMPTS[:1], GREEDY, SpecConfig(max_new_tokens=10))
    assert adapter.buffer.collected == collected


def test_cli_generate_adapts_an_eagle_head(tmp_path, capsys):
    from tiny_hf import save_tiny_model_dir
    from transformers import AutoModelForCausalLM

    from verispec.cli import main

    target = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    tiny = AutoModelForCausalLM.from_pretrained(str(target))
    random_head(tiny, draft_vocab=tiny.config.vocab_size, aux=(0, 1, 1), scale=0.05).save(tmp_path / "head")
    common = ["generate", "--json", "--target", str(target), "--prompt", "hello there", "--temperature", "0",
              "--max-new-tokens", "40"]
    outputs = []
    for extra in (["--draft", "none"], ["--draft", f"eagle:{tmp_path / 'head'}", "--adapt"]):
        assert main([*common, *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert outputs[1]["adaptation"]["collected"] > 0, outputs[1]
