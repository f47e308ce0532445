"""Building blocks shared by several schemas: bounded strings and pagination."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Generic, TypeVar

from pydantic import AfterValidator, BaseModel, Field, StringConstraints, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

MAX_PAGE_SIZE = 200
MAX_ID = 2**31 - 1  # ids are 32-bit integer columns on PostgreSQL


def _no_nul(value: str) -> str:
    if "\x00" in value:  # PostgreSQL text and JSONB cannot hold NUL
        raise PydanticCustomError("no_nul_character", "the text must not contain the NUL character")
    return value


Name = Annotated[str, StringConstraints(min_length=1, max_length=200, strip_whitespace=True), AfterValidator(_no_nul)]

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
        if isinstance(name, str) and ("\x00" in name or not name.strip() or len(name) > max_name_length):
            raise PydanticCustomError(rule, "name must be 1 to {n} characters without NUL", {"n": max_name_length})
        return spec

    return WrapValidator(validate)
