"""The request fields that constrain the output's shape, and the grammar each one means.

- OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (any
  JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (what ``client.chat.completions.parse(response_format=Model)`` sends);
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (GBNF / EBNF with a ``root`` rule) or
  ``json_object: true``.

The engine compiles the result (``engine/grammar.py``); a schema it cannot follow is a
400 naming the problem before the request runs. The output is always enforced:
``strict: false`` does not loosen it (vLLM does the same).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from llmctl.engine.sampling_params import StructuredOutput
from llmctl.errors import InvalidRequest
from llmctl.server.protocol_base import Strict

MAX_CHOICES = 256  # entries of structured_outputs.choice


class JSONSchemaFormat(Strict):
    name: str = Field("response", max_length=64, description="Accepted, not used.")
    description: str | None = Field(None, description="Accepted, not used.")
    # ``schema`` shadows a BaseModel attribute; the alias keeps the wire name.
    schema_: dict[str, Any] | bool = Field(
        True, alias="schema", description="The JSON Schema the output follows."
    )
    strict: bool | None = Field(None, description="Accepted; the schema is enforced either way.")


class ResponseFormat(Strict):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def spec(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json")
        if self.json_schema is None:
            raise InvalidRequest(
                "response_format of type json_schema needs a json_schema object "
                '({"name": ..., "schema": {...}})',
                param="response_format.json_schema",
                code="invalid_combination",
            )
        return schema_spec(self.json_schema.schema_, "response_format.json_schema.schema")


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON Schema (an object, or its JSON text)."
    )
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES
    )
    grammar: str | None = Field(
        None,
        min_length=1,
        description="GBNF / EBNF whose start rule is root, or Lark whose start rule is start.",
    )
    json_object: bool | None = None

    def spec(self) -> StructuredOutput:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, "json_" if name == "json" else name) not in (None, False)
        ]
        if len(given) != 1:
            raise InvalidRequest(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {', '.join(given) or 'none'}",
                param="structured_outputs",
                code="invalid_combination",
            )
        if self.json_ is not None:
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise InvalidRequest(
                        f"structured_outputs.json is not JSON: {exc}",
                        param="structured_outputs.json",
                    ) from None
            return schema_spec(schema, "structured_outputs.json")
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        if self.grammar is not None:
            # As vLLM tells them apart: GBNF / EBNF rules are written 'name ::= ...'.
            return StructuredOutput("ebnf" if "::=" in self.grammar else "lark", self.grammar)
        return StructuredOutput("json")


def schema_spec(schema: Any, param: str) -> StructuredOutput:
    """A JSON Schema as a grammar spec; equal schemas give equal specs (one compile)."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(
            f"{param} must be a JSON Schema (an object)", param=param, code="invalid_grammar"
        )
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True))
