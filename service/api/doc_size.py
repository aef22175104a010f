"""The size of what a door decoded, as compact UTF-8 JSON with every YAML alias expanded: the one measure
each door applies to a spec after parsing it (`check_spec_size`), whatever its size on the wire.

Aliases share one object (or YAML node), so the walk below measures each distinct one once and adds its
size wherever it appears: it costs the document as written, never as expanded, and stops at the cap.
A YAML document is walked as composed, before anything is built from it; what was built (and a JSON
body) is then measured by the C encoder.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from json.encoder import encode_basestring
from typing import Any

import yaml

from service.api.errors import ApiError

_CONTAINERS = (dict, list, tuple, set, frozenset)


class SelfReference(ValueError):
    """A document that contains itself (a YAML alias inside its own anchor): it has no JSON form."""


def _text_size(text: str) -> int:
    return len(encode_basestring(text).encode("utf-8", "surrogatepass"))


def _value_size(value: Any) -> int:
    """The JSON size of a scalar (anything a loader may make that is not a container)."""
    if value is None or value is True:
        return 4
    if value is False:
        return 5
    if isinstance(value, str):
        return _text_size(value)
    if isinstance(value, int):
        # From the bit length: str() of an int of over 4300 digits raises (a YAML hex literal can make one).
        return int(abs(value).bit_length() * 0.30103) + 1 + (value < 0)
    if isinstance(value, float):
        return len(json.dumps(value))
    return _text_size(str(value))  # dates, binary, a number too long to convert: as text


def _key_size(key: Any) -> int:
    # JSON keys are strings: a non-string key is written quoted.
    return _text_size(key) if isinstance(key, str) else _value_size(key) + 2


def _value_children(value: Any) -> Iterable[tuple[int, Any]] | None:
    """(bytes before the child, child) of a container, None for a scalar."""
    if isinstance(value, dict):
        return ((_key_size(k) + 1, v) for k, v in value.items())
    if isinstance(value, _CONTAINERS):
        return ((0, v) for v in value)
    return None


def _node_children(node: yaml.Node) -> Iterable[tuple[int, Any]] | None:
    if isinstance(node, yaml.MappingNode):
        # A key is counted as a child too: `? *big : 1` expands as much as a value does.
        return ((1, part) for pair in node.value for part in pair)
    if isinstance(node, yaml.SequenceNode):
        return ((0, child) for child in node.value)
    return None


def _node_leaf(node: yaml.Node) -> int:
    return len(str(node.value)) + 2


def _expanded_size(
    root: Any,
    limit: int,
    children: Callable[[Any], Iterable[tuple[int, Any]] | None],
    leaf: Callable[[Any], int],
) -> int:
    """The size of `root` with shared parts counted where each appears, or a number over `limit` as soon
    as the count passes it. Iterative (no recursion limit); each distinct container is walked once."""
    known: dict[int, int] = {}
    first = children(root)
    if first is None:
        return leaf(root)
    # A frame: [container, its children, bytes so far (brackets and separators included), children seen].
    stack: list[list[Any]] = [[root, iter(first), 2, 0]]
    on_path = {id(root)}
    while stack:
        frame = stack[-1]
        items: Iterator[tuple[int, Any]] = frame[1]
        step = next(items, None)
        if step is None:
            stack.pop()
            on_path.discard(id(frame[0]))
            known[id(frame[0])] = frame[2]
            if not stack:
                return frame[2]
            stack[-1][2] += frame[2]
            if stack[-1][2] > limit:
                return stack[-1][2]
            continue
        prefix, child = step
        frame[2] += prefix + (frame[3] > 0)  # the comma before every child but the first
        frame[3] += 1
        size = known.get(id(child))
        if size is None:
            grand = children(child)
            if grand is not None:
                if id(child) in on_path:
                    raise SelfReference("the document contains itself (an alias inside its own anchor)")
                on_path.add(id(child))
                stack.append([child, iter(grand), 2, 0])
                continue
            size = leaf(child)
        frame[2] += size
        if frame[2] > limit:
            return frame[2]
    return 0  # unreachable: the root's frame returns


def json_size(value: Any, limit: int) -> int:
    """Bytes of `value` as compact JSON, every shared object counted where it appears (a number over
    `limit` may stand for a larger one); SelfReference if `value` contains itself.

    The C encoder measures it (a 1 MiB body in milliseconds, on the event loop): what a JSON parser makes
    is a tree no larger than its text, and a YAML document has passed `bounded_yaml_loader`, which bounds
    its expansion before it is built. What the encoder refuses (a date as a key, an integer over 4300
    digits) is walked instead."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    except ValueError as exc:
        if "Circular reference" in str(exc):
            raise SelfReference("the document contains itself (an alias inside its own anchor)") from None
    except (TypeError, RecursionError):
        pass
    else:
        return len(text.encode("utf-8", "surrogatepass"))
    return _expanded_size(value, limit, _value_children, _value_size)


def yaml_node_size(node: yaml.Node, limit: int) -> int:
    """About the bytes a composed YAML document expands to (aliases and merge keys expanded, scalars as
    written), or a number over `limit`; SelfReference for a recursive alias."""
    return _expanded_size(node, limit, _node_children, _node_leaf)


def too_large(limit: int, *, what: str = "the job spec", param: str = "spec") -> ApiError:
    return ApiError(
        413,
        f"{what} is larger than {limit} bytes once decoded (as JSON, with YAML aliases expanded); "
        "the limit is PEAGLE_MAX_SPEC_BYTES",
        code="payload_too_large",
        param=param,
    )


def check_spec_size(value: Any, limit: int, *, what: str = "the job spec", param: str = "spec") -> None:
    """413 when `value` (a decoded body or spec) is over `limit` bytes as JSON, 422 when it contains
    itself: what a client sent is capped by what it decodes to, not by its bytes on the wire."""
    try:
        size = json_size(value, limit)
    except SelfReference as exc:
        raise ApiError(422, f"{what}: {exc}", code="invalid_request", param=param) from None
    if size > limit:
        raise too_large(limit, what=what, param=param)


@functools.cache  # one class per loader and cap: the YAML loader caches what it derives per class
def bounded_yaml_loader(loader: type, limit: int) -> type:
    """`loader` refusing, before it constructs anything, a document whose aliases (or merge keys) expand
    past about twice `limit` (construction would cost that much): ApiError 413, or 422 when recursive.
    The exact rule is `check_spec_size` on what it constructs; this bound only keeps that affordable."""

    class Bounded(loader):  # type: ignore[misc, valid-type]
        def get_single_node(self) -> yaml.Node | None:
            node = super().get_single_node()
            if node is not None:
                try:
                    size = yaml_node_size(node, 2 * limit)
                except SelfReference as exc:
                    raise ApiError(
                        422, f"the job spec: {exc}", code="invalid_request", param="spec"
                    ) from None
                if size > 2 * limit:
                    raise too_large(limit)
            return node

    return Bounded
