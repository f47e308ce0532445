"""Building blocks shared by several schemas: the one text rule every string a user sends obeys, bounded
strings, request bodies and pagination."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Generic, TypeVar

from pydantic import AfterValidator, BaseModel, Field, StringConstraints, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

MAX_PAGE_SIZE = 200
MAX_ID = 2**31 - 1  # ids are 32-bit integer columns on PostgreSQL


TEXT_RULE = "valid_text"
_LINE_BREAKS = frozenset("\t\n\r")


def text_problem(value: str, *, single_line: bool = False) -> str | None:
    """Why ``value`` is not text the service stores, or None when it is. Refused everywhere: NUL (PostgreSQL
    text and JSONB cannot hold it), the other C0 control characters and DEL, and lone surrogates (no UTF-8
    encoding exists for them); tab, newline and carriage return too where the text is ``single_line`` (names,
    paths, labels, keys)."""
    for index, char in enumerate(value):
        code = ord(char)
        if code < 0x20 or code == 0x7F:
            if single_line or char not in _LINE_BREAKS:
                return f"control character U+{code:04X} at position {index}"
        elif 0xD800 <= code <= 0xDFFF:
            return f"lone surrogate U+{code:04X} at position {index} (not encodable as UTF-8)"
    return None


def _text_error(problem: str, where: str | None = None) -> PydanticCustomError:
    prefix = f"{where}: " if where else ""
    return PydanticCustomError(TEXT_RULE, "{prefix}the text contains a {problem}", {"prefix": prefix, "problem": problem})


def valid_text(value: str) -> str:
    """AfterValidator of free text (line breaks allowed): :func:`text_problem` as a ``valid_text`` error."""
    problem = text_problem(value)
    if problem:
        raise _text_error(problem)
    return value


def valid_line(value: str) -> str:
    """AfterValidator of a name, path or label: :func:`text_problem` (single line) as a ``valid_text`` error."""
    problem = text_problem(value, single_line=True)
    if problem:
        raise _text_error(problem)
    return value



def _first_bad_text(value: Any, where: str) -> tuple[str, str] | None:
    """(location, problem) of the first string in a decoded JSON value (keys included) that breaks the text
    rule, or None. Keys are names; values may be free text."""
    if isinstance(value, str):
        problem = text_problem(value)
        return (where, problem) if problem else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (problem := text_problem(key, single_line=True)):
                return f"{where} (a key)", problem
            found = _first_bad_text(item, f"{where}.{key}")
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _first_bad_text(item, f"{where}.{i}")
            if found:
                return found
    return None


class BodyIn(BaseModel):
    """Base of every request body: before any field is read, every string of the body (and every key)
    passes the text rule (:func:`text_problem`), so no field, present or future, can carry NUL or
    unencodable text to the database. Single-line fields also use :data:`Name` (or :func:`valid_line`)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        found = _first_bad_text(data, "body") if isinstance(data, dict) else None
        if found:
            raise _text_error(found[1], found[0])
        return data


Name = Annotated[str, StringConstraints(min_length=1, max_length=200, strip_whitespace=True),
                 AfterValidator(valid_line)]

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    """One page of a list: ``items`` from ``offset``; ``next_offset`` is null on the last page."""

    items: list[T]
    total: int = Field(description="items matching the filters, over all pages")
    limit: int
    offset: int
    next_offset: int | None


def spec_validator(spec_class: type, rule: str, max_name_length: int = 200) -> WrapValidator:
    """A wrap validator for a spec-layer dataclass (ModelSpec, TrainingSpec, ...): unknown fields and every
    rule the dataclass checks in ``__post_init__`` become one validation error of type ``rule`` whose
    message is the spec's own."""
    known = {f.name for f in dataclasses.fields(spec_class)}

    def validate(value: Any, handler):
        if isinstance(value, dict) and set(value) - known:
            raise PydanticCustomError(rule, "unknown field(s): {fields}",
                                      {"fields": ", ".join(sorted(map(str, set(value) - known)))})
        try:
            spec = handler(value)
        except ValidationError as exc:
            errors = exc.errors()
            if len(errors) == 1 and errors[0]["type"] == "value_error" and not errors[0]["loc"]:
                # the dataclass's own __post_init__ check (a SpecError): name it after the spec's rule
                reason = str(errors[0].get("ctx", {}).get("error", errors[0]["msg"]))
                raise PydanticCustomError(rule, "{reason}", {"reason": reason}) from None
            raise
        except Exception as exc:  # __post_init__ may raise SpecError, or TypeError/ArithmeticError on odd input
            raise PydanticCustomError(rule, "{reason}", {"reason": str(exc) or type(exc).__name__}) from None
        name = getattr(spec, "name", None)
        if isinstance(name, str) and (text_problem(name, single_line=True) or not name.strip()
                                      or len(name) > max_name_length):
            raise PydanticCustomError(rule, "name must be 1 to {n} characters without control characters",
                                      {"n": max_name_length})
        return spec

    return WrapValidator(validate)
