"""Exact money: ``Decimal`` amounts at a fixed internal scale, currency minor units, half-even rounding."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Context, Decimal, InvalidOperation

from kvroute.policies.errors import InputError

#: Internal scale of every stored amount (rates in Decimal at 1e-10: a per-token price of a cheap model stays exact).
SCALE = Decimal("1e-10")
#: Integer units per currency unit at the internal scale (SQLite stores amounts as these integers).
UNITS = 10**10
MILLION = Decimal(1_000_000)
ZERO = Decimal(0)
#: Largest amount of one event in any money column: SQLite keeps amounts as 64-bit integers of 1e-10 units
#: (at most about 9.2e8), PostgreSQL as NUMERIC(38, 10); this limit keeps both alike with room to spare.
MAX_AMOUNT = Decimal(10**8)
_CTX = Context(prec=60, rounding=ROUND_HALF_EVEN)
#: ISO-4217 minor-unit exponents that differ from 2.
_MINOR_UNITS = {"JPY": 0, "KRW": 0, "VND": 0, "CLP": 0, "ISK": 0, "BHD": 3, "KWD": 3, "OMR": 3, "JOD": 3, "TND": 3}


def to_decimal(value: object, where: str = "amount") -> Decimal:
    """Parse an amount (Decimal, int, str, or float via its shortest repr) exactly; raise ``InputError``."""
    if isinstance(value, Decimal):
        result = value
    elif isinstance(value, bool):
        raise InputError(where, "expected a decimal amount, got a boolean")
    elif isinstance(value, int):
        result = Decimal(value)
    elif isinstance(value, float):
        result = Decimal(repr(value))
    elif isinstance(value, str):
        try:
            result = Decimal(value.strip())
        except InvalidOperation:
            raise InputError(where, f"not a decimal amount: {value!r}") from None
    else:
        raise InputError(where, f"expected a decimal amount, got {type(value).__name__}")
    if not result.is_finite():
        raise InputError(where, f"amount must be finite, got {value!r}")
    return result


def fix(amount: Decimal) -> Decimal:
    """Quantize to the internal scale (1e-10, half-even): the precision of every stored amount."""
    return amount.quantize(SCALE, context=_CTX)


def to_units(amount: Decimal) -> int:
    """Integer units of 1e-10 for an amount, rounded half-even (used by SQLite storage)."""
    return int(amount.scaleb(10, context=_CTX).to_integral_value(ROUND_HALF_EVEN))


def from_units(units: int) -> Decimal:
    """Inverse of ``to_units``."""
    return Decimal(units).scaleb(-10, context=_CTX).quantize(SCALE, context=_CTX)


def minor_unit(currency: str) -> Decimal:
    """The smallest unit of a currency (0.01 for USD)."""
    return Decimal(1).scaleb(-_MINOR_UNITS.get(currency.upper(), 2))


def round_money(amount: Decimal, currency: str) -> Decimal:
    """Round to the currency minor unit, half-even (only statement lines are ever rounded)."""
    return amount.quantize(minor_unit(currency), context=_CTX)


def check_currency(code: object, where: str = "currency") -> str:
    """Validate an ISO-4217-shaped code (three letters) and return it upper-cased."""
    if not isinstance(code, str) or len(code) != 3 or not code.isalpha():
        raise InputError(where, f"expected a three-letter ISO-4217 currency code, got {code!r}")
    return code.upper()
