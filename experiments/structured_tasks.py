"""The structured-outputs experiment's constraints: JSON schemas (nested objects, enums,
arrays, number ranges, string patterns), regexes and choices, each with a chat prompt that
asks for it and a check of an output text that does not use the engine's matcher
(jsonschema, `re.fullmatch`, membership)."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema

from experiments.prompts import TOPICS


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


def _str(most: int, **kw) -> dict:
    return {"type": "string", "maxLength": most, **kw}


SCHEMAS = {
    "person": _obj({"name": _str(40), "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": _str(60, pattern=r"^[a-z0-9.]+@[a-z0-9]+\.[a-z]{2,4}$"),
                    "address": _obj({"street": _str(60), "city": _str(40),
                                     "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}})}),
    "product": _obj({"name": _str(40), "price": {"type": "number", "minimum": 0,
                                                 "maximum": 10000},
                     "currency": {"enum": ["USD", "EUR", "GBP"]},
                     "tags": {"type": "array", "items": _str(20), "minItems": 1,
                              "maxItems": 5},
                     "in_stock": {"type": "boolean"}}),
    "sentiment": _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                       "keywords": {"type": "array", "items": _str(20), "maxItems": 3}}),
    "event": _obj({"title": _str(60), "date": {"type": "string",
                                               "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                   "attendees": {"type": "array", "maxItems": 4, "items": _obj(
                       {"name": _str(30), "role": {"enum": ["host", "speaker", "guest"]}})}}),
    "tool_call": _obj({"name": {"enum": ["get_weather", "search_web", "send_email"]},
                       "arguments": _obj({"query": _str(80), "limit": {
                           "type": "integer", "minimum": 1, "maximum": 10}})}),
    "recipe": _obj({"title": _str(50), "servings": {"type": "integer", "minimum": 1,
                                                    "maximum": 12},
                    "ingredients": {"type": "array", "minItems": 1, "maxItems": 6,
                                    "items": _obj({"item": _str(30), "grams": {
                                        "type": "integer", "minimum": 1, "maximum": 2000}})},
                    "vegetarian": {"type": "boolean"}}),
}
PROMPTS = {
    "person": "Invent a person who loves {t}. Reply with their name, age, email and address "
              "as JSON.",
    "product": "Invent a shop product about {t}: name, price, currency, tags and whether it "
               "is in stock, as JSON.",
    "sentiment": "Classify the sentiment of this review as JSON: 'I tried {t} today and it "
                 "was not what I hoped.'",
    "event": "Plan a meetup about {t}: title, date and up to four attendees with roles, as "
             "JSON.",
    "tool_call": "Call one tool to answer: what is the latest news about {t}? Reply with the "
                 "tool call as JSON.",
    "recipe": "Write a recipe inspired by {t} as JSON: title, servings, ingredients with "
              "grams, and whether it is vegetarian.",
    "date": "On what date did something memorable about {t} happen? Answer with the date "
            "only.",
    "phone": "Make up a US phone number for a shop that sells {t}.",
    "email": "Make up an email address for a club about {t}.",
    "label": "Is this review positive, negative or neutral? 'The {t} exhibit was fine.'",
    "language": "Which programming language would you use for a tool about {t}?",
}
REGEXES = {"date": r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
           "email": r"[a-z]{2,12}\.[a-z]{2,12}@[a-z]{3,10}\.(com|org|net)"}
CHOICES = {"label": ["positive", "negative", "neutral"],
           "language": ["Python", "Rust", "Go", "Java", "C++"]}


@dataclasses.dataclass(frozen=True)
class Task:
    """One constraint: its StructuredOutputsParams fields and the chat prompt asking for it."""

    name: str
    kind: str  # "json", "regex" or "choice"
    constraint: dict

    def prompt(self, i: int) -> str:
        return PROMPTS[self.name].format(t=TOPICS[i % len(TOPICS)])

    def valid(self, text: str) -> bool:
        """Whether an output obeys the constraint, checked without the engine's matcher."""
        if self.kind == "regex":
            return re.fullmatch(self.constraint["regex"], text) is not None
        if self.kind == "choice":
            return text in self.constraint["choice"]
        try:
            jsonschema.validate(json.loads(text), self.constraint["json"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True


TASKS = ([Task(n, "json", {"json": s}) for n, s in SCHEMAS.items()]
         + [Task(n, "regex", {"regex": r}) for n, r in REGEXES.items()]
         + [Task(n, "choice", {"choice": c}) for n, c in CHOICES.items()])


def requests(n: int) -> list[tuple[Task, int]]:
    """n (task, prompt variant) pairs, cycling through the tasks."""
    return [(TASKS[i % len(TASKS)], i // len(TASKS)) for i in range(n)]


def fresh_schema(i: int) -> dict:
    """A schema no run has compiled before (its property name is new): a new schema's cost."""
    return _obj({f"field_{i}": _str(20), "count": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}})
