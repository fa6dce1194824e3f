"""A Responses API request's function tools and tool choice as the chat ones vLLM 0.32 renders
and parses with (`construct_tool_dicts`, `ResponsesRequest.check_tool_usage`).

Tools: each `{"type": "function", "name", "description", "parameters", ...}` becomes
`{"type": "function", "function": {"name", "description", "parameters"}}` (description and
parameters null when absent; `strict` and `defer_loading` kept when set), in the request's
order; the template renders them into the prompt. Other tool types are not rendered here
(vLLM drops hosted tools too; its namespace and custom tools, which it renders as
functions, are not modelled). A request without function tools renders none.

Tool choice (what the tool-call parser honours): without tools "auto" and "none" are "none",
"required" and a named tool refused; with tools "auto", "required" and "none" stay, a named
function `{"type": "function", "name"}` becomes chat's `{"type": "function", "function":
{"name"}}` (a name no tool has refused), and any other choice calls nothing ("none").
"""

from __future__ import annotations

from typing import Any

from appliance.domain.responses_input import ResponsesInputError

_KEPT_IF_SET = ("strict", "defer_loading")


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's function tools in chat's shape, or None when it has none."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ResponsesInputError("'tools' must be a list of tool objects", "tools")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if tool.get("type") != "function":
            continue
        if not isinstance(tool.get("name"), str):
            raise ResponsesInputError("a function tool needs a string 'name'", "tools")
        function = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
        }
        function |= {k: tool[k] for k in _KEPT_IF_SET if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(body: dict[str, Any]) -> str | dict[str, Any]:
    """The request's `tool_choice` as a chat request's (module docstring)."""
    tools = body.get("tools")
    choice: Any = body.get("tool_choice")
    choice = "auto" if choice is None else choice
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not isinstance(tools, list) or not tools:
        if choice == "required":
            raise ResponsesInputError(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
            )
        if named:
            raise ResponsesInputError(
                "Tool choice 'function' not found in 'tools' parameter.", "tool_choice"
            )
        return "none"
    if named:
        name = choice.get("name")
        if not name or name not in {t.get("name") for t in tools if isinstance(t, dict)}:
            raise ResponsesInputError(
                "Tool choice 'function' not found in 'tools' parameter.", "tool_choice"
            )
        return {"type": "function", "function": {"name": name}}
    return choice if choice in ("auto", "required", "none") else "none"
