"""The agent workload generator: determinism, the shapes it promises, and the spec's errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.domain.errors import ConfigError
from appliance.workload import (
    SUBAGENT_TOOL,
    WorkloadSpec,
    generate,
    load_spec,
    load_trace_workload,
    parse_spec,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "workload.yaml"


def spec_with(**changes: Any) -> WorkloadSpec:
    data = WorkloadSpec().model_dump()
    data.update(changes)
    return parse_spec(data)


def test_the_documented_file_holds_the_built_in_defaults() -> None:
    assert load_spec(CONFIG) == WorkloadSpec()


def _keys(node: object, names_below: bool = False) -> set[str]:
    """Every key of the YAML tree; the keys of `tool_classes` and `tools` are names, not keys."""
    out: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            if not names_below:
                out.add(str(k))
            out |= _keys(v, names_below=k in ("tool_classes", "tools"))
    elif isinstance(node, list):
        for v in node:
            out |= _keys(v)
    return out


def test_every_key_of_the_documented_file_is_explained_in_a_comment() -> None:
    text = CONFIG.read_text()
    comments = " ".join(line for line in text.splitlines() if line.strip().startswith("#"))
    words = set(re.split(r"[\s`,\[\]{}():]+", comments))
    lines = text.splitlines()
    commented_above = {
        line.strip().removeprefix("- ").split(":")[0]
        for above, line in itertools.pairwise(lines)
        if above.strip().startswith("#") and not line.strip().startswith("#")
    }
    keys = _keys(yaml.safe_load(text))
    assert not sorted(k for k in keys if k not in words and k not in commented_above)


def test_the_same_seed_gives_the_same_workload() -> None:
    spec = WorkloadSpec()
    assert generate(spec, root_tasks=200) == generate(spec, root_tasks=200)
    assert generate(spec, root_tasks=50, seed=9) == generate(spec, root_tasks=50, seed=9)


def test_a_different_seed_gives_a_different_workload() -> None:
    spec = WorkloadSpec()
    assert generate(spec, root_tasks=50, seed=1) != generate(spec, root_tasks=50, seed=2)


def test_a_task_does_not_depend_on_how_many_tasks_are_generated() -> None:
    spec = WorkloadSpec()
    assert generate(spec, root_tasks=300).trees[:40] == generate(spec, root_tasks=40).trees


def test_turns_per_task_have_a_heavy_tail() -> None:
    spec = spec_with(max_context_tokens=10_000_000)
    trees = generate(spec, root_tasks=3000).trees
    turns = [len(t.root.turns) for t in trees if t.root.task_class == "coding"]
    q = statistics.quantiles(turns, n=100)
    p50, p99 = q[49], q[98]
    assert 10 <= p50 <= 20  # tens of turns, as the file's sources say
    assert p99 >= 5 * p50
    assert max(turns) >= 100


def test_observations_and_outputs_follow_their_medians() -> None:
    spec = spec_with(max_context_tokens=10_000_000)
    turns = [x for t in generate(spec, root_tasks=2000).tasks for x in t.turns]
    coding = spec.task_classes[0]
    outputs = [x.output_tokens for x in turns]
    assert 0.5 * coding.output_tokens.median < statistics.median(outputs) < 2 * 200


def test_fan_out_children_share_the_parents_prefix_tenant_and_class() -> None:
    trees = generate(WorkloadSpec(), root_tasks=1000).trees
    fanned = [t for t in trees if t.children]
    assert fanned
    for tree in fanned:
        root = tree.root
        spawning = [turn for turn in root.turns if turn.spawns]
        assert len(spawning) == 1 and spawning[0].tool_class == SUBAGENT_TOOL
        assert spawning[0] is not root.turns[-1]
        assert set(spawning[0].spawns) == {c.task_id for c in tree.children}
        for child in tree.children:
            assert child.parent_id == root.task_id
            assert (child.prefix_id, child.shared_prefix_tokens) == (
                root.prefix_id,
                root.shared_prefix_tokens,
            )
            assert (child.tenant, child.task_class) == (root.tenant, root.task_class)
            assert child.deadline_s is None
            assert not any(turn.spawns for turn in child.turns)


def test_tasks_of_a_class_share_their_prefix_variants() -> None:
    trees = generate(WorkloadSpec(), root_tasks=500).trees
    prefixes = {(t.root.prefix_id, t.root.shared_prefix_tokens) for t in trees}
    assert {p for p, _ in prefixes} == {"coding/0", "coding/1", "assistant/0", "ops/0"}


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        ({"api": 1.0}, {"api"}),
        ({"test": 1.0, "human": 1.0}, {"test", "human"}),
        ({"file": 1.0, "search": 0.0}, {"file"}),
    ],
)
def test_tool_classes_are_drawn_from_the_class_weights(
    tools: dict[str, float], expected: set[str]
) -> None:
    data = WorkloadSpec().model_dump()
    for c in data["task_classes"]:
        c["tools"] = tools
        c["fanout"] = None
    trees = generate(parse_spec(data), root_tasks=300).trees
    drawn = Counter(x.tool_class for t in trees for x in t.root.turns if x.tool_class)
    assert set(drawn) == expected
    if len(expected) == 2:
        a, b = (drawn[k] for k in expected)
        assert 0.8 < a / b < 1.25


def test_tool_waits_stay_within_their_class_bounds() -> None:
    spec = WorkloadSpec()
    for task in generate(spec, root_tasks=500).tasks:
        for turn in task.turns:
            if turn.tool_class and turn.tool_class != SUBAGENT_TOOL:
                dist = spec.tool_classes[turn.tool_class]
                assert dist.min <= turn.tool_wait_s <= dist.max
        last = task.turns[-1]
        if last.tool_class is not None:  # abandoned: the tool call is never answered
            assert spec.tool_classes[last.tool_class].abandoned > 0 and not task.succeeds
        else:
            assert last.tool_wait_s == 0


def test_sessions_are_abandoned_only_after_classes_that_abandon_at_about_their_share() -> None:
    spec = WorkloadSpec()
    calls: Counter[str] = Counter()
    ended: Counter[str] = Counter()
    for task in generate(spec, root_tasks=2000).tasks:
        for turn in task.turns:
            if turn.tool_class and turn.tool_class != SUBAGENT_TOOL:
                calls[turn.tool_class] += 1
        if task.turns[-1].tool_class is not None:
            ended[task.turns[-1].tool_class] += 1
    assert set(ended) <= {name for name, c in spec.tool_classes.items() if c.abandoned > 0}
    for name in ("human", "approval"):
        share = ended[name] / calls[name]
        assert abs(share - spec.tool_classes[name].abandoned) < 0.05


def test_no_task_passes_the_context_limit_and_those_stopped_by_it_fail() -> None:
    spec = spec_with(max_context_tokens=8000)
    tasks = generate(spec, root_tasks=500).tasks
    assert all(t.context_tokens <= 8000 for t in tasks)
    capped = [t for t in tasks if t.context_tokens > 6000 and len(t.turns) > 3]
    assert capped and sum(t.succeeds for t in capped) < len(capped)


def test_outcomes_deadlines_and_tenants_follow_their_rates() -> None:
    data = WorkloadSpec().model_dump()
    data["tenants"] = [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]
    data["max_context_tokens"] = 10_000_000
    for tool in data["tool_classes"].values():
        tool["abandoned"] = 0.0  # an abandoned task fails whatever its class's rate
    roots = [t.root for t in generate(parse_spec(data), root_tasks=4000).trees]
    tenants = Counter(r.tenant for r in roots)
    assert 2.5 < tenants["a"] / tenants["b"] < 3.5
    ops = [r for r in roots if r.task_class == "ops"]
    assert 0.6 < sum(r.succeeds for r in ops) / len(ops) < 0.8
    with_deadline = [r.deadline_s for r in ops if r.deadline_s is not None]
    assert 0.2 < len(with_deadline) / len(ops) < 0.4
    assert all(1800 <= d <= 7200 for d in with_deadline)
    starts = [r.start_s for r in roots]
    assert starts == sorted(starts)
    assert 0.4 < len(roots) / starts[-1] < 0.6  # root_tasks_per_s = 0.5


def test_prompt_tokens_grow_by_what_each_turn_adds() -> None:
    task = next(t for t in generate(WorkloadSpec(), root_tasks=20).tasks if len(t.turns) > 2)
    first = task.turns[0]
    assert task.prompt_tokens(0) == task.shared_prefix_tokens + first.appended_tokens
    step = first.output_tokens + task.turns[1].appended_tokens
    assert task.prompt_tokens(1) == task.prompt_tokens(0) + step


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"sed": 1}, "unknown key 'sed'"),
        ({"max_context_tokens": "lots"}, "max_context_tokens='lots' is invalid"),
        ({"root_tasks_per_s": 0}, "root_tasks_per_s=0 is invalid"),
        ({"tenants": [{"name": "a b"}]}, "tenants[0].name='a b' is invalid"),
        ({"tool_classes": {"subagent": {"median": 1, "p95": 2, "min": 0, "max": 3}}}, "reserved"),
        ({"tool_classes": {"api": {"median": 2, "p95": 1, "min": 0, "max": 3}}}, "p95 (1.0)"),
        ({"tool_classes": {"api": {"median": 1, "p95": 2, "min": 0}}}, "'tool_classes.api.max'"),
    ],
)
def test_bad_values_name_their_key(change: dict[str, Any], names: str) -> None:
    data = WorkloadSpec().model_dump()
    data.update(change)
    with pytest.raises(ConfigError) as err:
        parse_spec(data)
    assert names in err.value.message
    assert "\n" not in err.value.message


@pytest.mark.parametrize(
    ("path", "value", "names"),
    [
        (("turns", "median"), -1, "task_classes[1].turns.median=-1 is invalid"),
        (("tools",), {"teleport": 1.0}, "unknown tool class 'teleport'"),
        (("success_rate",), 1.5, "task_classes[1].success_rate=1.5 is invalid"),
        (("fanout", "max_children"), 1, "max_children (1) must be >= min_children"),
        (("fanout", "keep"), 0, "task_classes[1].fanout.keep=0 is invalid"),
        (("fanout", "keep"), 3, "keep (3) must be <= min_children (2)"),
        (("fanout", "keep"), 1.5, "task_classes[1].fanout.keep=1.5 is invalid"),
        (("colour",), "red", "unknown key 'task_classes[1].colour'"),
    ],
)
def test_bad_task_class_values_name_their_key(
    path: tuple[str, ...], value: object, names: str
) -> None:
    data = WorkloadSpec().model_dump()
    target = data["task_classes"][1]
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    with pytest.raises(ConfigError) as err:
        parse_spec(data)
    assert names in err.value.message


def test_a_file_that_is_not_yaml_or_not_there_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "w.yaml"
    bad.write_text("seed: [1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d"):
        load_spec(bad)
    with pytest.raises(ConfigError, match="cannot read it"):
        load_spec(tmp_path / "missing.yaml")
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_spec(bad)


def test_a_partial_file_keeps_the_other_defaults(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(yaml.safe_dump({"seed": 5}))
    spec = load_spec(f)
    assert spec.seed == 5 and spec.task_classes == WorkloadSpec().task_classes


def test_a_mooncake_trace_becomes_one_task_per_prefix_chain(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 700, "output_length": 5, "hash_ids": [0, 7]},
        {"timestamp": 4000, "input_length": 1800, "output_length": 20, "hash_ids": [0, 1, 2, 3]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trees = load_trace_workload(trace).trees
    assert [len(t.root.turns) for t in trees] == [2, 1]
    first = trees[0].root
    assert first.prefix_id == "trace/0" and first.shared_prefix_tokens == 512
    assert first.turns[0].tool_wait_s == 4.0 and first.turns[-1].tool_class is None
    assert first.prompt_tokens(1) == 1800
    assert trees[1].root.start_s == 0.5


def test_a_trace_line_that_is_not_a_request_names_its_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n{"x": 1}\n')
    with pytest.raises(ConfigError, match="line 2 is not a Mooncake request"):
        load_trace_workload(trace)


def _without_leads(spec: WorkloadSpec) -> WorkloadSpec:
    data = spec.model_dump()
    for tool in data["tool_classes"].values():
        tool["announce_lead_s"] = None
    return parse_spec(data)


def test_announcement_leads_are_drawn_apart_and_change_nothing_else() -> None:
    spec = WorkloadSpec()
    with_leads = generate(spec, root_tasks=100)
    without = generate(_without_leads(spec), root_tasks=100)
    assert all(t.announce_lead_s == 0 for x in without.tasks for t in x.turns)
    stripped = [
        [dataclasses.replace(t, announce_lead_s=0.0) for t in x.turns] for x in with_leads.tasks
    ]
    assert stripped == [list(x.turns) for x in without.tasks]


def test_a_lead_is_drawn_per_announced_call_and_never_passes_its_wait() -> None:
    spec = WorkloadSpec()
    turns = [t for x in generate(spec, root_tasks=300).tasks for t in x.turns]
    for turn in turns:
        tool = spec.tool_classes.get(turn.tool_class or "")
        if tool is None or tool.announce_lead_s is None:
            assert turn.announce_lead_s == 0
        else:
            lead = tool.announce_lead_s
            assert min(lead.min, turn.tool_wait_s) <= turn.announce_lead_s <= turn.tool_wait_s
    assert {t.tool_class for t in turns if t.announce_lead_s >= 0.2} >= {"test", "human"}


def test_a_fan_out_with_fork_context_marks_its_spawning_turn() -> None:
    data = WorkloadSpec().model_dump()
    for c in data["task_classes"]:
        if c["fanout"] is not None:
            c["fanout"]["fork_context"] = True
    trees = generate(parse_spec(data), root_tasks=300).trees
    spawning = [turn for t in trees for turn in t.root.turns if turn.spawns]
    assert spawning and all(turn.forks for turn in spawning)
    plain = generate(WorkloadSpec(), root_tasks=300).trees
    assert not any(turn.forks for t in plain for turn in t.root.turns)


def test_the_variant_files_differ_from_the_default_only_as_they_say() -> None:
    no_lead = load_spec(ROOT / "configs" / "workload-no-lead.yaml")
    assert no_lead == _without_leads(WorkloadSpec())
    fanout = load_spec(ROOT / "configs" / "workload-fanout.yaml")
    assert fanout.tool_classes == WorkloadSpec().tool_classes
    assert all(c.fanout is not None and c.fanout.fork_context for c in fanout.task_classes)


def _keeping_all(spec: WorkloadSpec) -> WorkloadSpec:
    data = spec.model_dump()
    for c in data["task_classes"]:
        if c["fanout"] is not None:
            c["fanout"]["keep"] = None
    return parse_spec(data)


def test_a_fan_out_may_keep_as_many_children_as_its_fewest() -> None:
    data = WorkloadSpec().model_dump()
    data["task_classes"][1]["fanout"]["keep"] = 2  # min_children 2
    assert parse_spec(data).task_classes[1].fanout.keep == 2  # type: ignore[union-attr]


def test_a_fan_out_that_keeps_one_child_discards_the_others_and_changes_nothing_else() -> None:
    """The default coding class keeps one child's result (configs/workload.yaml, [AL]); which
    one is drawn on a stream of its own, so the workload is the one `keep: null` draws."""
    spec = WorkloadSpec()
    assert [c.fanout.keep if c.fanout else None for c in spec.task_classes] == [1, None, None]
    keeping = generate(spec, root_tasks=400)
    kept_at = []
    for tree in keeping.trees:
        for turn in tree.root.turns:
            if not turn.spawns:
                assert not turn.discards
            elif tree.root.task_class == "coding":
                kept = [c for c in turn.spawns if c not in turn.discards]
                assert len(kept) == 1 and set(turn.discards) < set(turn.spawns)
                kept_at.append(turn.spawns.index(kept[0]))
            else:
                assert turn.discards == ()
    assert len(kept_at) >= 10 and len(set(kept_at)) > 1  # drawn, not always the first
    plain = generate(_keeping_all(spec), root_tasks=400)
    assert not any(turn.discards for task in plain.tasks for turn in task.turns)
    stripped = [
        dataclasses.replace(t, turns=tuple(dataclasses.replace(u, discards=()) for u in t.turns))
        for t in keeping.tasks
    ]
    assert stripped == list(plain.tasks)
    assert generate(spec, root_tasks=400) == keeping  # the same draw every time
