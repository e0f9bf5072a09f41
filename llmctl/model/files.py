"""Small readers shared by everything that opens a model's files: a JSON object file, the
architecture config.json names, and how an error message shows a JSON value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmctl.errors import ModelError


def read_json_object(path: Path, *, required: bool) -> dict[str, Any]:
    """A JSON file that must hold an object; a missing optional file reads as ``{}``."""
    if not path.is_file():
        if required:
            raise ModelError(
                f"{path.parent} has no {path.name}: give a Hugging Face model directory "
                "(config.json + *.safetensors + tokenizer files)"
            )
        return {}
    try:
        content = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(content, dict):
        raise ModelError(f"{path} must hold a JSON object {{...}}, not {describe(content)}")
    return content


def read_architecture(config: dict[str, Any], source: str) -> str:
    """The model class config.json names (``architectures[0]``)."""
    architectures = config.get("architectures")
    if (
        not isinstance(architectures, list)
        or not architectures
        or not isinstance(architectures[0], str)
    ):
        raise ModelError(
            f"{source}: 'architectures' must name the model class, e.g. "
            f'["LlamaForCausalLM"], got {describe(architectures)}'
        )
    return architectures[0]


def describe(value: Any) -> str:
    """A JSON value as an error message shows it: ``the string '1e4'``, ``null``, ``-3``."""
    if value is None:
        return "null (or nothing)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (list, dict)):
        kind = "a list" if isinstance(value, list) else "an object"
        return f"{kind} ({json.dumps(value)[:40]})"
    return repr(value)
