"""A JSON document valid for a JSON schema, drawn deterministically: what the simulated
engine "generates" under structured output (vLLM constrains sampling to the schema; the
sim writes an instance of it directly).

Supported: type (a list: its first non-null type), object (properties, required: every
listed property is written), array (items, minItems/maxItems), string (enum, const,
minLength/maxLength), integer and number (minimum/maximum, exclusive bounds), boolean,
null, enum, const, anyOf/oneOf (the first branch), allOf (merged), $ref into the same
document (`#/$defs/...`, `#/definitions/...`, as pydantic writes them). Keywords outside
this set (pattern, format, not, if/then, dependent schemas) are ignored, so a schema that
relies on them may get an instance it does not accept; a schema with none of them always
gets a valid one.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda")
MAX_DEPTH = 12
"""Nesting past which optional structure is left out (recursive schemas end)."""


class SchemaError(ValueError):
    """A schema the sim cannot instantiate (a $ref outside the document, for one)."""


def instance(schema: Any, rng: random.Random) -> Any:
    """A value valid for `schema` (a dict, or True/False as in JSON schema)."""
    return _Drawer(schema if isinstance(schema, dict) else {}, rng).draw(schema, 0)


class _Drawer:
    def __init__(self, root: dict[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} is outside the schema")
        node: Any = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise SchemaError(f"$ref {ref!r} names nothing in the schema")
            node = node[part]
        return node

    def draw(self, schema: Any, depth: int) -> Any:
        if schema is True or schema is None or schema == {}:
            return self.rng.choice(WORDS) if depth else {}
        if not isinstance(schema, dict):
            raise SchemaError(f"not a schema: {schema!r}")
        if "$ref" in schema:
            return self.draw(self.resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return self.rng.choice(list(schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                return self.draw(schema[key][0], depth + 1)
        if schema.get("allOf"):
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part["$ref"]) if "$ref" in part else part
                merged = _merge(merged, part)
            return self.draw(merged, depth + 1)
        return self.typed(schema, _type_of(schema), depth)

    def typed(self, schema: dict[str, Any], kind: str, depth: int) -> Any:
        if kind == "object":
            return self.obj(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        if kind in ("integer", "number"):
            return _number(schema, kind, self.rng)
        if kind == "boolean":
            return self.rng.random() < 0.5
        return None

    def obj(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        keys = [k for k in props if k in required or depth < MAX_DEPTH]
        keys += [k for k in required if k not in props]  # required, yet undescribed
        return {k: self.draw(props.get(k, {"type": "string"}), depth + 1) for k in keys}

    def array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        low = int(schema.get("minItems", 0))
        high = int(schema.get("maxItems", max(low, 3)))
        n = low if depth >= MAX_DEPTH else self.rng.randint(low, max(low, min(high, low + 2)))
        if low == 0 and n == 0 and high > 0 and depth < MAX_DEPTH:
            n = 1
        items = schema.get("items", {})
        return [self.draw(items, depth + 1) for _ in range(n)]

    def string(self, schema: dict[str, Any]) -> str:
        low = int(schema.get("minLength", 0))
        high = int(schema.get("maxLength", max(low, 24)))
        text = " ".join(self.rng.choice(WORDS) for _ in range(2))
        while len(text) < low:
            text += " " + self.rng.choice(WORDS)
        return text[: max(high, low)]


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        if "properties" in schema or "required" in schema:
            return "object"
        if "items" in schema:
            return "array"
        return "string"
    return str(kind)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **{k: v for k, v in b.items() if k not in ("properties", "required")}}
    out["properties"] = {**(a.get("properties") or {}), **(b.get("properties") or {})}
    out["required"] = [*(a.get("required") or ()), *(b.get("required") or ())]
    return out


def _number(schema: dict[str, Any], kind: str, rng: random.Random) -> int | float:
    low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
    high = schema.get("maximum", schema.get("exclusiveMaximum", low + 100))
    if kind == "integer":
        lo = int(low) + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0)
        hi = int(high) - (1 if "exclusiveMaximum" in schema and "maximum" not in schema else 0)
        value = rng.randint(lo, max(lo, hi))
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0 and value % step:
            up = value + step - value % step
            value = up if up <= hi else value - value % step
        return value
    value = round(rng.uniform(float(low), float(high)), 2)
    above = "exclusiveMinimum" not in schema or value > low
    below = "exclusiveMaximum" not in schema or value < high
    return value if above and below else (float(low) + float(high)) / 2
