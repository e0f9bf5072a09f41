"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request.

The tools go to the chat template (``tools=[...]``, as Hugging Face templates take them).
What the model writes is read by the family's parser (``tool_parsers.py``). With
``tool_choice`` ``required`` or a named function, the output is held to the family's
call format by a grammar (an xgrammar structural tag: the call's fixed text, then its
arguments by the tool's parameter schema), so even a tiny model answers with a call
that parses; with ``auto`` the model may answer or call; with ``none`` no parser runs.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from llmctl.engine.sampling_params import StructuredOutput
from llmctl.errors import InvalidRequest
from llmctl.server.protocol_base import Strict

MAX_TOOLS = 128
NAME_PATTERN = r"^[a-zA-Z0-9_.-]{1,64}$"  # OpenAI's rule for function names

# Each family's call, as the grammar writes it: the text before the arguments (with
# the name filled in), and after them; calls are separated by ``separator``.
_CALL_FORMATS = {
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": ('{{"name": {name}, "parameters": ', "}", "; "),
    "mistral": ('[TOOL_CALLS][{{"name": {name}, "arguments": ', "}]", ""),
}


class FunctionDefinition(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="A JSON Schema of the arguments.",
    )
    strict: bool | None = Field(None, description="Accepted; arguments follow it under a grammar.")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def forced_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools a grammar must hold the output to (none for ``auto``/``none``)."""
    if isinstance(choice, NamedToolChoice):
        named = [tool for tool in tools if tool.function.name == choice.function.name]
        if not named:
            known = ", ".join(tool.function.name for tool in tools) or "none"
            raise InvalidRequest(
                f"tool_choice names the function {choice.function.name!r}, which is not "
                f"among the tools (known: {known})",
                param="tool_choice",
                code="invalid_combination",
            )
        return named
    return list(tools) if choice == "required" else []


def call_grammar(tools: list[Tool], family: str, parallel: bool) -> StructuredOutput:
    """A structural tag: one call (or, with ``parallel``, one or more) of ``tools`` in the
    family's format, the arguments following each tool's parameter schema."""
    before, after, separator = _CALL_FORMATS[family]
    tags = [
        {
            "type": "tag",
            "begin": before.format(name=json.dumps(tool.function.name)),
            "content": {
                "type": "json_schema",
                "json_schema": tool.function.parameters,
                # Bounded whitespace: a model that likes spaces cannot fill its budget.
                "max_whitespace_cnt": 1,
            },
            "end": after,
        }
        for tool in tools
    ]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator or "\n",
            "at_least_one": True,
            "stop_after_first": not parallel or not separator,
        },
    }
    return StructuredOutput("structural_tag", json.dumps(tag, sort_keys=True))


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates read them (OpenAI's shape, as plain dicts)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]
