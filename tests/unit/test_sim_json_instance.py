"""The simulated engine's structured output: an instance drawn for a JSON schema validates
against it (checked by the `jsonschema` package, not by the code under test)."""

from __future__ import annotations

import random
from typing import Any

import jsonschema
import pytest

from appliance.sim.entrypoints.json_instance import SchemaError, instance

PERSON = {
    "$defs": {
        "Pet": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
            },
            "required": ["kind", "age"],
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 8},
        "height": {"type": "number", "exclusiveMinimum": 1.2, "exclusiveMaximum": 2.2},
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "minItems": 2},
        "adult": {"type": "boolean"},
        "tags": {"type": ["array", "null"], "items": {"type": "string"}, "maxItems": 1},
        "id": {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 40},
        "kind": {"const": "person"},
    },
    "required": ["name", "height", "pets", "adult", "id", "kind"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, Any] = {
    "person": PERSON,
    "empty": {},
    "true": True,
    "list": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 1},
    "nested": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "null"}}}},
        "required": ["a"],
    },
    "allof": {
        "allOf": [
            {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            {"properties": {"y": {"type": "string"}}, "required": ["y"]},
        ]
    },
    "recursive": {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            }
        },
        "$ref": "#/$defs/Node",
    },
}


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("seed", range(20))
def test_an_instance_validates_against_its_schema(name: str, seed: int) -> None:
    schema = SCHEMAS[name]
    jsonschema.validate(instance(schema, random.Random(seed)), schema)


def test_the_same_seed_draws_the_same_instance() -> None:
    assert instance(PERSON, random.Random(5)) == instance(PERSON, random.Random(5))


@pytest.mark.parametrize("ref", ["http://example.com/x.json", "#/$defs/Missing"])
def test_a_ref_it_cannot_follow_is_an_error(ref: str) -> None:
    with pytest.raises(SchemaError, match=r"\$ref"):
        instance({"$ref": ref}, random.Random(0))
