"""Sampled exactness with power, everywhere: the grid of `tests/exactness_harness.py` (every drafter family on the
torch and native backends, chains and trees with sampled and top-token children, every sampling setting on each
backend), and the proof that it has power: each standard wrong verification rule (`tests/verifier_mutants.py`)
fails the grid of every family on every backend. `benchmarks/exactness_mutants.py` prints the same as a table.

Each cell samples 3,000 sequences (6,000 where drafting starts a step late), checks that drafts were accepted and
rejected and that bonus tokens came, and compares the first tokens' joint distribution, and each position's
distribution after its most frequent prefix, with the target's exact ones (chi-square, p > 1e-4; seeded)."""

import pytest

import exactness_harness as grid
from verifier_mutants import MUTANTS

CELLS = grid.grid()
GROUPS = grid.groups()


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_every_cell_follows_the_targets_distribution(cell):
    grid.check(grid.run_cell(cell), cell)


@pytest.mark.parametrize("group", list(GROUPS), ids=[f"{f}-{b}" for f, b in GROUPS])
@pytest.mark.parametrize("mutant", MUTANTS)
def test_every_wrong_rule_fails_every_familys_grid(mutant, group):
    caught, how = grid.caught_by(GROUPS[group], mutant)
    assert caught, f"the '{mutant}' rule passes every cell of {group[0]} on {group[1]}"


def test_the_grid_covers_every_family_backend_shape_and_setting():
    """What docs/exactness.md claims is what runs (tests/test_docs checks the page against `grid.coverage()`)."""
    for backend in grid.BACKENDS:
        cells = [c for c in CELLS if c.backend == backend]
        assert {c.family for c in cells} == set(grid.FAMILIES)
        assert {c.setting for c in cells} == set(grid.SETTINGS)
        for family in grid.FAMILIES:
            shapes = {c.shape for c in cells if c.family == family}
            assert "chain" in shapes and any(s.startswith("tree") for s in shapes), (family, backend)


def test_the_docs_show_the_grid_that_runs():
    """docs/exactness.md's grid table is generated from the grid: a claim cannot outgrow the tests."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "exactness.md").read_text()
    shown = page.split("<!-- grid:start -->\n", 1)[1].split("\n<!-- grid:end -->", 1)[0]
    assert shown == grid.coverage_markdown(), "regenerate the table: print(exactness_harness.coverage_markdown())"
