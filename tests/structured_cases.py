"""JSON schemas the constrained-decoding tests run (each with a prompt that asks for it):
nested objects, arrays with item bounds, enums, integer and number ranges, required and
optional fields, anyOf, $ref, string patterns and lengths, const, nullable fields."""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

CASES: list[tuple[str, str, dict]] = [
    ("person", "a person with a name and an age", PERSON),
    ("int_range", "a number of legs", {
        "type": "object", "properties": {"legs": {"type": "integer", "minimum": 2, "maximum": 8}},
        "required": ["legs"]}),
    ("number_range", "a temperature in celsius", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
        "required": ["celsius"]}),
    ("exclusive", "a probability", {
        "type": "object",
        "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
        "required": ["p"]}),
    ("enum", "a primary colour", {
        "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"]}),
    ("enum_mixed", "a size", {"enum": ["small", "large", 1, 2, None]}),
    ("bool", "whether the sky is blue", {
        "type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("const", "a version object", {
        "type": "object", "properties": {"version": {"const": 2}, "name": {"type": "string"}},
        "required": ["version", "name"]}),
    ("array_bounds", "three fruits", {
        "type": "array", "items": {"type": "string", "maxLength": 20},
        "minItems": 2, "maxItems": 4}),
    ("array_ints", "a list of small numbers", {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1, "maxItems": 5}),
    ("array_objects", "two people", {"type": "array", "items": PERSON, "minItems": 1,
                                     "maxItems": 2}),
    ("nested", "a person with an address", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False}),
    ("deep", "a company with a team of people", {
        "type": "object",
        "properties": {"company": {"type": "object", "properties": {
            "team": {"type": "object", "properties": {
                "lead": PERSON}, "required": ["lead"], "additionalProperties": False}},
            "required": ["team"], "additionalProperties": False}},
        "required": ["company"], "additionalProperties": False}),
    ("optional", "a book, with a year if you know it", {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
        "required": ["title"], "additionalProperties": False}),
    ("all_optional", "a movie", {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "rating": {"type": "number", "minimum": 0, "maximum": 10}},
        "additionalProperties": False}),
    ("anyof", "an id, a number or a name", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0},
                                        {"type": "string", "maxLength": 12}]}},
        "required": ["id"]}),
    ("anyof_objects", "a shape", {
        "anyOf": [
            {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0}},
             "required": ["circle"], "additionalProperties": False},
            {"type": "object", "properties": {"square": {"type": "number", "minimum": 0}},
             "required": ["square"], "additionalProperties": False},
        ]}),
    ("ref", "a point", {
        "$defs": {"coord": {"type": "number", "minimum": -100, "maximum": 100}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}},
        "required": ["x", "y"], "additionalProperties": False}),
    ("ref_recursive", "a small tree of names", {
        "$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
            "required": ["name"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}),
    ("pattern", "a phone number", {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"]}),
    ("pattern_word", "a lowercase word", {"type": "string", "pattern": "^[a-z]{3,8}$"}),
    ("string_len", "a short greeting", {"type": "string", "minLength": 2, "maxLength": 12}),
    ("date", "a date", {
        "type": "object", "properties": {"date": {"type": "string", "format": "date"}},
        "required": ["date"]}),
    ("nullable", "a middle name, or null", {
        "type": "object",
        "properties": {"middle": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["middle"]}),
    ("integer_top", "how many days a week has", {"type": "integer", "minimum": 1,
                                                  "maximum": 10}),
    ("number_top", "the value of pi", {"type": "number"}),
    ("boolean_top", "is water wet", {"type": "boolean"}),
    ("dict", "a map from names to ages", {
        "type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                   "maximum": 120},
        "maxProperties": 3}),
    ("matrix", "a 2x2 matrix", {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                  "minItems": 2, "maxItems": 2},
        "minItems": 2, "maxItems": 2}),
    ("tuple", "a name and an age", {
        "type": "array", "prefixItems": [{"type": "string", "maxLength": 20},
                                         {"type": "integer", "minimum": 0, "maximum": 120}],
        "items": False, "minItems": 2}),
    ("event", "a calendar event", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 15},
                          "maxItems": 3},
        },
        "required": ["title", "day", "hour"], "additionalProperties": False}),
    ("weather_call", "the arguments of a weather lookup", {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}),
    ("allof", "an item with a name and a price", {
        "allOf": [
            {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
             "required": ["name"]},
            {"type": "object", "properties": {"price": {"type": "number", "minimum": 0}},
             "required": ["price"]},
        ]}),
]  # fmt: skip


def prompt(description: str) -> str:
    return f"Answer in JSON only: {description}."
