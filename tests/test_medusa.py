"""Medusa heads (`--draft medusa:DIR`): the Medusa repository's checkpoint format, the runners' final hidden
states taken from the verification pass, and exactness (greedy equality, chi-square at temperature / top-k /
top-p for chains and trees with sampled and top-token children)."""

import json

import pytest
import torch

from conftest import tiny_model
from drafting import drafts_accepted
from test_self_draft import second_token_distribution
from tiny_gguf import T, gguf_from_hf
from verispec.chisquare import chi_square_test
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.drafters.medusa import MedusaDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner
from verispec.models.heads.medusa import MedusaHeads, load_medusa
from verispec.models.runners.hf import ModelRunner

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]


def random_heads(model, num_heads=3, noise=0.3, seed=0):
    """Heads near the target's own LM head (so they agree with it sometimes), in the Medusa layout."""
    torch.manual_seed(seed)
    head = model.get_output_embeddings().weight.detach()
    heads = MedusaHeads(num_heads, 1, head.shape[1], head.shape[0])
    with torch.no_grad():
        for h in heads.heads:
            h[0].linear.weight.normal_(0, 0.05)
            h[-1].weight.copy_(head + noise * head.std() * torch.randn_like(head))
    return heads.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_model("llama", vocab=64, seed=0, layers=2, sharpness=30.0)
    native = NativeRunner(load_gguf(gguf_from_hf(model, tmp_path_factory.mktemp("m") / "t.gguf", T.F32),
                                    show_progress=False), cache_dtype="float32")  # its features match transformers'
    return model, native


def plain(runner, prompts=PROMPTS, tokens=30):
    return [s.generated for s in SpeculativeEngine(runner, None, set()).generate(prompts, GREEDY, SpecConfig(max_new_tokens=tokens))]


def test_a_checkpoint_in_the_medusa_format_round_trips(pair, tmp_path):
    model, native = pair
    heads = random_heads(model)
    heads.save(tmp_path / "medusa", base_model="tiny")
    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 1
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))) == {
        f"{k}.{name}" for k in range(3) for name in ("0.linear.weight", "0.linear.bias", "1.weight")}
    loaded = load_medusa(tmp_path / "medusa", 32, 64)
    h = torch.randn(2, 32)
    assert torch.equal(loaded(h), heads(h))


def test_bad_medusa_checkpoints_are_one_clear_line(pair, tmp_path):
    model, _ = pair
    random_heads(model).save(tmp_path / "good")
    with pytest.raises(VerispecError, match="width 32 and predict 64 tokens; this target has width 16"):
        load_medusa(tmp_path / "good", 16, 64)
    with pytest.raises(VerispecError, match="this target has width 32 and 100 tokens"):
        load_medusa(tmp_path / "good", 32, 100)
    with pytest.raises(VerispecError, match="config.json is missing"):
        load_medusa(tmp_path, 32, 64)
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(VerispecError, match="no Medusa weights"):
        load_medusa(tmp_path / "noweights", 32, 64)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "good" / "medusa_lm_head.safetensors"))
    del tensors["2.0.linear.bias"]
    save_file(tensors, str(tmp_path / "good" / "medusa_lm_head.safetensors"))
    with pytest.raises(VerispecError, match="'2.0.linear.bias' is missing"):
        load_medusa(tmp_path / "good", 32, 64)


def test_both_runners_keep_the_final_hidden_states_of_their_logits_positions(pair):
    model, native = pair
    ids = PROMPTS[1]
    with torch.no_grad():
        expected = model.model(torch.tensor([ids])).last_hidden_state[0, -3:]  # (3, E) after the final norm
    for runner in (ModelRunner(model), native):
        runner.keep_features = True
        runner.forward(runner.new_state(1), [ids], [3])
        torch.testing.assert_close(runner.features[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_medusa_speculation_equals_plain_decoding(pair, backend):
    model, native = pair
    runner = native if backend == "native" else ModelRunner(model)
    expected = plain(runner)
    engine = SpeculativeEngine(runner, MedusaDrafter(runner, random_heads(model)), set())
    for tree in (None, TreeConfig(shape=(2, 2, 1)), TreeConfig(budget=6, top_k=2)):
        out = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree))
        assert [s.generated for s in out] == expected
        drafted, accepted = drafts_accepted(out)
        assert accepted < drafted


def test_a_seeded_medusa_request_is_the_same_alone_or_batched(pair):
    model, native = pair
    engine = SpeculativeEngine(native, MedusaDrafter(native, random_heads(model)), set())
    sampling, spec = SamplingConfig(temperature=1.0, top_k=20), SpecConfig(num_draft_tokens=3, max_new_tokens=20)
    batch = engine.generate(PROMPTS, sampling, spec, seeds=[11, 12, 13])
    for prompt, seed, seq in zip(PROMPTS, [11, 12, 13], batch):
        assert engine.generate([prompt], sampling, spec, seeds=[seed])[0].generated == seq.generated


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model = tiny_model("qwen2", vocab=8, seed=3, layers=2, sharpness=4.0)
    path = gguf_from_hf(model, tmp_path_factory.mktemp("small") / "t.gguf", T.Q8_0)
    return model, NativeRunner(load_gguf(path, show_progress=False))


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=4),
                                      SamplingConfig(temperature=1.2, top_p=0.8)], ids=["temperature", "top-k", "top-p"])
def test_sampled_medusa_speculation_follows_the_targets_distribution(small, sampling):
    """Chi-square on the second generated token (the first comes from the prompt step, before any h), chains and
    trees with sampled and top-token children."""
    model, runner = small
    second_tokens_follow_the_target(runner, MedusaDrafter(runner, random_heads(model, noise=1.0, seed=4)), sampling)


def second_tokens_follow_the_target(runner, drafter, sampling, prompt=(1, 2, 3), runs=500):
    """Chi-square of the second generated token against the target's processed distribution, drafting chains,
    trees with sampled children and trees with top-token children (the first token comes from the prompt step)."""
    prompt = list(prompt)
    p = second_token_distribution(runner, prompt, sampling)
    engine = SpeculativeEngine(runner, drafter, set())
    for tree in (None, TreeConfig(shape=(2, 2)), TreeConfig(shape=(2, 2), children="top")):
        counts, drafted = torch.zeros(p.numel()), 0
        for seed in range(runs):
            seq = engine.generate([prompt], sampling, SpecConfig(num_draft_tokens=2, max_new_tokens=4, tree=tree),
                                  seeds=[seed])[0]
            counts[seq.generated[1]] += 1
            drafted += seq.stats.draft_tokens
        assert drafted > 0
        assert chi_square_test(counts, p).p_value > 1e-3, tree


def test_medusa_without_a_head_folder_or_on_a_runner_without_hidden_states_is_one_line(pair):
    from verispec.models.heads.shipped import hidden_size as _hidden_size

    class LlamaCppRunner:
        vocab_size = 64

    with pytest.raises(VerispecError, match="does not give them"):
        MedusaDrafter(LlamaCppRunner(), random_heads(pair[0]))
    with pytest.raises(VerispecError, match="gives no hidden states"):
        _hidden_size(LlamaCppRunner())


@pytest.mark.parametrize("tree", [None, TreeConfig(shape=(2, 2, 1))], ids=["chain", "tree"])
def test_the_heads_read_the_state_that_produced_the_last_committed_token(pair, tree):
    """After each step, h is the target's final hidden state at the position whose distribution gave the
    recovered or bonus token, i.e. after the second-to-last committed token."""
    from verispec.engine import DecodeBatch

    model, _ = pair
    runner = ModelRunner(model)
    drafter = MedusaDrafter(runner, random_heads(model))
    engine = SpeculativeEngine(runner, drafter, set())
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=40, tree=tree), 0))
    for _ in range(4):
        engine.step(batch)
        for seq, h in zip(batch.sequences, drafter.rows):
            with torch.no_grad():
                expected = model.model(torch.tensor([seq.tokens[:-1]])).last_hidden_state[0, -1]  # (E,)
            torch.testing.assert_close(h, expected, rtol=1e-4, atol=1e-4)


def cli_greedy_equals_plain(target, draft: str, capsys) -> None:
    """`verispec generate --temperature 0` with this draft gives plain decoding's tokens, and has drafts accepted.
    K is fixed (-k 3): --auto-k, the default, times this machine's passes, and a busy CPU may turn a weak tiny head
    off after one rejection, leaving nothing to compare (auto-k has its own tests with fixed cost profiles)."""
    from verispec.cli import main

    common = ["generate", "--json", "--target", str(target), "--prompt", "hello there", "--temperature", "0",
              "--max-new-tokens", "16", "-k", "3"]
    outputs = []
    for name in ("none", draft):
        assert main([*common, "--draft", name]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    drafts_accepted(outputs[1:])


def test_draft_medusa_on_the_command_line(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from tiny_hf import save_tiny_model_dir
    from verispec.cli import main

    folder = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    random_heads(AutoModelForCausalLM.from_pretrained(str(folder))).save(tmp_path / "heads")
    cli_greedy_equals_plain(folder, f"medusa:{tmp_path / 'heads'}", capsys)
    for draft, fragment in (("medusa", "the shipped medusa head"), (f"medusa:{tmp_path}", "config.json is missing")):
        assert main(["generate", "--target", str(folder), "--prompt", "hi", "--draft", draft]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err


def tied_heads(num_heads=3, rows=48, seed=0):
    """ResBlocks only, sharing the target's LM head over its first `rows` ids (verispec's tied format)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, 1, 32, 64, tied_rows=rows)
    with torch.no_grad():
        for h in heads.heads:
            h[0].linear.weight.normal_(0, 0.3)
    return heads.eval()


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_tied_heads_use_the_targets_own_lm_head_and_stay_exact(pair, backend, tmp_path):
    model, native = pair
    runner = native if backend == "native" else ModelRunner(model)
    heads = tied_heads()
    heads.save(tmp_path / "tied")
    loaded = load_medusa(tmp_path / "tied", 32, 64)
    assert loaded.tied_rows == 48 and json.loads((tmp_path / "tied" / "config.json").read_text())["tied_lm_head"] == 48
    h = torch.randn(2, 32)
    logits = loaded(h, lm_head=lambda x: runner.head_logits(x, 48))  # (2, 3, 64)
    assert bool(torch.isinf(logits[..., 48:]).all())
    with torch.no_grad():
        expected = model.lm_head(torch.stack([block(h) for block in heads.heads], dim=1))[..., :48]
    torch.testing.assert_close(logits[..., :48], expected, rtol=1e-2, atol=1e-2)  # Q8_0-free F32 target: close
    engine = SpeculativeEngine(runner, MedusaDrafter(runner, loaded), set())
    out = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30))
    assert [s.generated for s in out] == plain(runner)
    drafts_accepted(out)
    sampling, spec = SamplingConfig(temperature=1.0), SpecConfig(num_draft_tokens=3, max_new_tokens=20)
    batch = engine.generate(PROMPTS, sampling, spec, seeds=[1, 2, 3])
    assert [engine.generate([p], sampling, spec, seeds=[s])[0].generated for p, s in zip(PROMPTS, [1, 2, 3])] == [
        s.generated for s in batch]


# ---------------------------------------------------------------- training tied heads


def test_training_tied_heads_on_the_targets_answers_raises_their_agreement(pair):
    from verispec.head_training.medusa_train import MedusaTrainConfig, agreement, split, target_answers, train_heads

    model, native = pair
    config = MedusaTrainConfig(heads=2, rows=48, tokens=24, top_k=8, steps=150, batch_size=64, lr=3e-3)
    prompts = [[i, i + 1, (3 * i) % 64] for i in range(1, 25)]
    answers = target_answers(native, prompts, config, show=False)
    assert len(answers) == 24 and answers.hidden[0].shape == (24, 32)
    train, val = split(answers, 0.25, 0)
    lm_head = model.lm_head.weight.detach()[:48]
    untrained = agreement(MedusaHeads(2, 1, 32, 64, tied_rows=48), train, lm_head)
    heads, log = train_heads(train, val, lm_head, 64, config, show=False)
    assert log["train_agreement"][0] > untrained[0] and log["loss"][-1][1] < log["loss"][0][1]
    engine = SpeculativeEngine(native, MedusaDrafter(native, heads), set())
    out = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=2, max_new_tokens=30))
    assert [s.generated for s in out] == plain(native)
    drafts_accepted(out)


def test_train_heads_refuses_bad_requests_in_one_line(tmp_path, capsys):
    from verispec.cli import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    for args, fragment in ((["--out", str(tmp_path / "out")], "exists and is not empty"),
                           (["--out", str(tmp_path / "new"), "--ttt", "2"], "--ttt does not apply to --kind medusa"),
                           (["--out", str(tmp_path / "new"), "--steps", "0"], "steps >= 1")):
        assert main(["train-heads", *args]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()


def test_train_heads_medusa_checkpoints_and_resumes(tmp_path, capsys, monkeypatch):
    """A Medusa run stopped after its first checkpoint goes on with --resume without collecting again."""
    import verispec.head_training.medusa_run as medusa_run
    from tiny_hf import save_tiny_model_dir
    from verispec.cli import main

    folder = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"tell me about number {i}" for i in range(8)))
    out = tmp_path / "heads"
    command = ["train-heads", "--target", str(folder), "--data", str(prompts), "--out", str(out), "--tokens", "8",
               "--heads", "2", "--rows", "64", "--steps", "200", "--batch-size", "16", "--val-fraction", "0.25"]
    real = medusa_run.train_heads

    def stopped(*args, checkpoint=None, **kwargs):
        def stop(heads, optimizer, step):
            checkpoint(heads, optimizer, step)
            raise KeyboardInterrupt

        return real(*args, checkpoint=stop, **kwargs)

    monkeypatch.setattr(medusa_run, "train_heads", stopped)
    assert main(command) != 0
    partial = tmp_path / "heads.partial"
    assert not out.exists() and (partial / "answers.pt").is_file() and (partial / "checkpoint.pt").is_file()
    monkeypatch.setattr(medusa_run, "train_heads", real)
    monkeypatch.setattr(medusa_run, "target_answers", lambda *a, **k: pytest.fail("--resume collected again"))
    capsys.readouterr()
    assert main([*command, "--resume"]) == 0
    assert "resuming at step 100 of 200" in capsys.readouterr().err
    assert not partial.exists() and set(json.loads((out / "manifest.json").read_text())["sha256"]) == {
        "config.json", "medusa_lm_head.safetensors", "training.json"}
    config = json.loads((out / "config.json").read_text())
    assert load_medusa(out, config["hidden_size"], config["vocab_size"]).num_heads == 2


def constrained_engines(runner, drafter):
    """(plain, speculative) engines whose constraints read a character tokenizer over the tiny model's 64 ids."""
    from tiny_hf import char_tokenizer
    from verispec.constraints import Grammars

    grammars = Grammars(char_tokenizer(), 64, 2)
    return (SpeculativeEngine(runner, None, {2}, grammars=lambda: grammars),
            SpeculativeEngine(runner, drafter, {2}, grammars=lambda: grammars))


# three letters, then ": " and after two digits "." forced: free drafts between the heads' own
FORCING = SamplingConfig(temperature=0, constraint=__import__("verispec.config").config.Constraint(
    "regex", "[a-h]{3}: [0-9]{2}\\.[a-h ]{4}"))


def test_constrained_heads_keep_the_targets_features_and_equal_constrained_plain_decoding(pair):
    """Forced runs are drafted among the heads' drafts: the heads' commit must keep the target's features at the forced
    path's positions, or their next drafts read the wrong states (and a head's tree must stay in the constraint)."""
    model, native = pair
    plain, engine = constrained_engines(native, MedusaDrafter(native, random_heads(model)))
    expected = [s.generated for s in plain.generate(PROMPTS, FORCING, SpecConfig(max_new_tokens=30))]
    for tree in (None, TreeConfig(shape=(2, 2, 1))):
        out = engine.generate(PROMPTS, FORCING, SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree))
        assert [s.generated for s in out] == expected, tree
        assert sum(s.stats.forced_tokens for s in out) > 0


def test_medusa_heads_follow_the_reused_prefixes(pair):
    """Medusa heads read the last position's state only, which the pass over a joining row's unread tokens gives: with
    the target's prefix store on, each later turn of a conversation reads only what is new, with the same drafts and
    the same bits as without."""
    from verispec.core.prefix import PrefixStore
    model, native = pair
    heads = random_heads(model)
    system = [(7 * i + 3) % 64 for i in range(30)]
    spec = SpecConfig(max_new_tokens=12, num_draft_tokens=3, stop_at_eos=False)
    sampling = SamplingConfig(temperature=0.9, top_k=20)

    def conversation(engine):
        prompt, turns = system + [1, 2, 3], []
        for turn in range(3):
            turns.append(engine.generate([prompt], sampling, spec, seeds=4 + turn)[0])
            prompt = turns[-1].tokens + [5, 6, turn]
        return turns

    cold = conversation(SpeculativeEngine(native, MedusaDrafter(native, heads), set()))
    engine = SpeculativeEngine(native, MedusaDrafter(native, heads), set())
    engine.prefixes = PrefixStore(1 << 30)
    warm = conversation(engine)
    assert [s.generated for s in warm] == [s.generated for s in cold]
    assert [s.stats.cached_tokens for s in warm] == [0, len(warm[0].tokens) - 1, len(warm[1].tokens) - 1]
    assert [s.stats.accepted_tokens for s in warm] == [s.stats.accepted_tokens for s in cold]
    assert sum(s.stats.draft_tokens for s in warm) > 0
