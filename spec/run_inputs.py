"""The inputs of a "time and cost to train N tokens" question: the token count and the price per GPU-hour.

Token counts as people write them: ``1e12``, ``300B``, ``1.5T``, ``2_000_000``. A count is a decimal
number (an exponent allowed) with an optional suffix K (10^3), M (10^6), B or G (10^9) or T (10^12), any
case. It must name a whole number of tokens between 1 and :data:`spec.limits.MAX_TRAIN_TOKENS`; anything
else is one :class:`SpecError` line that repeats the text. A price must be a finite number of US dollars
in (0, :data:`spec.limits.MAX_PRICE_PER_GPU_HOUR`].
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from spec.errors import SpecError
from spec.limits import MAX_PRICE_PER_GPU_HOUR, MAX_TRAIN_TOKENS

@dataclass(frozen=True)
class RunQuestion:
    """Tokens to train and, when given, the price of one GPU-hour (USD): what ``plan``/``best`` and the
    service's plan and best endpoints are asked."""

    tokens: int
    price_per_gpu_hour: float | None = None


SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_FORM = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)
FORMS = "a number of tokens such as 1e12, 300B or 1.5T (suffixes K, M, B, T)"


def parse_token_count(text: str, name: str = "--tokens") -> int:
    """The whole number of tokens ``text`` names; SpecError naming ``name`` when it is not one, is not
    positive or exceeds MAX_TRAIN_TOKENS."""
    match = _FORM.match(text)
    if match is None:
        raise SpecError(f"{name} takes {FORMS}, got {text!r}")
    digits, suffix = match.groups()
    try:
        # Decimal: 1.5T is exactly 1,500,000,000,000 (a float would round some such products)
        value = Decimal(digits.replace("_", "")) * SUFFIXES[suffix.lower()]
    except InvalidOperation:
        raise SpecError(f"{name} takes {FORMS}, got {text!r}") from None
    if value > MAX_TRAIN_TOKENS:
        raise SpecError(f"{name} must be at most {MAX_TRAIN_TOKENS:.0e} tokens, got {text!r}")
    if value != value.to_integral_value():
        raise SpecError(f"{name} must be a whole number of tokens, got {text!r}")
    if value < 1:
        raise SpecError(f"{name} must be at least 1 token, got {text!r}")
    return int(value)


def format_token_count(tokens: int) -> str:
    """``tokens`` in the largest suffix unit that keeps it readable: 1.5T, 300B, 42M, 512."""
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= size:
            return f"{tokens / size:.4g}{suffix}"
    return str(tokens)


def check_price_per_gpu_hour(price: float, name: str = "--price-per-gpu-hour") -> float:
    """``price`` (US dollars per GPU-hour) when it is a finite number in (0, MAX_PRICE_PER_GPU_HOUR], else
    SpecError naming ``name``."""
    if not (math.isfinite(price) and 0 < price <= MAX_PRICE_PER_GPU_HOUR):
        raise SpecError(f"{name} must be more than 0 and at most {MAX_PRICE_PER_GPU_HOUR:g} USD, got {price!r}")
    return price
