"""Mutation testing of the decision code: runs mutmut (configured in pyproject.toml's
[tool.mutmut]), prints the score per module and every surviving mutant, and fails when a
score is below its floor ([tool.appliance.mutation] in pyproject.toml).

    .venv/bin/python scripts/mutation.py              # run, report, check the floors
    .venv/bin/python scripts/mutation.py --report     # report the last run only
    .venv/bin/mutmut show NAME                        # the diff of one surviving mutant

The score is killed / reached: a mutant no selected test runs ("no tests") is not reached
and is listed apart; one that makes a test time out counts as killed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
KILLED = {1, 3, 36, 24, -24, 152, 255}
"""mutmut's exit codes for a mutant a test noticed (a failure, or a timeout)."""
SURVIVED = 0
NOT_REACHED = {5, 33}


@dataclass
class ModuleScore:
    module: str
    killed: int = 0
    survived: list[str] = field(default_factory=list)
    not_reached: list[str] = field(default_factory=list)
    other: Counter[int] = field(default_factory=Counter)

    @property
    def reached(self) -> int:
        return self.killed + len(self.survived) + sum(self.other.values())

    @property
    def score(self) -> float:
        return 100.0 * self.killed / self.reached if self.reached else 100.0


def read_scores(mutants: Path = MUTANTS) -> list[ModuleScore]:
    """Each mutated module's tally, from the `.meta` files mutmut leaves beside its copies."""
    scores = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if not codes:
            continue
        tally = ModuleScore(str(meta.relative_to(mutants)).removesuffix(".meta"))
        for name, code in sorted(codes.items()):
            if code in KILLED:
                tally.killed += 1
            elif code == SURVIVED:
                tally.survived.append(name)
            elif code in NOT_REACHED:
                tally.not_reached.append(name)
            else:  # not run (None), a crash of the runner, ...: counts against the score
                tally.other[code] += 1
        scores.append(tally)
    return scores


def floors() -> dict[str, float]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(config["tool"]["appliance"]["mutation"])


def check(scores: list[ModuleScore], limits: dict[str, float]) -> list[str]:
    """What is below its floor: the total ("total"), any module ("module"), or a module
    named by its path."""
    killed = sum(s.killed for s in scores)
    reached = sum(s.reached for s in scores)
    total = 100.0 * killed / reached if reached else 100.0
    failures = []
    if total < limits["total"]:
        failures.append(f"total {total:.2f} % < floor {limits['total']} %")
    for s in scores:
        floor = limits.get(s.module, limits["module"])
        if s.score < floor:
            failures.append(f"{s.module} {s.score:.2f} % < floor {floor} %")
    return failures


def report(scores: list[ModuleScore]) -> str:
    lines = [f"{'module':58} {'killed':>7} {'survived':>8} {'not run':>7} {'score':>7}"]
    for s in scores:
        lines.append(
            f"{s.module:58} {s.killed:7} {len(s.survived):8} {len(s.not_reached):7} {s.score:6.2f}%"
        )
    killed = sum(s.killed for s in scores)
    reached = sum(s.reached for s in scores)
    survived = sum(len(s.survived) for s in scores)
    lines.append(
        f"{'total':58} {killed:7} {survived:8} "
        f"{sum(len(s.not_reached) for s in scores):7} "
        f"{100.0 * killed / max(reached, 1):6.2f}%"
    )
    names = [n for s in scores for n in s.survived]
    if names:
        lines += ["", "surviving mutants (`mutmut show NAME` for the diff):", *names]
    return "\n".join(lines)


def run_mutmut() -> None:
    # From scratch: mutmut reuses the `mutants/` of an earlier run, and with it that run's
    # record of which tests reach which function, so a new function's mutants would run
    # against no test that calls it and pass as survivors.
    shutil.rmtree(MUTANTS, ignore_errors=True)
    mutmut = Path(sys.executable).parent / "mutmut"
    children = str(max(os.cpu_count() or 1, 1))
    done = subprocess.run(
        [str(mutmut), "run", "--max-children", children],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"mutation: mutmut run failed ({done.returncode}):\n{done.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="report the last run only")
    args = parser.parse_args()
    if not args.report:
        run_mutmut()
    scores = read_scores()
    if not scores:
        print("mutation: no results; run without --report first", file=sys.stderr)
        return 2
    print(report(scores))
    failures = check(scores, floors())
    for failure in failures:
        print(f"mutation: below the floor: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
