"""The agent workload's parameters: `configs/workload.yaml`, checked into one spec.

Model of the world: a workload is a mix of task classes (coding agents, tool-using
assistants, operations workflows), each with its shared prefix, its distributions of turns,
appended observation tokens and output tokens, the tools it calls, its outcome rates, an
optional deadline and an optional fan-out of child tasks; tenants share the mix by weight.
Every count and duration is a lognormal given by its median and 95th percentile, clipped to
[min, max]: the shape agent traces show (most steps short, a heavy tail of long ones).

The defaults below are the same values `configs/workload.yaml` documents with their sources
(a test checks the two agree), so an installed appliance without the repository's configs/
generates the same workload. Unknown keys and bad values raise `ConfigError` with one line
that names the key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from appliance.domain.errors import ConfigError
from appliance.workload.model import SUBAGENT_TOOL

Z95 = 1.6448536269514722
"""The standard normal's 95th percentile: sigma = ln(p95 / median) / Z95."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Dist(_Strict):
    """A lognormal by its median and 95th percentile, clipped to [min, max]."""

    median: float = Field(gt=0)
    """Middle value."""
    p95: float = Field(gt=0)
    """95th percentile (>= median; equal: no spread)."""
    min: float = Field(ge=0)
    """Smallest value drawn."""
    max: float = Field(gt=0)
    """Largest value drawn."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.p95 < self.median:
            raise ValueError(f"p95 ({self.p95}) must be >= median ({self.median})")
        if not self.min <= self.median <= self.max:
            raise ValueError(
                f"median ({self.median}) must lie within [min, max] = [{self.min}, {self.max}]"
            )
        return self

    @property
    def sigma(self) -> float:
        return math.log(self.p95 / self.median) / Z95


class ToolClass(Dist):
    """How long one call of a tool runs, and how often the session never comes back."""

    abandoned: float = Field(default=0.0, ge=0, le=1)
    """Share of calls after which the session never returns: the task ends unfinished,
    its client giving up when the drawn wait is over."""
    announce_lead_s: Dist | None = None
    """How long before the session's next turn the client announces the call's end
    (`tool_finished`), drawn per call and at most the call's wait; None: never early (the
    announcement comes with the turn)."""


class Tenant(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    """Tenant name; the benchmark sends its turns with the API key of this name."""
    weight: float = Field(default=1.0, gt=0)
    """Share of root tasks (relative to the other tenants)."""


class Deadline(_Strict):
    probability: float = Field(ge=0, le=1)
    """Share of tasks that carry a deadline."""
    min_s: float = Field(gt=0)
    """Shortest deadline (uniform between min_s and max_s)."""
    max_s: float = Field(gt=0)
    """Longest deadline."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.max_s < self.min_s:
            raise ValueError(f"max_s ({self.max_s}) must be >= min_s ({self.min_s})")
        return self


class Fanout(_Strict):
    probability: float = Field(ge=0, le=1)
    """Share of root tasks that fan out once, after a turn drawn uniformly before the last."""
    min_children: int = Field(ge=1)
    """Fewest children of a fan-out."""
    max_children: int = Field(ge=1)
    """Most children of a fan-out."""
    child_turns: Dist
    """Turns of each child task."""
    fork_context: bool = False
    """Children start from the parent's whole conversation so far (a branch of it: its
    exact blocks), not only from its prefix."""
    keep: int | None = Field(default=None, ge=1)
    """Children whose results the parent keeps when it joins them (a best-of-n
    orchestrator keeps 1); the others are discarded branches, drawn from the workload's
    seed. None: it keeps them all. At most `min_children`."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.max_children < self.min_children:
            raise ValueError(
                f"max_children ({self.max_children}) must be >= min_children ({self.min_children})"
            )
        if self.keep is not None and self.keep > self.min_children:
            raise ValueError(
                f"keep ({self.keep}) must be <= min_children ({self.min_children}): a fan-out "
                "keeps at most the children it has"
            )
        return self


class TaskClass(_Strict):
    name: str = Field(min_length=1, max_length=64)
    """Task class name (the ledger's task_class)."""
    weight: float = Field(gt=0)
    """Share of root tasks (relative to the other classes)."""
    prefix_tokens: int = Field(ge=0)
    """System prompt plus tool schemas, shared by every task of the class with the same variant."""
    prefix_variants: int = Field(default=1, ge=1)
    """Distinct prefixes in the class (agent configurations); each task draws one."""
    statement_tokens: Dist
    """The task statement: turn 0's appended tokens."""
    turns: Dist
    """Model calls per task."""
    observation_tokens: Dist
    """A tool's result appended before the next turn."""
    output_tokens: Dist
    """Tokens generated per turn."""
    tools: dict[str, float] = Field(min_length=1)
    """Tool class -> weight of being the tool after a turn."""
    success_rate: float = Field(ge=0, le=1)
    """Share of tasks that succeed (a task stopped by the context limit fails)."""
    verified_rate: float = Field(ge=0, le=1)
    """Share of outcomes that a check verified (tests ran, a reviewer approved)."""
    deadline: Deadline | None = None
    """Deadlines; null: none."""
    fanout: Fanout | None = None
    """Child tasks sharing the parent's prefix; null: none."""

    @model_validator(mode="after")
    def _weights(self) -> Self:
        for tool, weight in self.tools.items():
            if weight < 0:
                raise ValueError(f"tools.{tool}: weight must be >= 0, not {weight}")
        if sum(self.tools.values()) <= 0:
            raise ValueError("tools: at least one weight must be > 0")
        return self


def _d(median: float, p95: float, lo: float, hi: float) -> Dist:
    return Dist(median=median, p95=p95, min=lo, max=hi)


def _tool(wait: Dist, *, abandoned: float = 0.0, announce_lead_s: Dist | None = None) -> ToolClass:
    return ToolClass(**wait.model_dump(), abandoned=abandoned, announce_lead_s=announce_lead_s)


def _default_tool_classes() -> dict[str, ToolClass]:
    return {
        "api": _tool(_d(0.5, 2.0, 0.05, 30), announce_lead_s=_d(0.3, 1.0, 0.2, 5)),
        "file": _tool(_d(0.05, 1.0, 0.001, 20)),
        "search": _tool(_d(1.5, 10.0, 0.1, 60), announce_lead_s=_d(0.5, 2.0, 0.2, 5)),
        "test": _tool(_d(30, 120, 5, 1800), announce_lead_s=_d(1.0, 5.0, 0.2, 20)),
        "human": _tool(
            _d(120, 900, 5, 3600), abandoned=0.1, announce_lead_s=_d(8.0, 30.0, 1.0, 120)
        ),
        "approval": _tool(
            _d(600, 7200, 30, 14400), abandoned=0.2, announce_lead_s=_d(1.0, 5.0, 0.2, 30)
        ),
    }


def _default_task_classes() -> list[TaskClass]:
    return [
        TaskClass(
            name="coding",
            weight=0.5,
            prefix_tokens=6000,
            prefix_variants=2,
            statement_tokens=_d(500, 2000, 50, 6000),
            turns=_d(15, 60, 1, 150),
            observation_tokens=_d(250, 2500, 5, 8000),
            output_tokens=_d(120, 500, 1, 2000),
            tools={"file": 0.45, "test": 0.2, "search": 0.15, "api": 0.15, "human": 0.05},
            success_rate=0.5,
            verified_rate=0.9,
            deadline=Deadline(probability=0.25, min_s=900, max_s=3600),
            fanout=Fanout(
                probability=0.1,
                min_children=2,
                max_children=4,
                child_turns=_d(6, 20, 1, 40),
                keep=1,
            ),
        ),
        TaskClass(
            name="assistant",
            weight=0.35,
            prefix_tokens=3000,
            prefix_variants=1,
            statement_tokens=_d(150, 800, 10, 4000),
            turns=_d(4, 15, 1, 40),
            observation_tokens=_d(600, 4000, 10, 8000),
            output_tokens=_d(200, 700, 1, 2000),
            tools={"search": 0.5, "api": 0.4, "file": 0.05, "human": 0.05},
            success_rate=0.8,
            verified_rate=0.3,
            deadline=Deadline(probability=0.5, min_s=60, max_s=600),
            fanout=Fanout(
                probability=0.15, min_children=2, max_children=5, child_turns=_d(3, 8, 1, 20)
            ),
        ),
        TaskClass(
            name="ops",
            weight=0.15,
            prefix_tokens=4000,
            prefix_variants=1,
            statement_tokens=_d(300, 1200, 20, 4000),
            turns=_d(8, 25, 1, 60),
            observation_tokens=_d(300, 1500, 5, 6000),
            output_tokens=_d(100, 400, 1, 1500),
            tools={"api": 0.6, "human": 0.1, "approval": 0.15, "test": 0.15},
            success_rate=0.7,
            verified_rate=0.8,
            deadline=Deadline(probability=0.3, min_s=1800, max_s=7200),
            fanout=None,
        ),
    ]


class WorkloadSpec(_Strict):
    seed: int = 1
    """Seed of every draw: the same seed and spec give the same workload."""
    max_context_tokens: int = Field(default=30_000, ge=64)
    """A task ends (failed) before a turn whose prompt plus output would pass this."""
    root_tasks_per_s: float = Field(default=0.5, gt=0)
    """Open-loop arrival rate of root tasks (Poisson), used by replay; the benchmark runs a
    fixed number of concurrent tasks instead."""
    tenants: list[Tenant] = Field(default_factory=lambda: [Tenant(name="default")], min_length=1)
    """Tenants and their shares of root tasks."""
    tool_classes: dict[str, ToolClass] = Field(default_factory=_default_tool_classes, min_length=1)
    """Tool class -> how long one call runs, in seconds, and how often its session ends."""
    task_classes: list[TaskClass] = Field(default_factory=_default_task_classes, min_length=1)
    """The task mix."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if SUBAGENT_TOOL in self.tool_classes:
            raise ValueError(
                f"tool_classes.{SUBAGENT_TOOL}: the name is reserved for fan-out turns"
            )
        for what, names in (
            ("tenants", [t.name for t in self.tenants]),
            ("task_classes", [c.name for c in self.task_classes]),
        ):
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"{what}: name {sorted(dup)[0]!r} appears more than once")
        for i, c in enumerate(self.task_classes):
            unknown = sorted(set(c.tools) - set(self.tool_classes))
            if unknown:
                raise ValueError(
                    f"task_classes[{i}].tools: unknown tool class {unknown[0]!r}; "
                    f"known: {', '.join(self.tool_classes)}"
                )
            floor = c.prefix_tokens + c.statement_tokens.min + c.output_tokens.min
            if floor > self.max_context_tokens:
                raise ValueError(
                    f"task_classes[{i}] ({c.name}): prefix_tokens + statement_tokens.min + "
                    f"output_tokens.min = {floor:g} exceeds max_context_tokens "
                    f"({self.max_context_tokens})"
                )
        return self


def parse_spec(data: Any, *, source: str = "workload") -> WorkloadSpec:
    """A spec from already-parsed YAML; ConfigError names the bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, not {data!r}")
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, source)) from None


def load_spec(path: str | Path) -> WorkloadSpec:
    """`configs/workload.yaml` or any file of the same keys."""
    path = Path(path)
    source = f"workload {path}"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    return parse_spec(data, source=source)


def _key(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _one_line(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = _key(loc)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown key '{key}'; remove it or check configs/workload.yaml"
    if err["type"] == "missing":
        return f"{source}: key '{key}' is required; see configs/workload.yaml"
    if err["type"].startswith("value_error") and not isinstance(err.get("input"), int | float):
        where = f"{key}: " if loc else ""
        return f"{source}: {where}{message}"
    return f"{source}: {key}={err.get('input')!r} is invalid: {message}"
