"""The JSON Schema files (draft 2020-12) generated from the receipt models, and their check.

Pydantic's schema is tidied so the files read like hand-written ones: no generated titles or
defaults, `{"type": [T, "null"]}` for a nullable field, a model used once written inline (those
used several times stay under $defs), and one key order everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic.json_schema import GenerateJsonSchema

from openjev.receipts.base import Receipt

SCHEMA_URI = "https://json-schema.org/draft/2020-12/schema"
ID_BASE = "https://openjev-serving.invalid/schemas/"
SUFFIX = ".schema.json"

# keys holding one subschema, a list of them, or a name -> subschema map
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs")
_KEY_ORDER = ("$schema", "$id", "title", "description", "$ref", "type", "const", "enum", "pattern", "minLength",
              "minimum", "exclusiveMinimum", "maximum", "minItems", "maxItems", "uniqueItems", "minProperties",
              "required", "properties", "patternProperties", "additionalProperties", "items", "anyOf", "oneOf",
              "allOf", "if", "then", "not", "$defs")
# keywords that constrain every type; a subschema with one of them is never merged with {"type": "null"}
_TYPE_BLIND = {"$ref", "const", "enum", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"}


def _walk(node, fn):
    """Apply fn to every subschema of `node`, bottom-up (fn returns the replacement)."""
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _ONE and isinstance(v, dict):
            v = _walk(v, fn)
        elif k in _LIST and isinstance(v, list):
            v = [_walk(s, fn) for s in v]
        elif k in _MAP and isinstance(v, dict):
            v = {name: _walk(s, fn) for name, s in v.items()}
        out[k] = v
    return fn(out)


def _tidy(node: dict) -> dict:
    leaked = node.keys() & {"ge", "gt", "le", "lt", "min_length", "max_length", "multiple_of"}
    if leaked:
        raise ValueError(f"pydantic left the constraint(s) {sorted(leaked)} untranslated in {node}")
    node = {k: v for k, v in node.items() if k not in ("title", "default")}
    if node.get("additionalProperties") is True:
        del node["additionalProperties"]  # JSON Schema's default: every receipt allows more keys
    if node.get("items") == {}:
        del node["items"]
    if isinstance(node.get("description"), str):
        node["description"] = " ".join(node["description"].split())
    return node


def _merge_null(node: dict) -> dict:
    """{"anyOf": [S, {"type": "null"}]} -> S with "type": [T, "null"] when S's keywords all act on its type only."""
    branches = node.get("anyOf")
    if not (isinstance(branches, list) and len(branches) == 2 and {"type": "null"} in branches):
        return node
    other = branches[0] if branches[1] == {"type": "null"} else branches[1]
    if not isinstance(other.get("type"), str) or other.keys() & _TYPE_BLIND:
        return node
    merged = {k: v for k, v in node.items() if k != "anyOf"}
    for k, v in other.items():
        merged.setdefault(k, v)  # the field's own description wins over its model's
    merged["type"] = [other["type"], "null"]
    return merged


def _refs(node, counts: dict) -> None:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            counts[node["$ref"]] = counts.get(node["$ref"], 0) + 1
        for v in node.values():
            _refs(v, counts)
    elif isinstance(node, list):
        for v in node:
            _refs(v, counts)


def _inline_single_use(schema: dict) -> dict:
    """Write each $defs entry referenced once in place of its $ref."""
    defs = schema.get("$defs", {})
    counts: dict = {}
    _refs(schema, counts)
    once = {name for name in defs if counts.get(f"#/$defs/{name}") == 1}

    def inline(node: dict) -> dict:
        name = str(node.get("$ref", "")).removeprefix("#/$defs/")
        if "$ref" in node and name in once:
            return {**_walk(defs[name], inline), **{k: v for k, v in node.items() if k != "$ref"}}
        return node

    out = _walk({k: v for k, v in schema.items() if k != "$defs"}, inline)
    kept = {name: _walk(s, inline) for name, s in defs.items() if name not in once}
    if kept:
        out["$defs"] = kept
    return out


def _ordered(node):
    if isinstance(node, list):
        return [_ordered(v) for v in node]
    if not isinstance(node, dict):
        return node
    rank = {k: i for i, k in enumerate(_KEY_ORDER)}
    keys = sorted(node, key=lambda k: (rank.get(k, len(rank)), k))
    out = {}
    for k in keys:
        v = node[k]
        if k in _MAP and isinstance(v, dict):
            names = sorted(v) if k == "$defs" else list(v)
            v = {name: _ordered(v[name]) for name in names}
        elif k in _ONE or k in _LIST:
            v = _ordered(v)
        out[k] = v
    return out


class _NoTitles(GenerateJsonSchema):
    def field_title_should_be_set(self, schema) -> bool:
        return False


def schema_of(model: type[Receipt]) -> dict:
    """The JSON Schema of one receipt model, as its file holds it."""
    raw = model.model_json_schema(schema_generator=_NoTitles, mode="validation")
    schema = _walk({**raw, **model.schema_keywords}, _tidy)
    schema = _inline_single_use(schema)
    schema = _walk(schema, _merge_null)
    head = {"$schema": SCHEMA_URI, "$id": ID_BASE + model.schema_file, "title": model.schema_title}
    return _ordered({**schema, **head})


WIDTH = 120


def _dumps(value, indent: int = 0, lead: int = 0) -> str:
    """JSON indented by 2, but a list or object that fits on its line (lead: what precedes it there) stays on it."""
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, (dict, list)) or not value or indent + lead + len(flat) + 1 <= WIDTH:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, list):
        items = [pad + _dumps(v, indent + 2) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    items = []
    for k, v in value.items():
        key = json.dumps(k, ensure_ascii=False) + ": "
        items.append(pad + key + _dumps(v, indent + 2, len(key)))
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def render(model: type[Receipt]) -> str:
    return _dumps(schema_of(model)) + "\n"


def write_all(models, directory: Path) -> list[Path]:
    """Write every model's schema file into `directory`; the files whose text changed."""
    directory.mkdir(parents=True, exist_ok=True)
    changed = []
    for model in models:
        path = directory / model.schema_file
        text = render(model)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


def check_all(models, directory: Path) -> list[str]:
    """One line per schema file in `directory` that is not what the models generate (differs, missing,
    or a *.schema.json no model makes); [] when they all agree."""
    problems = []
    made = set()
    for model in models:
        path = directory / model.schema_file
        made.add(path.name)
        if not path.is_file():
            problems.append(f"{path}: missing (generated from {model.__module__}.{model.__name__})")
        elif path.read_text() != render(model):
            problems.append(f"{path}: differs from {model.__module__}.{model.__name__}")
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        if path.name not in made:
            problems.append(f"{path}: no receipt model generates it")
    return problems
