"""response_format: its structure checked at batch creation (a malformed schema fails its line early); whether the
grammar compiles is known only in the worker, which fails that request alone."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

MAX_SCHEMA_CHARS = 64 * 1024  # the engine's limit too (worker/engine/structured_outputs.py)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name and function names
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def check_response_format(value: dict[str, Any]) -> None:
    """Raise ValueError naming the problem."""
    kind = value.get("type")
    if kind in ("text", "json_object"):
        if value.keys() != {"type"}:
            raise ValueError(f'{{"type": "{kind}"}} takes no other field')
        return
    if kind != "json_schema":
        raise ValueError('type must be "text", "json_object" or "json_schema"')
    if value.keys() != {"type", "json_schema"}:
        raise ValueError('{"type": "json_schema"} takes one other field, "json_schema"')
    spec = value["json_schema"]
    if not isinstance(spec, dict):
        raise ValueError("json_schema must be an object")
    if unknown := spec.keys() - _JSON_SCHEMA_KEYS:
        raise ValueError(f"json_schema has unknown fields {sorted(unknown)}; it takes {sorted(_JSON_SCHEMA_KEYS)}")
    if not (isinstance(spec.get("name"), str) and NAME.fullmatch(spec["name"])):
        raise ValueError("json_schema.name is required: 1 to 64 letters, digits, '_' or '-'")
    if not isinstance(spec.get("strict", False), bool | None) or not isinstance(spec.get("description", ""),
                                                                                str | None):
        raise ValueError("json_schema.strict must be a boolean and json_schema.description a string")
    schema = spec.get("schema")
    if schema is None:
        return  # OpenAI's schema is optional: any JSON object
    check_json_schema(schema, "json_schema.schema")


def check_json_schema(schema: Any, where: str) -> None:
    """Raise ValueError unless `schema` is a JSON-Schema object within the size limit; `where` names it."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object")
    if (size := len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")))) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{where} is {size} characters; the limit is {MAX_SCHEMA_CHARS}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(map(str, e.absolute_path))
        raise ValueError(f"{where} is not a valid JSON schema{f' at {at}' if at else ''}: {e.message}") from None
