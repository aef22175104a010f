"""JSON and YAML parsing for client documents (specs, request bodies, dataset lines) in which no number is
beyond what the parser or a field can take.

Python refuses to convert an integer literal of more than 4300 digits (`sys.get_int_max_str_digits`: the
conversion is quadratic) with a bare ValueError, and parses `1e999`, `NaN` and `Infinity` to non-finite
floats. In a spec such a number is kept as a `HugeNumber` marker, so that the field it sits in is refused
by name (pydantic sees a value of the wrong type; `number_problem` words the message); in a dataset line,
which is checked line by line, it is refused naming the line. Nesting deeper than the parser's recursion
limit is a `DocumentError`, never a RecursionError.
"""

from __future__ import annotations

import json
import math
from typing import Any

import yaml
from yaml.constructor import SafeConstructor


class DocumentError(ValueError):
    """A document the parsers cannot represent (a number too long, nesting too deep)."""


class HugeNumber:
    """A number literal too long to convert, in place of its value: no field accepts it."""

    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a number of {self.digits} digits>"


def number_problem(value: Any) -> str | None:
    """The message for a field that received a `HugeNumber`, else None."""
    if isinstance(value, HugeNumber):
        return f"a number of {value.digits} digits is out of range for this field"
    return None


def _int_or_marker(text: str) -> int | HugeNumber:
    try:
        return int(text)
    except ValueError:
        return HugeNumber(len(text.lstrip("+-")))


def load_json_document(data: str | bytes) -> Any:
    """Parse a JSON document (a request body, a spec file); over-long integers become `HugeNumber`."""
    try:
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            raise
        except UnicodeDecodeError:
            raise
        except ValueError:
            # Only an integer over the digit limit raises a bare ValueError: parse again, keeping it as a
            # marker (the slower hook runs only for such documents).
            return json.loads(data, parse_int=_int_or_marker)
    except RecursionError:
        raise DocumentError("the JSON document is nested too deeply") from None


def _refuse_constant(name: str) -> float:
    raise DocumentError(f"{name} is not a number JSON allows (NaN and infinities are not data)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DocumentError(f"the number {text[:40]} overflows a 64-bit float")
    return value


def load_json_line(text: str) -> Any:
    """Parse one line of JSON data strictly: NaN, infinities, floats that overflow and integers over the
    digit limit raise DocumentError; malformed JSON raises json.JSONDecodeError."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, DocumentError):
        raise
    except RecursionError:
        raise DocumentError("JSON nested too deeply") from None
    except ValueError:
        raise DocumentError(
            "an integer with more digits than the parser converts (4300); no field takes one"
        ) from None


def _yaml_int(loader: SafeConstructor, node: yaml.ScalarNode) -> int | HugeNumber:
    try:
        return SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:
        return HugeNumber(len(str(node.value).lstrip("+-")))


_LOADERS: dict[type, type] = {}


def load_yaml(text: str, loader: type = yaml.SafeLoader) -> Any:
    """Parse YAML with a safe `loader` class (SafeLoader or CSafeLoader); over-long integers become
    `HugeNumber`, too deep nesting a DocumentError. yaml.YAMLError names the line of a syntax error."""
    if loader not in _LOADERS:
        bounded = type(f"Bounded{loader.__name__}", (loader,), {})
        bounded.add_constructor("tag:yaml.org,2002:int", _yaml_int)
        _LOADERS[loader] = bounded
    try:
        return yaml.load(text, Loader=_LOADERS[loader])
    except RecursionError:
        raise DocumentError("the YAML document is nested too deeply") from None
