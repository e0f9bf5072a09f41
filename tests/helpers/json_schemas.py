"""JSON schemas that structured-output tests run over: each keyword family the issue
names (nested objects, bounded arrays, enums, anyOf, $ref/$defs, string patterns, number
bounds, required and optional keys). Strings are bounded (maxLength, pattern, enum) so a
random model finishes within the test's token budget."""

from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "flags": {
                        "type": "object",
                        "properties": {"admin": {"type": "boolean"}},
                        "required": ["admin"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "flags"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"const": 3}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 10, "maximum": 99},
                    {"type": "boolean"},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        },
        "required": ["start", "path"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9},
        },
        "required": ["ratio", "count"],
        "additionalProperties": False,
    },
    "optional_keys": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9},
            "note": {"type": "string", "maxLength": 4},
            "ok": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
}
