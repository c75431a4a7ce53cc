"""``manifest.json``'s schema as JSON Schema (draft 2020-12), generated from the declarative
description in ``drifttool.artifact.manifest_schema``, for tools other than drifttool.

    >>> schema = manifest_json_schema()
    >>> schema["required"]
    ['complete', 'files', 'fingerprint', 'schema_version']
    $ python -m drifttool.artifact.manifest_json_schema > docs/manifest.schema.json

The repository keeps the output in ``docs/manifest.schema.json`` (a test keeps the two equal).
It states what ``manifest_schema.MANIFEST_SCHEMA``, ``RUN_SECTIONS`` (as ``dependentRequired``: a
manifest with one of ``RUN_MARKERS`` holds every section; ``FINISH_SECTIONS`` once complete,
``UNCAPTURED_SECTIONS`` unless in mode off),
``KIND_REQUIRES`` and ``KIND_FORBIDS`` state; the cross-field rules of ``drifttool.artifact.manifest`` (``layout_problem``, ``files_problem``, ``samples_problem``)
and the supported schema versions are checked by drifttool's reader only.
"""

from __future__ import annotations

import json
from typing import Any

from drifttool.artifact import manifest_schema as MS
from drifttool.artifact.schema import SCHEMA_VERSION

_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
          dict: "object"}


def spec_json_schema(spec: Any) -> dict[str, Any]:
    """The JSON Schema of one ``manifest_schema`` spec (``int`` excludes booleans in both)."""
    if spec is MS.ANY:
        return {}
    if isinstance(spec, MS.Nullable):
        return {"anyOf": [{"type": "null"}, spec_json_schema(spec.spec)]}
    if isinstance(spec, MS.Enum):
        return {"type": "string", "enum": list(spec.values)}
    if isinstance(spec, MS.ListOf):
        sized = {} if spec.length is None else {"minItems": spec.length, "maxItems": spec.length}
        return {"type": "array", "items": spec_json_schema(spec.item), **sized}
    if isinstance(spec, MS.Least):
        bound = "exclusiveMinimum" if spec.strict else "minimum"
        above = {} if spec.below is None else {"exclusiveMaximum": spec.below}
        return {**spec_json_schema(spec.types), bound: spec.least, **above}
    if isinstance(spec, MS.MapOf):
        return {"type": "object", "additionalProperties": spec_json_schema(spec.value)}
    if isinstance(spec, MS.Obj):
        other = False if spec.other is None else spec_json_schema(spec.other)
        return {"type": "object",
                "properties": {k: spec_json_schema(v) for k, v in spec.fields.items()},
                "required": sorted(spec.required), "additionalProperties": other}
    types = [_TYPES[t] for t in spec if not (t is int and float in spec)]  # number ⊇ integer
    return {"type": types[0] if len(types) == 1 else types}


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema of ``manifest.json`` as this drifttool writes it (schema version
    ``SCHEMA_VERSION``; earlier versions' manifests validate too)."""
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "drifttool artifact manifest.json",
        "description": (f"The manifest of a drifttool trajectory artifact, schema version "
                        f"{SCHEMA_VERSION} (docs/artifacts.md). Generated from "
                        "drifttool/artifact/manifest_schema.py."),
        **spec_json_schema(MS.MANIFEST_SCHEMA),
    }
    rules = [{"if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
              "then": {"required": sorted(keys)}} for kind, keys in MS.KIND_REQUIRES.items()]
    rules += [{"if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
               "then": {"properties": {k: False for k in sorted(keys)}}}
              for kind, keys in MS.KIND_FORBIDS.items()]
    always = [s for s in MS.RUN_SECTIONS
              if s not in MS.FINISH_SECTIONS and s not in MS.UNCAPTURED_SECTIONS]
    sections = {k: [s for s in always if s != k] for k in MS.RUN_MARKERS}
    rules.append({"if": {"properties": {"complete": {"const": True}}, "required": ["kind"]},
                  "then": {"required": list(MS.FINISH_SECTIONS)}})
    mode_off = {"properties": {"settings": {"properties": {"mode": {"const": "off"}},
                                            "required": ["mode"]}}, "required": ["settings"]}
    rules.append({"if": {"required": ["kind"], "not": mode_off},
                  "then": {"required": list(MS.UNCAPTURED_SECTIONS)}})
    return {**out, "dependentRequired": sections, "allOf": rules}


def render() -> str:
    """``manifest_json_schema()`` as the text of ``docs/manifest.schema.json``."""
    return json.dumps(manifest_json_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    print(render(), end="")
