"""Which wrong verification rules the exactness grid catches: mutant x (drafter family, backend), caught or not.

    .venv/bin/python benchmarks/exactness_mutants.py                    # every mutant, every family and backend
    .venv/bin/python benchmarks/exactness_mutants.py --mutants "residual p" --families medusa --out table.md

For each standard wrong rule (`tests/verifier_mutants.py`) installed in the engine, the cells of a family on a
backend (`tests/exactness_harness.py`) run until one fails its chi-square (p <= the grid's threshold) or fails
outright (a mutant may draw from an empty distribution); the cell says "caught" with the cell's shape and
p-value, or "NOT CAUGHT" when every cell passed. The grid itself must pass with the correct rule: it is run
first. Every cell of the table must say caught.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import exactness_harness as grid  # noqa: E402
import verifier_mutants as mutants  # noqa: E402


def table(selected_mutants: list[str], groups: dict[tuple[str, str], list[grid.Cell]]) -> tuple[list[str], bool]:
    header = "| mutant | " + " | ".join(f"{f} ({b})" for f, b in groups) + " |"
    lines = [header, "|" + "---|" * (len(groups) + 1)]
    every = True
    for mutant in selected_mutants:
        row = []
        for key, cells in groups.items():
            if not grid.applicable(mutant, cells):
                row.append("n/a")
                continue
            ok, how = grid.caught_by(cells, mutant)
            every &= ok
            row.append(f"caught ({how})" if ok else how)
            print(f"{mutant:16s} {key[0]:17s} {key[1]:7s} {row[-1]}", flush=True)
        name = mutant.replace("|", "\\|")  # a bare pipe would end the table cell
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines, every


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", default=",".join(mutants.MUTANTS), help="comma-separated (default: all)")
    ap.add_argument("--families", default=",".join(grid.FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--backends", default=",".join(grid.BACKENDS), help="comma-separated (default: all)")
    ap.add_argument("--skip-correct", action="store_true", help="do not run the grid with the correct rule first")
    ap.add_argument("--out", help="write the table (markdown) here")
    args = ap.parse_args(argv)
    families, backends = args.families.split(","), args.backends.split(",")
    cells = [c for c in grid.grid() if c.family in families and c.backend in backends]
    started = time.monotonic()
    if not args.skip_correct:
        for cell in cells:
            grid.check(grid.run_cell(cell), cell)
        print(f"the correct rule passes all {len(cells)} cells ({time.monotonic() - started:.0f} s)", flush=True)
    groups: dict[tuple[str, str], list[grid.Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.family, cell.backend), []).append(cell)
    lines, every = table(args.mutants.split(","), groups)
    print("\n".join(lines))
    print(f"{'every mutant caught' if every else 'SOME MUTANTS NOT CAUGHT'} ({time.monotonic() - started:.0f} s)")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if every else 1


if __name__ == "__main__":
    raise SystemExit(main())
