"""The distilled tiny draft: vocabulary mapping, exactness with q = 0 outside the draft vocabulary,
the teacher's labels, training, export / load with integrity checks, and the `distill` CLI."""


import copy
import json

import pytest
import torch
from test_exactness import THRESHOLD, V, check_distribution, sample_tokens
from drafting import drafts_accepted
from tiny_hf import char_tokenizer

from verispec.cli import main
from verispec.config import PromptLookupConfig, SamplingConfig, SpecConfig, TreeConfig
from verispec.distill.data import Record, load_shard, save_shard, split_of
from verispec.models.distilled import (
    TinyDraftConfig,
    VocabMap,
    choose_vocabulary,
    load_distilled,
    save_distilled,
    vocab_fingerprint,
)
from verispec.distill.teacher import TorchTeacher
from verispec.distill.train import TrainConfig, choose_lookup, distill_loss, evaluate, make_batch, to_example, train
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.mapped import MappedVocabRunner
from verispec.models.runners.hf import ModelRunner

SHAPE = TinyDraftConfig(draft_vocab_size=5, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, max_positions=128)


def reduced_copy(model, to_target) -> tuple[torch.nn.Module, VocabMap]:
    """A reduced-vocabulary draft that is `model` (a tiny Llama) on the tokens `to_target`: their embedding and
    head rows, OTHER's zero. Where the target writes those tokens, a copy of the greedy pair's draft guesses as
    that draft does (mostly accepted); a randomly initialised draft has nearly all of its guesses rejected."""
    vocab = VocabMap.from_target_ids(torch.tensor(to_target), model.config.vocab_size)
    config = copy.deepcopy(model.config)
    config.vocab_size = vocab.draft_vocab_size + 1
    weights = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name][vocab.to_target]  # (Vd, H)
        weights[name] = torch.cat([rows, torch.zeros_like(rows[:1])])  # (Vd + 1, H)
    draft = type(model)(config)
    draft.load_state_dict(weights)
    return draft.eval(), vocab


def most_written(outputs: list[list[int]], size: int = 32) -> list[int]:
    """The `size` tokens written most in `outputs` (a target's plain decoding): a distilled draft's vocabulary is
    chosen so (`choose_vocabulary`)."""
    return choose_vocabulary(outputs, size=size, always=[], target_vocab_size=64).tolist()


def mapped_draft(to_target, target_vocab, seed=0):
    torch.manual_seed(seed)
    shape = TinyDraftConfig(**{**SHAPE.__dict__, "draft_vocab_size": len(to_target)})
    vocab = VocabMap.from_target_ids(torch.tensor(to_target), target_vocab)
    return shape, shape.build().eval(), vocab


def test_vocab_map_round_trip_and_scatter():
    vocab = VocabMap.from_target_ids(torch.tensor([7, 2, 5]), 10)
    assert vocab.to_draft[torch.tensor([7, 2, 5])].tolist() == [0, 1, 2]
    assert vocab.to_draft[torch.tensor([0, 9])].tolist() == [3, 3]  # OTHER
    full = vocab.scatter(torch.tensor([[1.0, 2.0, 3.0, 99.0]]), 10)  # (1, 10); OTHER's logit is dropped
    probs = torch.softmax(full, -1)[0]
    assert probs[[0, 1, 3, 4, 6, 8, 9]].sum() == 0
    assert torch.allclose(probs[[7, 2, 5]], torch.softmax(torch.tensor([1.0, 2.0, 3.0]), -1))
    with pytest.raises(VerispecError, match="twice"):
        VocabMap.from_target_ids(torch.tensor([1, 1]), 10)
    with pytest.raises(VerispecError, match="outside"):
        VocabMap.from_target_ids(torch.tensor([1, 10]), 10)


def test_choose_vocabulary_keeps_frequent_and_forced_tokens():
    chosen = choose_vocabulary([[1, 1, 1, 2, 2, 3], [1, 2, 4]], size=3, always=[9], target_vocab_size=10)
    assert chosen.tolist() == [1, 2, 9]


def test_mapped_runner_matches_the_small_model_on_its_vocabulary():
    shape, model, vocab = mapped_draft([0, 3, 5, 6], V)
    runner = MappedVocabRunner(model, vocab)
    assert runner.vocab_size == V
    state = runner.new_state(1)
    out = runner.forward(state, [[3, 1, 6]], [2])[0]  # (2, V); token 1 maps to OTHER
    direct = model(torch.tensor([[1, 4, 3]])).logits[0, -2:, :4]
    assert torch.allclose(out[:, [0, 3, 5, 6]], direct, atol=1e-5)
    assert torch.isinf(out[:, [1, 2, 4, 7]]).all()


LOOKUP = PromptLookupConfig(max_ngram=4, min_ngram=1)


@pytest.mark.parametrize("lookup", [None, LOOKUP], ids=["draft", "lookup-first"])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_p=0.9),
                                      SamplingConfig(temperature=0.7, top_k=5)])
def test_reduced_vocabulary_draft_keeps_sampling_exact(sampling_pair, sampling, lookup):
    """q is zero outside the draft vocabulary: the residual must carry that mass. Lookup first: copied positions
    report a one-hot q, drawn ones the draft's q, and the mixture stays exact too (chi-square)."""
    target, _ = sampling_pair
    _, model, vocab = mapped_draft([0, 2, 5, 6, 7], V, seed=2)
    drafter = DraftModelDrafter(MappedVocabRunner(model, vocab), V, lookup=lookup)
    engine = SpeculativeEngine(ModelRunner(target), drafter, eos_token_ids=set())
    samples, seqs = sample_tokens(engine, sampling, K=3)
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit
    assert any(s.stats.accepted_tokens for s in seqs) and any(s.stats.recovered_tokens for s in seqs)


def test_reduced_vocabulary_draft_greedy_equals_plain(greedy_pair):
    target, draft = greedy_pair
    plain = SpeculativeEngine(ModelRunner(target), None, eos_token_ids=set())
    greedy, cfg = SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=3, max_new_tokens=24, stop_at_eos=False)
    prompts = [[1, 2, 3], [5, 9, 11, 4, 8]]
    expected = [s.generated for s in plain.generate(prompts, greedy, cfg, seeds=0)]
    model, vocab = reduced_copy(draft, most_written(expected))
    spec = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(MappedVocabRunner(model, vocab), 64), eos_token_ids=set())
    seqs = spec.generate(prompts, greedy, cfg, seeds=0)
    assert [s.generated for s in seqs] == expected
    drafts_accepted(seqs)


def test_teacher_labels_are_the_target_distributions(greedy_pair):
    target, _ = greedy_pair
    teacher = TorchTeacher(ModelRunner(target), eos_token_ids=set())
    rec = teacher.generate([[1, 2, 3]], max_new_tokens=5, k=4)[0]
    assert rec.tokens.numel() == 8 and rec.label_start == 2 and rec.topk_ids.shape == (5, 4)
    with torch.no_grad():
        logp = torch.log_softmax(target(rec.tokens[None]).logits[0].float(), -1)  # (8, V)
    for i in range(5):
        pos = rec.label_start + i
        assert torch.allclose(rec.topk_logprobs[i], logp[pos, rec.topk_ids[i]], atol=1e-4)
        assert int(rec.tokens[pos + 1]) == int(rec.topk_ids[i, 0])  # greedy: the answer is the top label
    forced = teacher.label([rec.tokens.tolist()], k=4)[0]
    assert torch.allclose(forced.topk_logprobs[2:], rec.topk_logprobs, atol=1e-4)


def test_shard_round_trip(tmp_path):
    recs = [Record(torch.tensor([1, 2, 3, 4]), 1, torch.tensor([[2, 5], [3, 1], [4, 0]]), torch.tensor([[-0.1, -2.0]] * 3)),
            Record.unlabelled([7, 8, 9])]
    save_shard(tmp_path / "s.safetensors", recs)
    back = load_shard(tmp_path / "s.safetensors")
    assert back[0].tokens.tolist() == [1, 2, 3, 4] and back[0].label_start == 1
    assert back[0].topk_ids.tolist() == [[2, 5], [3, 1], [4, 0]]
    assert torch.allclose(back[0].topk_logprobs, recs[0].topk_logprobs, atol=1e-3)
    assert back[1].tokens.tolist() == [7, 8, 9] and back[1].topk_ids.shape[0] == 0


def test_spec_bench_split_is_by_question_id_parity():
    assert split_of(82) == "train" and split_of(83) == "heldout"


def test_loss_prefers_the_teacher_distribution():
    vocab = VocabMap.from_target_ids(torch.tensor([0, 1, 2]), 5)
    rec = Record(torch.tensor([0, 1, 2]), 0, torch.tensor([[1, 2], [2, 4]]), torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.5]])))
    ex = to_example(rec, vocab, 2)
    assert ex.hard.tolist() == [-100, -100, -100]  # both positions have soft labels; the last has no next token
    assert torch.allclose(ex.soft_w[1], torch.tensor([1.0, 0.0]))  # token 4 is outside: renormalised away
    inp, hard, soft_ids, soft_w, mask = make_batch([ex], [(0, 0)], 4, vocab.other)
    good = torch.log(torch.tensor([[[0.01, 0.74, 0.25, 1e-9], [0.01, 0.01, 0.98, 1e-9], [1 / 3] * 3 + [1e-9], [1 / 3] * 3 + [1e-9]]]))
    bad = torch.log(torch.tensor([[[0.98, 0.01, 0.01, 1e-9], [0.98, 0.01, 0.01, 1e-9], [1 / 3] * 3 + [1e-9], [1 / 3] * 3 + [1e-9]]]))
    assert distill_loss(good, hard, soft_ids, soft_w) < distill_loss(bad, hard, soft_ids, soft_w)


def _tiny_training_set(target, n=6, tokens=12):
    teacher = TorchTeacher(ModelRunner(target), eos_token_ids=set())
    prompts = [[1 + i, 3 + 2 * i, 5] for i in range(n)]
    return teacher.generate(prompts, max_new_tokens=tokens, k=8)


def test_training_raises_validation_acceptance_and_resumes(greedy_pair, tmp_path):
    target, _ = greedy_pair
    records = _tiny_training_set(target)
    vocab = VocabMap.from_target_ids(torch.arange(64), 64)
    shape = TinyDraftConfig(**{**SHAPE.__dict__, "draft_vocab_size": 64, "hidden_size": 32, "intermediate_size": 64})
    torch.manual_seed(0)
    model = shape.build()
    before = evaluate(model, records, vocab)
    cfg = TrainConfig(steps=60, batch_size=4, seq_len=16, lr=1e-2, warmup=5, eval_every=30, checkpoint_every=30)
    summary = train(model, shape, vocab, records, records, cfg, tmp_path, {"target": "tiny"}, log=lambda *_: None)
    after = evaluate(model, records, vocab)
    assert after["greedy_acceptance"] > before["greedy_acceptance"] + 0.3
    assert summary["history"][-1]["step"] == 60 and (tmp_path / "checkpoint.pt").is_file()
    longer = TrainConfig(**{**cfg.__dict__, "steps": 70})
    second = shape.build()
    again = train(second, shape, vocab, records, records, longer, tmp_path, {"target": "tiny"}, log=lambda *_: None)
    assert [h["step"] for h in again["history"]][-3:] == [30, 60, 70]  # resumed at 60, not from scratch
    loaded, loaded_vocab, manifest = load_distilled(tmp_path / "draft")
    assert loaded_vocab.to_target.tolist() == list(range(64)) and manifest["target"] == "tiny"
    ctx = torch.tensor([[1, 2, 3]])
    assert torch.allclose(loaded(ctx).logits, second.half().float()(ctx).logits, atol=1e-3)


def test_a_killed_run_resumes_with_each_evaluation_logged_once(greedy_pair, tmp_path, monkeypatch):
    """log.jsonl is the history rewritten atomically: before, it was appended to, so the evaluations a killed
    run logged after its last checkpoint were logged again when the resumed run redid them."""
    from verispec.distill import train as train_module

    class Killed(BaseException):
        pass

    target, _ = greedy_pair
    records = _tiny_training_set(target, n=3, tokens=8)
    vocab = VocabMap.from_target_ids(torch.arange(64), 64)
    shape = TinyDraftConfig(**{**SHAPE.__dict__, "draft_vocab_size": 64, "hidden_size": 32, "intermediate_size": 64})
    cfg = TrainConfig(steps=30, batch_size=2, seq_len=16, warmup=2, eval_every=5, checkpoint_every=15)
    real, calls = train_module.evaluate, []

    def killed_at_step_25(*args):
        calls.append(1)
        if len(calls) == 5:
            raise Killed
        return real(*args)

    monkeypatch.setattr(train_module, "evaluate", killed_at_step_25)
    with pytest.raises(Killed):
        train(shape.build(), shape, vocab, records, records, cfg, tmp_path, {"target": "tiny"}, log=lambda *_: None)
    logged = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged == [5, 10, 15, 20]  # step 20 is logged, the checkpoint is step 15's
    monkeypatch.setattr(train_module, "evaluate", real)
    train(shape.build(), shape, vocab, records, records, cfg, tmp_path, {"target": "tiny"}, log=lambda *_: None)
    logged = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged == [5, 10, 15, 20, 25, 30]


def test_export_integrity_and_tokenizer_checks(tmp_path):
    shape, model, vocab = mapped_draft([0, 1, 2, 3, 4], 8)
    tok = char_tokenizer()
    out = save_distilled(tmp_path / "d", shape, model, vocab, {"target": "x", "target_vocab_sha256": vocab_fingerprint(tok),
                                                             "target_vocab_size": 8})
    load_distilled(out, tok)
    with pytest.raises(VerispecError, match="another tokenizer"):
        load_distilled(out, char_tokenizer(chars=list("abc")))
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(VerispecError, match="damaged"):
        load_distilled(out, tok)


def test_distilled_draft_through_the_api(tmp_path):
    """A distilled draft directory works as --draft for a target with the same tokenizer."""
    from tiny_hf import distilled_copy_of, tiny_dir_with_head_from_embedding

    from verispec import SpeculativeDecoder

    target_dir = tiny_dir_with_head_from_embedding(tmp_path / "target")
    tok = char_tokenizer()
    vocab_size = len(tok)
    vocab = VocabMap.from_target_ids(torch.arange(1, vocab_size, 2), vocab_size)  # half, with most of what it writes
    shape, model = distilled_copy_of(target_dir, vocab)  # the target on that half: its drafts are accepted
    draft_dir = save_distilled(tmp_path / "draft", shape, model, vocab,
                               {"target": "t", "target_vocab_sha256": vocab_fingerprint(tok), "target_vocab_size": vocab_size})
    plain = SpeculativeDecoder.load(str(target_dir), "none", target_weights="dense")
    spec = SpeculativeDecoder.load(str(target_dir), str(draft_dir), target_weights="dense", draft_weights="dense")
    greedy, cfg = SamplingConfig(temperature=0), SpecConfig(max_new_tokens=16, stop_at_eos=False)
    out = spec.generate("ab", greedy, cfg)
    assert out.token_ids == plain.generate("ab", greedy, cfg).token_ids
    drafts_accepted([out])
    assert spec.draft_name == str(draft_dir)


def test_distill_cli_errors(tmp_path, capsys):
    from tiny_hf import save_tiny_model_dir

    target_dir = save_tiny_model_dir(tmp_path / "target")
    assert main(["distill", "train", "--target", str(target_dir), "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["distill", "train", "--target", str(target_dir), "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "no shards" in capsys.readouterr().err
    assert main(["distill", "train", "--target", str(target_dir), "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o"),
                 "--steps", "0"]) == 2


def test_distill_cli_end_to_end(tmp_path):
    """labels (torch teacher) -> train -> a draft directory that decodes exactly."""
    from tiny_hf import save_tiny_model_dir

    target_dir = save_tiny_model_dir(tmp_path / "target")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"question_id": {i}, "category": "qa", "turns": ["what is {c}?"]}}\n'
                               for i, c in zip(range(80, 90), "abcdefghij")))
    assert main(["distill", "labels", "--target", str(target_dir), "--out", str(tmp_path / "lab"), "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--top-k-labels", "4", "--slots", "3"]) == 0
    assert len(load_shard(next((tmp_path / "lab").glob("*.safetensors")))) == 5  # the even (train) ids
    assert main(["distill", "labels", "--target", str(target_dir), "--out", str(tmp_path / "lab"), "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--top-k-labels", "4"]) == 0  # resumes: nothing left to do
    assert len(list((tmp_path / "lab").glob("*.safetensors"))) == 1
    assert main(["distill", "train", "--target", str(target_dir), "--data", str(tmp_path / "lab"), "--out", str(tmp_path / "run"),
                 "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--draft-vocab", "20",
                 "--hidden-size", "16", "--intermediate-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1"]) == 0
    assert (tmp_path / "run" / "draft" / "verispec-distilled.json").is_file()
    assert main(["generate", "--target", str(target_dir), "--draft", str(tmp_path / "run" / "draft"), "--prompt", "ab",
                 "--temperature", "0", "--max-new-tokens", "6", "--target-weights", "dense", "--json"]) == 0
    assert main(["generate", "--target", str(target_dir), "--draft", str(tmp_path / "run" / "draft"), "--prompt", "ab",
                 "--temperature", "0", "--max-new-tokens", "6", "--draft-lookup", "2", "--json"]) == 0
    assert main(["generate", "--target", str(target_dir), "--draft", str(tmp_path / "run" / "draft"), "--prompt", "ab",
                 "--draft-lookup", "-1"]) == 2
    assert main(["generate", "--target", str(target_dir), "--draft", str(tmp_path / "run" / "draft"), "--prompt", "ab",
                 "--temperature", "0", "--max-new-tokens", "6", "--draft-context", "2", "--json"]) == 0
    assert main(["generate", "--target", str(target_dir), "--draft", str(tmp_path / "run" / "draft"), "--prompt", "ab",
                 "--draft-context", "0"]) == 2
    manifest = json.loads((tmp_path / "run" / "draft" / "verispec-distilled.json").read_text())
    assert set(manifest["lookup_agreement"]) == {"0", "1", "2", "3"}  # measured on the validation split at export


@pytest.mark.parametrize("lookup", [None, LOOKUP], ids=["draft", "lookup-first"])
@pytest.mark.parametrize("tree", [TreeConfig(shape=(3, 2, 1)), TreeConfig(budget=8, top_k=3)])
def test_reduced_vocabulary_draft_trees_greedy_equal_plain(greedy_pair, tree, lookup):
    target, draft = greedy_pair
    plain = SpeculativeEngine(ModelRunner(target), None, eos_token_ids=set())
    greedy = SamplingConfig(temperature=0)
    cfg = SpecConfig(num_draft_tokens=3, max_new_tokens=20, stop_at_eos=False)
    prompts = [[1, 2, 3], [5, 9, 11, 4, 8]]
    expected = [s.generated for s in plain.generate(prompts, greedy, cfg, seeds=0)]
    model, vocab = reduced_copy(draft, most_written(expected))
    drafter = DraftModelDrafter(MappedVocabRunner(model, vocab), 64, lookup=lookup)
    spec = SpeculativeEngine(ModelRunner(target), drafter, eos_token_ids=set())
    tree_cfg = SpecConfig(num_draft_tokens=3, max_new_tokens=20, stop_at_eos=False, tree=tree)
    seqs = spec.generate(prompts, greedy, tree_cfg, seeds=0)
    assert [s.generated for s in seqs] == expected
    drafts_accepted(seqs)


def test_reduced_vocabulary_draft_adapts_online(greedy_pair):
    """Online adaptation trains the distilled draft in its own ids (MappedVocabRunner.training_logits)."""
    from verispec.adapt import OnlineAdapter
    from verispec.config import AdaptConfig

    target, _ = greedy_pair
    _, model, vocab = mapped_draft(list(range(0, 64, 2)) + list(range(1, 40, 2)), 64, seed=5)
    drafter = DraftModelDrafter(MappedVocabRunner(model, vocab), 64)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, min_examples=1, lr=1e-2, batch_size=8, max_steps=32,
                                                epochs=4))
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=4, max_new_tokens=40, stop_at_eos=False)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    plain = [s.generated for s in SpeculativeEngine(ModelRunner(target), None, set()).generate(prompts, greedy, spec)]
    rates = []
    for _ in range(6):
        seqs = engine.generate(prompts, greedy, spec)
        assert [s.generated for s in seqs] == plain
        rates.append(sum(s.stats.accepted_tokens for s in seqs) / max(1, sum(s.stats.draft_tokens for s in seqs)))
        adapter.adapt_now()
    assert drafter.runner.model is not model  # new weights were swapped in
    assert max(rates[2:]) > rates[0] + 0.1, rates  # without adaptation the rate stays rates[0] (deterministic)



def test_lookup_first_copies_and_stays_greedy_equal(greedy_pair):
    target, _ = greedy_pair
    _, model, vocab = mapped_draft(list(range(0, 64, 2)), 64, seed=3)  # random: what is accepted was copied
    plain = SpeculativeEngine(ModelRunner(target), None, eos_token_ids=set())
    drafter = DraftModelDrafter(MappedVocabRunner(model, vocab), 64, lookup=LOOKUP)
    spec = SpeculativeEngine(ModelRunner(target), drafter, eos_token_ids=set())
    greedy, cfg = SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=3, max_new_tokens=24, stop_at_eos=False)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 11, 4, 8]]
    seqs = spec.generate(prompts, greedy, cfg, seeds=0)
    assert [s.generated for s in seqs] == [s.generated for s in plain.generate(prompts, greedy, cfg, seeds=0)]
    drafts_accepted(seqs)
    seqs = plain.make_sequences([[1, 2, 3, 1, 2]], greedy, cfg, 0)
    drafter.start(seqs)
    assert drafter.propose(seqs, [1])[0].tokens.tolist() == [3]  # "1 2" was followed by 3: copied


def test_choose_lookup_reports_every_choice(greedy_pair):
    target, _ = greedy_pair
    records = _tiny_training_set(target, n=2, tokens=10)
    vocab = VocabMap.from_target_ids(torch.arange(64), 64)
    shape = TinyDraftConfig(**{**SHAPE.__dict__, "draft_vocab_size": 64})
    chosen = choose_lookup(shape.build(), records, vocab)
    assert set(chosen["agreement"]) == {0, 1, 2, 3} and chosen["best"] in chosen["agreement"]
    assert all(0 <= r <= 1 for r in chosen["agreement"].values())


def test_the_shipped_distilled_draft_loads_and_is_checked():
    """The draft that ships with the package: files match their sha256, shapes match the config."""
    from verispec.models.loading import DISTILLED_DRAFTS

    model, vocab, manifest = load_distilled(DISTILLED_DRAFTS["distilled"])
    assert manifest["target"] == "qwen2.5-coder-1.5b-instruct" and vocab.draft_vocab_size == 16384
    assert manifest["split"].startswith("Spec-Bench question_id")
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 16385) and bool(torch.isfinite(logits).all())
