"""The exactness grid's power (`tests/test_exactness_grid.py` runs the grid itself): each standard wrong verification
rule (`tests/verifier_mutants.py`) fails the grid of every drafter family on every backend. A file of its own so
that test workers (`scripts/test.sh`, one per CPU, whole files each) run the grid and its power side by side."""

import pytest

import exactness_harness as grid
from test_exactness_grid import marked
from verifier_mutants import MUTANTS

GROUPS = grid.groups()


@pytest.mark.parametrize("group", [pytest.param(g, id=f"{g[0]}-{g[1]}", marks=marked(g[1])) for g in GROUPS])
@pytest.mark.parametrize("mutant", MUTANTS)
def test_every_wrong_rule_fails_every_familys_grid(mutant, group):
    caught, how = grid.caught_by(GROUPS[group], mutant)
    assert caught, f"the '{mutant}' rule passes every cell of {group[0]} on {group[1]}"
