"""Tasks: fan-out trees (parent -> children) with status, deadline slack, tokens and cost,
and each task's KV: what its sessions inherited from the parent, their own (branch-local),
and what its end reclaimed when.

The tree is rebuilt only when a task appears, goes, or moves; otherwise each snapshot just
relabels the nodes, so what the operator expanded or collapsed stays as it was.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Static, Tree
from textual.widgets.tree import TreeNode

from appliance.api.admin.schemas import AdminStateView, TaskStateView
from tui import format as fmt
from tui.screens.base import StateScreen

TOGGLE_STYLE = Style.from_meta({"toggle": True})
"""What Tree reads to make a click on the ▼/▶ icon toggle the node."""

STATUS_STYLE = {
    "open": "cyan",
    "succeeded": "green",
    "failed": "bold red",
    "cancelled": "yellow",
    "done": "dim",  # a one-turn task whose turn ended: no outcome
}


def task_label(t: TaskStateView, now: float) -> Text:
    label = Text(no_wrap=True, overflow="ellipsis")
    label.append(t.id, style="bold")
    if t.task_class:
        label.append(f" [{t.task_class}]", style="dim")
    label.append(f"  {t.status}", style=STATUS_STYLE.get(t.status, ""))
    if t.deadline_at is not None:
        slack = t.deadline_at - now
        style = "bold red" if slack < 0 else ("yellow" if slack < 10 else "")
        label.append(f"  slack {fmt.signed_seconds(slack)}", style=style)
    label.append(f"  {fmt.tokens(t.tokens)} tok")
    label.append(f"  cost {fmt.money(t.cost)}", style="" if t.cost is not None else "dim")
    if t.children:
        n = len(t.children)
        label.append(f"  ({n} {'child' if n == 1 else 'children'})", style="dim")
    if t.kv_inherited_tokens or t.kv_own_tokens:
        label.append(f"  kv {fmt.tokens(t.kv_inherited_tokens)} inherited", style="dim")
        label.append(f" · {fmt.tokens(t.kv_own_tokens)} own", style="magenta")
        label.append(f" ({fmt.tokens(t.kv_own_kept_tokens)} kept)", style="dim")
    if t.kv_reclaimed_tokens is not None:
        at = fmt.clock(t.kv_reclaimed_at)
        label.append(f"  reclaimed {fmt.tokens(t.kv_reclaimed_tokens)} at {at}", style="dim")
    return label


def roots_and_children(
    tasks: list[TaskStateView],
) -> tuple[list[TaskStateView], dict[str, list[str]]]:
    """Roots (no parent, or a parent not in the snapshot) and each task's present children,
    in the server's order; a task is placed once even if the data loops."""
    ids = {t.id for t in tasks}
    roots = [t for t in tasks if t.parent_id is None or t.parent_id not in ids]
    children = {t.id: [c for c in t.children if c in ids] for t in tasks}
    return roots, children


class TaskTreeWidget(Tree[str]):
    """Labels are drawn from the latest snapshot when a line is drawn, so a new snapshot
    costs one repaint of the visible lines, not a relabel of every node."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter,space", "toggle_node", "Expand/collapse"),
    ]

    def __init__(self, label: str, *, id: str | None = None) -> None:
        super().__init__(label, id=id)
        self.tasks: dict[str, TaskStateView] = {}
        self.now = 0.0

    def show(self, tasks: dict[str, TaskStateView], now: float) -> None:
        self.tasks, self.now = tasks, now
        self._updates += 1  # part of Tree's line-cache key: redraw the visible lines
        self.refresh()

    def render_label(self, node: TreeNode[str], base_style: Style, style: Style) -> Text:
        task = self.tasks.get(node.data) if node.data is not None else None
        label = task_label(task, self.now) if task is not None else self.process_label(node.label)
        label.stylize(style)
        if node.allow_expand:
            icon = self.ICON_NODE_EXPANDED if node.is_expanded else self.ICON_NODE
            return Text.assemble((icon, base_style + TOGGLE_STYLE), label)
        return label


class TasksScreen(StateScreen):
    TAB = "tasks"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("e", "expand_all", "Expand all"),
        Binding("c", "collapse_all", "Collapse all"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._shape: tuple[tuple[str, str | None, tuple[str, ...]], ...] | None = None
        self._task_nodes: dict[str, TreeNode[str]] = {}
        self._collapsed: set[str] = set()

    def compose_body(self) -> ComposeResult:
        yield Static(id="tasks-summary", classes="status")
        tree = TaskTreeWidget("tasks", id="tasks")
        tree.show_root = False
        tree.guide_depth = 3
        yield tree

    def on_mount(self) -> None:
        self.query_one(TaskTreeWidget).focus()

    @property
    def task_tree(self) -> TaskTreeWidget:
        return self.query_one(TaskTreeWidget)

    def update_body(self, state: AdminStateView) -> None:
        statuses = Counter(t.status for t in state.tasks)
        roots, children = roots_and_children(state.tasks)
        summary = f"{len(state.tasks):,} tasks · {len(roots):,} roots" + "".join(
            f" · {n:,} {status}" for status, n in sorted(statuses.items())
        )
        self.query_one("#tasks-summary", Static).update(summary, layout=False)
        shape = tuple((t.id, t.parent_id, tuple(children[t.id])) for t in state.tasks)
        by_id = {t.id: t for t in state.tasks}
        self.task_tree.show(by_id, state.time)
        if shape != self._shape:
            self._rebuild(roots, children, by_id)
            self._shape = shape

    def _rebuild(
        self,
        roots: list[TaskStateView],
        children: dict[str, list[str]],
        by_id: dict[str, TaskStateView],
    ) -> None:
        tree = self.task_tree
        cursor = tree.cursor_node.data if tree.cursor_node is not None else None
        for task_id, node in self._task_nodes.items():
            if not node.is_expanded and node.allow_expand:
                self._collapsed.add(task_id)
            else:
                self._collapsed.discard(task_id)
        tree.clear()
        self._task_nodes = {}
        placed: set[str] = set()

        def add(parent: TreeNode[str], task: TaskStateView) -> None:
            placed.add(task.id)
            kids = [by_id[c] for c in children[task.id] if c not in placed]
            if kids:
                node = parent.add(task.id, data=task.id)
                for kid in kids:
                    if kid.id not in placed:
                        add(node, kid)
                if task.id not in self._collapsed:
                    node.expand()
            else:
                node = parent.add_leaf(task.id, data=task.id)
            self._task_nodes[task.id] = node

        for root in roots:
            if root.id not in placed:
                add(tree.root, root)
        if cursor is not None and cursor in self._task_nodes:
            tree.move_cursor(self._task_nodes[cursor])

    def action_expand_all(self) -> None:
        self._collapsed.clear()
        self.task_tree.root.expand_all()

    def action_collapse_all(self) -> None:
        for child in self.task_tree.root.children:
            child.collapse_all()
