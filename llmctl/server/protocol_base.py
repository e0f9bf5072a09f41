"""The strict base of every request body: unknown fields refused by name, no coercion,
``null`` meaning "not set" (see protocol.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def _optional_fields_take_null(schema: dict[str, Any]) -> None:
    """Publish what ``_null_means_default`` accepts: null for every optional field."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        choices = prop.get("anyOf", [prop])
        if name not in required and not any(c.get("type") == "null" for c in choices):
            about = {
                key: prop.pop(key) for key in ("title", "description", "default") if key in prop
            }
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **about}


class Strict(BaseModel):
    """A request body (or part of one) checked strictly."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        json_schema_extra=_optional_fields_take_null,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI accepts ``null`` for any optional field, and some clients send it. An
        unknown field stays, even as ``null``, to be refused by name."""
        if isinstance(data, dict):
            names = {info.alias or name for name, info in cls.model_fields.items()}
            return {
                key: value for key, value in data.items() if value is not None or key not in names
            }
        return data
