"""Sampled exactness with power, everywhere: the grid of `tests/exactness_harness.py` (every drafter family on the
torch and native backends and every family llama.cpp can run on it, chains and trees with sampled and top-token
children, every sampling setting on each backend), and the proof that it has power: each standard wrong
verification rule (`tests/verifier_mutants.py`) fails the grid of every family on every backend
(tests/test_exactness_grid_power.py, a file of its own so that the two halves run on two test workers).
`benchmarks/exactness_mutants.py` prints the same as a table.

Each cell samples 3,000 sequences (6,000 where drafting starts a step late), checks that drafts were accepted and
rejected and that bonus tokens came, and compares the first tokens' joint distribution, and each position's
distribution after its most frequent prefix, with the target's exact ones (chi-square, p > 1e-4; seeded)."""

import pytest

import exactness_harness as grid
from verispec.models.runners.llamacpp import llamacpp_available

CELLS = grid.grid()
# the llama.cpp backend is an optional extra that scripts/test.sh installs (scripts/install-llamacpp.sh)
needs_llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")


def marked(backend: str) -> list:
    return [needs_llamacpp] if backend == "llama.cpp" else []


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id, marks=marked(c.backend)) for c in CELLS])
def test_every_cell_follows_the_targets_distribution(cell):
    grid.check(grid.run_cell(cell), cell)


def test_the_grid_covers_every_family_backend_shape_and_setting():
    """What docs/exactness.md claims is what runs (tests/test_docs checks the page against `grid.coverage()`)."""
    for backend in grid.BACKENDS:
        cells = [c for c in CELLS if c.backend == backend]
        runs = {f for f in grid.FAMILIES if (backend, f) not in grid.UNSUPPORTED}
        assert {c.family for c in cells} == runs
        assert {c.setting for c in cells} == set(grid.SETTINGS)
        for family in runs:
            shapes = {c.shape for c in cells if c.family == family}
            assert "chain" in shapes and any(s.startswith("tree") for s in shapes), (family, backend)


@needs_llamacpp
@pytest.mark.parametrize("backend, family", list(grid.UNSUPPORTED))
def test_the_families_left_out_of_a_backend_are_refused_there(backend, family):
    """A family the grid leaves out of a backend is one the engine refuses there, with one clear line."""
    from verispec.errors import VerispecError

    target = grid.BACKENDS[backend](grid.target_model())
    with pytest.raises(VerispecError, match="hidden states|skips sublayers"):
        grid.FAMILIES[family](target, backend)


def test_the_docs_show_the_grid_that_runs():
    """docs/exactness.md's grid table is generated from the grid: a claim cannot outgrow the tests."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "exactness.md").read_text()
    shown = page.split("<!-- grid:start -->\n", 1)[1].split("\n<!-- grid:end -->", 1)[0]
    assert shown == grid.coverage_markdown(), "regenerate the table: print(exactness_harness.coverage_markdown())"
