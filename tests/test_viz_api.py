"""The `verispec viz` JSON API without a browser: a live decoding with a draft tree returns the
library's own trace records step by step, and bad tree settings answer 400 with a clear message."""

import dataclasses

import pytest
from fastapi.testclient import TestClient

from tiny_hf import save_tiny_model_dir
from viz_reference import reference_steps
from verispec.api import SpeculativeDecoder
from verispec.config import TreeConfig
from verispec.viz.server import create_app


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("viz-api-models")
    return (str(save_tiny_model_dir(root / "target", seed=0, sharpness=3.0)),
            str(save_tiny_model_dir(root / "draft", seed=1, sharpness=3.0)))


@pytest.fixture(scope="module")
def client(model_dirs):
    return TestClient(create_app(SpeculativeDecoder.load(*model_dirs)), base_url="http://localhost")


def run_live(client, body):
    start = client.post("/api/live/start", json=body)
    assert start.status_code == 200, start.text
    records, done = [], False
    while not done:
        r = client.post("/api/live/step", json={"session": start.json()["session"]}).json()
        done = r["done"]
        if r["record"] is not None:
            records.append(r["record"])
    return start.json(), records


@pytest.mark.parametrize("tree, config, temperature", [
    ({"shape": "2,2,1"}, TreeConfig(shape=(2, 2, 1)), 1.0),
    ({"budget": 6, "top_k": 2, "children": "iid"}, TreeConfig(budget=6, top_k=2, children="iid"), 1.0),
    ({"shape": [3, 1], "budget": None}, TreeConfig(shape=(3, 1)), 0.0),
])
def test_live_tree_steps_are_the_librarys_records(client, model_dirs, tree, config, temperature):
    settings = dict(prompt="the cat sat", k=3, temperature=temperature, seed=7, max_new_tokens=16)
    start, records = run_live(client, dict(settings, drafter=model_dirs[1], tree=tree))
    assert start["tree"] == {**dataclasses.asdict(config), "shape": config.shape and list(config.shape)}
    steps, text, _, stats = reference_steps(model_dirs, **settings, tree=config)
    assert len(records) == len(steps) == stats.target_forward_passes
    for mine, ref in zip(records, steps):
        for key in ("tree", "drafts", "positions", "token", "bonus", "committed", "num_accepted"):
            assert mine[key] == ref[key], key
        assert mine["counters"]["target_calls"] == ref["counters"]["target_calls"]
        assert mine["counters"]["new_tokens"] == ref["counters"]["new_tokens"]
    assert "".join(t for r in records for t, _ in r["pieces"]) == text
    assert records[-1]["counters"]["acceptance_rate"] == round(stats.acceptance_rate, 6)
    assert {n["verdict"] for r in records for n in r["tree"]["nodes"]} >= {"accepted", "rejected"}


@pytest.mark.parametrize("tree, message", [
    ({"shape": "3,x"}, "branching factors per depth like 3,2,1, got '3,x'"),
    ({"shape": "3,0"}, "branching factors >= 1"),
    ({"shape": ""}, "branching factors per depth"),
    ({"shape": 5}, "branching factors per depth"),
    ({"shape": "8,8"}, "at most 64 nodes and depth 16; this one has 72 nodes"),
    ({"budget": 100}, "at most 64 nodes"),
    ({"shape": "2", "budget": 4}, "not both"),
    ({}, "either a shape"),
    ({"budget": 8, "top_k": 0}, "top_k must be an integer >= 1"),
    ({"budget": 8, "children": "random"}, "tree children must be one of"),
    ({"depth": 3}, "unknown tree option 'depth'"),
    ("3,2,1", "tree takes an object"),
])
def test_bad_tree_settings_answer_400(client, model_dirs, tree, message):
    r = client.post("/api/live/start", json={"prompt": "ab", "drafter": model_dirs[1], "tree": tree})
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_a_tree_needs_a_drafter(client):
    r = client.post("/api/live/start", json={"prompt": "ab", "drafter": "none", "tree": {"shape": "2"}})
    assert r.status_code == 400 and "needs a drafter" in r.json()["error"]
    # prompt lookup builds tries: accepted
    assert client.post("/api/live/start", json={"prompt": "ab", "drafter": "ngram", "tree": {"shape": "2"}}).status_code == 200


def test_info_offers_the_tree_options(client):
    info = client.get("/api/info").json()
    assert info["tree"] == {"children": ["without_replacement", "iid", "top"], "max_nodes": 64, "max_depth": 16}
    assert info["defaults"]["tree_top_k"] == 4 and info["defaults"]["tree_children"] == "without_replacement"


def test_a_live_request_is_bounded_before_it_starts(client, model_dirs):
    """The live view had the server's gap: {"budget": 8, "top_k": 1000000000} was accepted and expanded every node
    with up to V children; now top_k is capped at the budget, and K, max_new_tokens and temperature have ranges."""
    r = client.post("/api/live/start", json={"prompt": "ab", "drafter": model_dirs[1],
                                             "tree": {"budget": 8, "top_k": 10**9}})
    assert r.status_code == 200 and r.json()["tree"]["top_k"] == 8
    step = client.post("/api/live/step", json={"session": r.json()["session"]})
    assert step.status_code == 200 and step.json()["record"]["tree"]["size"] <= 8
    for field, value in (("k", 10**6), ("max_new_tokens", 10**9), ("temperature", 1e300), ("temperature", -1)):
        r = client.post("/api/live/start", json={"prompt": "ab", "drafter": model_dirs[1], field: value})
        assert r.status_code == 422 and field in r.text, (field, r.text)
