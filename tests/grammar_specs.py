"""Random grammar specs for the structured-output tests (tests/rank/test_structured_outputs.py and the server's
end-to-end ones): every instance of a schema, and every match of a regex, is finite, so a constrained request always
ends on its grammar."""

from __future__ import annotations

import random
import re


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose every instance is finite in length (bounded strings, arrays and integers)."""
    kinds = ["integer", "boolean", "string", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "integer":
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "minLength": rng.randrange(0, 3), "maxLength": rng.randrange(3, 10)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, True, None], rng.randrange(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randrange(1, 4)}
    props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randrange(1, 4))}
    required = sorted(rng.sample(list(props), rng.randrange(1, len(props) + 1)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_regex(rng: random.Random, depth: int = 0) -> str:
    """A regex with bounded repetitions only (every match is finite), of ASCII pieces."""
    out = []
    for _ in range(rng.randrange(1, 4)):
        kind = rng.choice(["literal", "class", "group", "alternation"] if depth < 2 else ["literal", "class"])
        if kind == "literal":
            piece = re.escape(rng.choice(["ab", "x", "-", "42", " ", "Q.", "{", "@"]))
        elif kind == "class":
            piece = rng.choice(["[a-z]", "[0-9]", "[A-F0-9]", "[xyz ]", "[^a-z\\n]"])
        elif kind == "group":
            piece = f"({random_regex(rng, depth + 1)})"
        else:
            piece = f"({random_regex(rng, depth + 1)}|{random_regex(rng, depth + 1)})"
        out.append(piece + rng.choice(["", "", "?", "{2}", "{1,3}", "{0,4}"]))
    return "".join(out)
