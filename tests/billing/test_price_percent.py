"""``*_pct`` fields: ``"20%"`` and ``0.20`` read as meant; a bare number that is surely a percent is refused."""

from __future__ import annotations

import copy
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from billing_helpers import PRICES
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app
from kvroute.billing.price_file import book_hash, parse_price_data
from kvroute.policies.errors import ConfigError

runner = CliRunner()


def _with(book_field: str | None = None, rule_field: str | None = None, value: object = None) -> dict:
    data = copy.deepcopy(PRICES)
    acme = data["price_books"][1]
    if book_field:
        acme[book_field] = value
    if rule_field:
        acme["rules"][0][rule_field] = value
    return data


def _acme(data: dict):
    return next(b for b in parse_price_data(data).books if b.app_id == "acme")


@pytest.mark.parametrize("value", ["20%", "20 %", "0.20", 0.2, "0.2"])
def test_a_markup_of_twenty_percent_reads_as_meant_in_both_forms(value: object) -> None:
    book = _acme(_with(rule_field="markup_pct", value=value))
    assert book.rules[0].markup_pct == Decimal("0.2")


@pytest.mark.parametrize("field", ["platform_fee_pct", "payment_fee_pct"])
@pytest.mark.parametrize("value", ["2.9%", "0.029", 0.029])
def test_fees_read_as_meant_in_both_forms(field: str, value: object) -> None:
    assert getattr(_acme(_with(book_field=field, value=value)), field) == Decimal("0.029")


def test_both_forms_give_the_same_book() -> None:
    a = _acme(_with(rule_field="markup_pct", value="15%"))
    b = _acme(_with(rule_field="markup_pct", value="0.15"))
    assert book_hash(a) == book_hash(b)  # loading the other spelling of the same terms is not a new version


def test_percent_strings_above_one_hundred_percent_are_a_markup_not_a_typo() -> None:
    assert _acme(_with(rule_field="markup_pct", value="150%")).rules[0].markup_pct == Decimal("1.5")


@pytest.mark.parametrize(("book_field", "rule_field", "value", "key"), [
    (None, "markup_pct", 20, "price_books[acme v1].rules[claude].markup_pct"),
    (None, "markup_pct", "20", "price_books[acme v1].rules[claude].markup_pct"),
    (None, "markup_pct", 1, "price_books[acme v1].rules[claude].markup_pct"),
    ("platform_fee_pct", None, 5, "price_books[acme v1].platform_fee_pct"),
    ("payment_fee_pct", None, 2.9, "price_books[acme v1].payment_fee_pct"),
])
def test_a_bare_number_that_is_surely_a_percent_is_refused(book_field: str | None, rule_field: str | None,
                                                           value: object, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_price_data(_with(book_field, rule_field, value))
    assert err.value.key == key
    shown = Decimal(str(value)).normalize()
    assert f'"{shown:f}%"' in err.value.message and f"{(shown / 100).normalize():f}" in err.value.message


@pytest.mark.parametrize(("field", "value"), [("platform_fee_pct", "100%"), ("markup_pct", "20000%"),
                                              ("markup_pct", "-5%")])
def test_impossible_percentages_are_refused(field: str, value: str) -> None:
    data = _with(book_field=field, value=value) if field.endswith("fee_pct") else _with(rule_field=field, value=value)
    with pytest.raises(ConfigError, match=field):
        parse_price_data(data)


def test_load_prices_prints_one_line_naming_file_book_rule_and_field(tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump(_with(rule_field="markup_pct", value=20)))
    r = runner.invoke(billing_app, ["load-prices", str(path), "--check"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output
    assert lines[0].startswith(f"{path}: price_books[acme v1].rules[claude].markup_pct: 20 is ambiguous")
    assert '"20%"' in lines[0] and "0.2" in lines[0]
    path.write_text(yaml.safe_dump(_with(rule_field="markup_pct", value="20%")))
    r = runner.invoke(billing_app, ["load-prices", str(path), "--check"])
    assert r.exit_code == 0, r.output
