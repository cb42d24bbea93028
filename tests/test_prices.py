"""Prices (genai_ratelimit.prices), with no Redis and no HTTP: exact integer costs rounded up
once, every provider's usage shape read by kind, the model matching rules, unpriced models,
the default price, every kind of bad table refused when built with a message naming the
field, TOML and JSON files, and the example table the repository ships."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import tomllib
from hypothesis import given
from hypothesis import strategies as st

import genai_ratelimit
from genai_ratelimit import (
    MAX_LIMIT,
    ModelPrice,
    PriceRule,
    PriceTable,
    PriceTableError,
    TokenUsage,
    UnpricedModel,
)
from genai_ratelimit.prices import MAX_MODEL_NAME_CHARS, MAX_PRICE, TOKENS_PER_PRICE
from helpers_docs import DOCS, code_blocks

EXAMPLE_TABLE = Path(__file__).resolve().parent.parent / "examples" / "prices.example.toml"

GPT_4O = {"input": 2_500_000, "cached_input": 1_250_000, "output": 10_000_000}
SONNET = {"input": 3_000_000, "cached_input": 300_000, "cache_write": 3_750_000,
          "output": 15_000_000}


def table_data(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "version": "2026-12-05", "currency": "USD", "units_per_currency": 1_000_000,
        "models": {"gpt-4o": dict(GPT_4O), "claude-sonnet-4-5": dict(SONNET)},
        "rules": [{"match": "gpt-4o-20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]", "price_as": "gpt-4o"},
                  {"match": "claude-sonnet-4-5-*", "price_as": "claude-sonnet-4-5"}],
    }
    data.update(changes)
    return data


@pytest.fixture
def table() -> PriceTable:
    return PriceTable.from_mapping(table_data())


# --- exact integer arithmetic -----------------------------------------------------------


def test_the_cost_is_the_sum_of_each_kind_at_its_price(table: PriceTable) -> None:
    usage = TokenUsage(input=600, cached_input=400, output=200)
    # 600 x 2.5 + 400 x 1.25 + 200 x 10 micro-USD = 1500 + 500 + 2000
    assert table.cost("gpt-4o", usage) == 4_000
    usage = TokenUsage(input=10, cached_input=1_000, cache_write=2_000, output=300)
    # 10 x 3 + 1000 x 0.3 + 2000 x 3.75 + 300 x 15
    assert table.cost("claude-sonnet-4-5", usage) == 30 + 300 + 7_500 + 4_500


def test_the_cost_is_rounded_up_once_not_per_kind() -> None:
    price = ModelPrice(input=1, output=1, cached_input=1, cache_write=1)
    # Each kind alone is a millionth of a unit; per kind rounding would make 4, once makes 1.
    assert price.cost(TokenUsage(input=1, cached_input=1, cache_write=1, output=1)) == 1
    assert price.cost(TokenUsage(input=999_999, output=1)) == 1
    assert price.cost(TokenUsage(input=1_000_000, output=1)) == 2
    assert price.cost(TokenUsage()) == 0


def test_a_fraction_of_a_unit_is_charged_as_a_whole_unit() -> None:
    price = ModelPrice(input=150_000, output=600_000)  # gpt-4o-mini: $0.15 / $0.60
    assert price.cost(TokenUsage(input=1)) == 1  # 0.15 micro-USD
    assert price.cost(TokenUsage(input=7, output=3)) == 3  # 1.05 + 1.80 = 2.85


def test_the_request_fee_is_added_after_the_rounding() -> None:
    price = ModelPrice(input=1, output=1, request_fee=5_000)
    assert price.cost(TokenUsage(input=1)) == 5_001
    assert price.cost(TokenUsage()) == 5_000
    assert price.worst_case(0, 0) == 5_000


def test_huge_counts_stay_exact() -> None:
    price = ModelPrice(input=MAX_PRICE, output=MAX_PRICE)
    usage = TokenUsage(input=MAX_LIMIT, output=MAX_LIMIT)
    expected = Fraction(2 * MAX_LIMIT * MAX_PRICE, TOKENS_PER_PRICE)
    assert price.cost(usage) == math.ceil(expected)
    assert isinstance(price.cost(usage), int)


def test_the_worst_case_holds_the_input_and_the_output_ceiling(table: PriceTable) -> None:
    # 1000 x 2.5 + 500 x 10
    assert table.worst_case("gpt-4o", 1_000, 500) == 7_500
    assert table.worst_case("gpt-4o-2024-08-06", 1_000, 500) == 7_500
    assert table.worst_case("gpt-4o", 0, 1) == 10


def test_the_worst_case_prices_the_input_at_the_dearest_prompt_price(table: PriceTable) -> None:
    # An Anthropic prompt written to the cache whole costs 3.75 a token, not 3: the hold
    # must cover it.
    assert table.worst_case("claude-sonnet-4-5", 1_000, 0) == 3_750
    whole_write = TokenUsage(cache_write=1_000, output=200)
    assert table.cost("claude-sonnet-4-5", whole_write) <= table.worst_case(
        "claude-sonnet-4-5", 1_000, 200)


def test_the_worst_case_refuses_a_count_that_is_not_one(table: PriceTable) -> None:
    with pytest.raises(TypeError, match="max_output_tokens"):
        table.worst_case("gpt-4o", 10, 2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input_tokens"):
        table.worst_case("gpt-4o", True, 2)
    with pytest.raises(ValueError, match="input_tokens"):
        table.worst_case("gpt-4o", -1, 2)
    with pytest.raises(ValueError, match="max_output_tokens"):
        table.worst_case("gpt-4o", 1, MAX_LIMIT + 1)


def test_cost_takes_a_token_usage_only(table: PriceTable) -> None:
    with pytest.raises(TypeError, match="TokenUsage.from_usage"):
        table.cost("gpt-4o", {"prompt_tokens": 3})  # type: ignore[arg-type]


def test_no_float_reaches_a_decision(table: PriceTable) -> None:
    usage = TokenUsage(input=3, cached_input=5, output=7)
    assert type(table.cost("gpt-4o", usage)) is int
    assert type(table.worst_case("gpt-4o", 3, 7)) is int
    assert table.to_currency(4_000) == Decimal("0.004")  # a Decimal, exact
    assert str(table.to_currency(2_500_001)) == "2.500001"
    assert str(table.to_currency(10**40 + 1)) == "1" + "0" * 34 + ".000001"


def hypothesis_usage() -> st.SearchStrategy[TokenUsage]:
    count = st.integers(min_value=0, max_value=10**9)
    return st.builds(TokenUsage, input=count, cached_input=count, cache_write=count,
                     output=count)


def hypothesis_price() -> st.SearchStrategy[ModelPrice]:
    price = st.integers(min_value=0, max_value=10**9)
    return st.builds(ModelPrice, input=price, output=price, cached_input=price,
                     cache_write=price, request_fee=st.integers(min_value=0, max_value=10**6))


KINDS = ("input", "cached_input", "cache_write", "output")


@given(price=hypothesis_price(), usage=hypothesis_usage(),
       kind=st.sampled_from(KINDS), more=st.integers(min_value=1, max_value=10**6))
def test_the_cost_is_the_exact_fraction_rounded_up_and_monotone_in_each_kind(
        price: ModelPrice, usage: TokenUsage, kind: str, more: int) -> None:
    exact = sum((Fraction(getattr(usage, k) * getattr(price, k), TOKENS_PER_PRICE)
                 for k in KINDS), Fraction(0))
    assert price.cost(usage) == math.ceil(exact) + price.request_fee
    bigger = TokenUsage(**{k: getattr(usage, k) + (more if k == kind else 0) for k in KINDS})
    assert price.cost(bigger) >= price.cost(usage)


@given(price=hypothesis_price(), usage=hypothesis_usage())
def test_the_worst_case_covers_every_usage_within_it(price: ModelPrice,
                                                     usage: TokenUsage) -> None:
    prompt = usage.input + usage.cached_input + usage.cache_write
    assert price.cost(usage) <= price.worst_case(prompt, usage.output)


# --- usage shapes -----------------------------------------------------------------------


def test_chat_completions_prompt_tokens_include_the_cached_ones() -> None:
    usage = {"prompt_tokens": 2_006, "completion_tokens": 300, "total_tokens": 2_306,
             "prompt_tokens_details": {"cached_tokens": 1_920, "audio_tokens": 0},
             "completion_tokens_details": {"reasoning_tokens": 256, "audio_tokens": 0}}
    assert TokenUsage.from_usage(usage) == TokenUsage(input=86, cached_input=1_920, output=300)


def test_reasoning_tokens_are_billed_once_as_output(table: PriceTable) -> None:
    with_reasoning = {"prompt_tokens": 10, "completion_tokens": 300,
                      "completion_tokens_details": {"reasoning_tokens": 256}}
    without = {"prompt_tokens": 10, "completion_tokens": 300}
    read = TokenUsage.from_usage(with_reasoning)
    assert read == TokenUsage.from_usage(without) == TokenUsage(input=10, output=300)
    assert read is not None and table.cost("gpt-4o", read) == 25 + 3_000


def test_chat_completions_without_details_and_embeddings() -> None:
    assert TokenUsage.from_usage({"prompt_tokens": 5, "completion_tokens": 7}) == TokenUsage(
        input=5, output=7)
    assert TokenUsage.from_usage({"prompt_tokens": 8, "total_tokens": 8}) == TokenUsage(input=8)
    assert TokenUsage.from_usage({"prompt_tokens": 8, "prompt_tokens_details": None}) == (
        TokenUsage(input=8))


def test_responses_input_tokens_include_the_cached_ones() -> None:
    usage = {"input_tokens": 1_500, "input_tokens_details": {"cached_tokens": 1_024},
             "output_tokens": 900, "output_tokens_details": {"reasoning_tokens": 700},
             "total_tokens": 2_400}
    assert TokenUsage.from_usage(usage) == TokenUsage(input=476, cached_input=1_024,
                                                      output=900)


def test_anthropic_input_tokens_exclude_cache_reads_and_writes() -> None:
    usage = {"input_tokens": 12, "cache_creation_input_tokens": 2_000,
             "cache_read_input_tokens": 30_000, "output_tokens": 450,
             "service_tier": "standard"}
    assert TokenUsage.from_usage(usage) == TokenUsage(input=12, cached_input=30_000,
                                                      cache_write=2_000, output=450)


def test_an_anthropic_stream_is_read_from_its_merged_counts() -> None:
    start = {"input_tokens": 25, "cache_read_input_tokens": 100, "output_tokens": 1}
    delta = {"output_tokens": 15}  # message_delta: cumulative
    assert TokenUsage.from_usage({**start, **delta}) == TokenUsage(input=25, cached_input=100,
                                                                   output=15)


def test_a_responses_usage_without_details_reads_as_its_counts() -> None:
    assert TokenUsage.from_usage({"input_tokens": 4, "output_tokens": 6}) == TokenUsage(
        input=4, output=6)


@pytest.mark.parametrize("usage", [None, [], "usage", 5, {}, {"total_tokens": 40},
                                   {"prompt_tokens": "12", "completion_tokens": None},
                                   {"input_tokens": -1, "output_tokens": True},
                                   {"cache_read_input_tokens": 1.5}])
def test_a_usage_that_reports_no_count_is_none(usage: object) -> None:
    assert TokenUsage.from_usage(usage) is None


def test_hostile_counts_are_bounded() -> None:
    # A cached count above its prompt is the prompt; a count above MAX_LIMIT is MAX_LIMIT;
    # a count that is not one is not reported.
    assert TokenUsage.from_usage({"prompt_tokens": 10, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 50}}) == TokenUsage(
        cached_input=10, output=2)
    assert TokenUsage.from_usage({"input_tokens": 10**30, "output_tokens": "x"}) == TokenUsage(
        input=MAX_LIMIT)
    assert TokenUsage.from_usage({"prompt_tokens": 3, "completion_tokens": 4,
                                  "prompt_tokens_details": {"cached_tokens": -2}}) == TokenUsage(
        input=3, output=4)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("input", -1, ValueError), ("output", 1.0, TypeError), ("cached_input", True, TypeError),
    ("cache_write", MAX_LIMIT + 1, ValueError), ("input", "3", TypeError)])
def test_a_token_usage_refuses_a_count_that_is_not_one(field: str, value: object,
                                                        error: type[Exception]) -> None:
    with pytest.raises(error, match=f"TokenUsage.{field}"):
        TokenUsage(**{field: value})  # type: ignore[arg-type]


def test_a_token_usage_is_frozen_and_totals_its_kinds() -> None:
    usage = TokenUsage(input=1, cached_input=2, cache_write=3, output=4)
    assert usage.total == 10
    with pytest.raises(AttributeError):
        usage.input = 5  # type: ignore[misc]


# --- matching ---------------------------------------------------------------------------


def test_an_exact_name_is_priced_before_any_rule() -> None:
    data = table_data(models={"gpt-4o": dict(GPT_4O), "gpt-4o-mini": {"input": 1, "output": 2}},
                      rules=[{"match": "gpt-4o*", "price_as": "gpt-4o"}])
    table = PriceTable.from_mapping(data)
    assert table.price_of("gpt-4o-mini") == ModelPrice(input=1, output=2)
    assert table.priced_as("gpt-4o-mini") == "gpt-4o-mini"
    assert table.priced_as("gpt-4o-mini-2024-07-18") == "gpt-4o"


def test_a_dated_snapshot_is_priced_as_its_model(table: PriceTable) -> None:
    assert table.priced_as("gpt-4o-2024-08-06") == "gpt-4o"
    assert table.price_of("gpt-4o-2024-08-06") is table.models["gpt-4o"]
    assert table.priced_as("claude-sonnet-4-5-20250929") == "claude-sonnet-4-5"


def test_the_first_matching_rule_wins() -> None:
    data = table_data(models={"a": {"input": 1, "output": 1}, "b": {"input": 2, "output": 2}},
                      rules=[{"match": "x-*", "price_as": "a"}, {"match": "x-1*", "price_as": "b"}])
    table = PriceTable.from_mapping(data)
    assert table.priced_as("x-100") == "a"
    data["rules"].reverse()
    assert PriceTable.from_mapping(data).priced_as("x-100") == "b"


def test_names_and_globs_are_case_sensitive(table: PriceTable) -> None:
    assert table.priced_as("GPT-4o") is None
    assert table.priced_as("gpt-4o-2024-08-06x") is None  # a glob matches the whole name
    assert PriceRule(match="a?c", price_as="x").matches("abc")
    assert not PriceRule(match="a?c", price_as="x").matches("ABC")


@pytest.mark.parametrize("model", ["gpt-5", "gpt-4o-mini", "", "x" * (MAX_MODEL_NAME_CHARS + 1),
                                   "gpt-4o-2024-08"])
def test_a_model_the_table_does_not_price_is_refused(table: PriceTable, model: str) -> None:
    with pytest.raises(UnpricedModel) as raised:
        table.cost(model, TokenUsage(input=1))
    assert raised.value.model == model
    assert repr(model)[:20] in str(raised.value)
    assert "2026-12-05" in str(raised.value)
    with pytest.raises(LookupError):
        table.worst_case(model, 1, 1)


def test_an_unpriced_model_that_is_not_a_string_is_refused(table: PriceTable) -> None:
    with pytest.raises(UnpricedModel):
        table.price_of(None)  # type: ignore[arg-type]


def test_the_default_prices_every_other_model_never_free() -> None:
    table = PriceTable.from_mapping(table_data(default={"input": 10_000_000,
                                                        "output": 40_000_000}))
    assert table.priced_as("mystery-model") is None
    assert table.cost("mystery-model", TokenUsage(input=100, output=10)) == 1_000 + 400
    assert table.cost("x" * 10_000, TokenUsage(input=1)) == 10
    assert table.cost("gpt-4o", TokenUsage(input=100)) == 250  # named models keep theirs


def test_a_table_with_only_a_default_prices_everything() -> None:
    table = PriceTable.from_mapping({"version": "v1", "currency": "credits",
                                     "units_per_currency": 1,
                                     "default": {"input": 3_000_000, "output": 6_000_000}})
    assert table.cost("anything", TokenUsage(input=1, output=1)) == 9


def test_left_out_cache_prices_are_the_input_price() -> None:
    price = ModelPrice.from_mapping({"input": 7, "output": 9})
    assert (price.cached_input, price.cache_write, price.request_fee) == (7, 7, 0)


# --- bad tables -------------------------------------------------------------------------


def refused(data: object, *needles: str) -> None:
    with pytest.raises(PriceTableError) as raised:
        PriceTable.from_mapping(data, source="prices.toml")
    message = str(raised.value)
    assert message.startswith("prices.toml"), message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(("value", "shown"), [(-1, "-1"), (2.5, "2.5"), ("2.50", "'2.50'"),
                                              (True, "True"), (None, "None"),
                                              (MAX_PRICE + 1, str(MAX_PRICE + 1))])
@pytest.mark.parametrize("kind", ["input", "cached_input", "cache_write", "output",
                                  "request_fee"])
def test_a_price_that_is_not_an_integer_of_units_is_refused(kind: str, value: object,
                                                             shown: str) -> None:
    data = table_data()
    data["models"]["gpt-4o"][kind] = value
    refused(data, "models.'gpt-4o'", kind, shown)
    data = table_data(default={"input": 1, "output": 1, kind: value})
    refused(data, "default", kind, shown)


def test_a_float_price_names_the_integer_to_write() -> None:
    data = table_data()
    data["models"]["gpt-4o"]["input"] = 2.5
    refused(data, "2_500_000")


@pytest.mark.parametrize(("where", "field", "hint"), [
    ((), "curency", "'currency'"), ((), "model", "'models'"),
    (("models", "gpt-4o"), "inptu", "'input'"), (("models", "gpt-4o"), "reasoning", ""),
    (("rules", 0), "price-as", "'price_as'")])
def test_an_unknown_field_is_refused_by_name(where: tuple[Any, ...], field: str,
                                              hint: str) -> None:
    data = table_data()
    target: Any = data
    for step in where:
        target = target[step]
    target[field] = 1
    refused(data, f"unknown field {field!r}", hint)


@pytest.mark.parametrize("field", ["version", "currency"])
def test_a_missing_label_is_refused(field: str) -> None:
    data = table_data()
    del data[field]
    refused(data, f"{field} is required")


@pytest.mark.parametrize("value", ["", "   ", 5, None, "x" * 201])
@pytest.mark.parametrize("field", ["version", "currency"])
def test_a_bad_label_is_refused(field: str, value: object) -> None:
    refused(table_data(**{field: value}), field)


@pytest.mark.parametrize("value", [0, 3, 1.0, -10, 10**16, "1000000", True])
def test_units_per_currency_must_be_a_power_of_ten(value: object) -> None:
    refused(table_data(units_per_currency=value), "units_per_currency")


@pytest.mark.parametrize("kind", ["input", "output"])
def test_input_and_output_prices_are_required(kind: str) -> None:
    data = table_data()
    del data["models"]["gpt-4o"][kind]
    refused(data, "models.'gpt-4o'", f"{kind} is required")


def test_a_model_name_of_10_kb_is_refused() -> None:
    data = table_data()
    data["models"]["m" * 10_240] = {"input": 1, "output": 1}
    refused(data, "models", "10240 characters", str(MAX_MODEL_NAME_CHARS))


def test_a_rule_glob_of_10_kb_is_refused() -> None:
    refused(table_data(rules=[{"match": "*" * 10_240, "price_as": "gpt-4o"}]),
            "rules[0].match", "10240 characters")


@pytest.mark.parametrize("name", ["", 5, None])
def test_a_model_name_that_is_not_a_name_is_refused(name: object) -> None:
    data = table_data()
    data["models"] = {name: {"input": 1, "output": 1}}
    refused(data, "models", "model name")


def test_an_empty_table_is_refused() -> None:
    refused(table_data(models={}, rules=[]), "empty")
    refused({"version": "v", "currency": "USD"}, "empty")


@pytest.mark.parametrize(("rules", "needle"), [
    ([{"match": "a*", "price_as": "gpt-5"}], "rules[0].price_as 'gpt-5'"),
    ([{"match": "a*"}], "rules[0]: price_as is required"),
    ([{"price_as": "gpt-4o"}], "rules[0]: match is required"),
    ([{"match": "a*", "price_as": "gpt-4o"}, {"match": "a*", "price_as": "gpt-4o"}],
     "rules[1].match 'a*' is a duplicate"),
    (["a*"], "rules[0] must be a table"), ({"match": "a"}, "rules must be a list"),
])
def test_a_bad_rule_is_refused(rules: object, needle: str) -> None:
    refused(table_data(rules=rules), needle)


@pytest.mark.parametrize("data", [None, [], "prices", 3])
def test_a_table_that_is_not_a_mapping_is_refused(data: object) -> None:
    refused(data, "must be a table")


def test_models_that_are_not_a_table_are_refused() -> None:
    refused(table_data(models=[["gpt-4o", GPT_4O]]), "models must be a table")
    refused(table_data(models={"gpt-4o": 5}), "models.'gpt-4o' must be a table")


def test_a_model_price_built_by_hand_is_checked() -> None:
    with pytest.raises(PriceTableError, match="cache_write"):
        ModelPrice(input=1, output=1, cache_write=-1)
    with pytest.raises(PriceTableError, match="input"):
        ModelPrice(input=1.5, output=1)  # type: ignore[arg-type]
    with pytest.raises(PriceTableError, match="request_fee"):
        ModelPrice(input=1, output=1, request_fee=None)  # type: ignore[arg-type]
    with pytest.raises(PriceTableError, match="output"):
        ModelPrice(input=1, output=None)  # type: ignore[arg-type]
    assert ModelPrice(input=4, output=1).cache_write == 4


def test_a_table_built_by_hand_is_checked() -> None:
    with pytest.raises(PriceTableError, match="empty"):
        PriceTable(version="v", currency="USD", models={})
    with pytest.raises(PriceTableError, match="price_as"):
        PriceTable(version="v", currency="USD", models={"a": ModelPrice(input=1, output=1)},
                   rules=(PriceRule(match="b*", price_as="c"),))
    table = PriceTable(version="v", currency="USD", models={"a": ModelPrice(input=1, output=1)})
    with pytest.raises(AttributeError):
        table.version = "w"  # type: ignore[misc]
    with pytest.raises(TypeError):
        table.models["b"] = ModelPrice(input=1, output=1)  # type: ignore[index]


# --- files ------------------------------------------------------------------------------


TOML_TABLE = """\
version = 2026-12-05
currency = "USD"

[models."gpt-4o"]
input = 2_500_000
cached_input = 1_250_000
output = 10_000_000

[[rules]]
match = "gpt-4o-20??-??-??"
price_as = "gpt-4o"
"""


def test_a_toml_file_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(TOML_TABLE, encoding="utf-8")
    table = PriceTable.load(path)
    assert table.version == "2026-12-05"  # a bare TOML date is its ISO text
    assert table.units_per_currency == 1_000_000
    assert table.cost("gpt-4o-2024-11-20", TokenUsage(input=1_000, output=100)) == 3_500


def test_a_json_file_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(table_data()), encoding="utf-8")
    assert PriceTable.load(str(path)).worst_case("gpt-4o", 1_000, 500) == 7_500


def test_a_duplicate_model_in_toml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(TOML_TABLE + '\n[models."gpt-4o"]\ninput = 1\noutput = 1\n',
                    encoding="utf-8")
    with pytest.raises(PriceTableError, match=r"prices\.toml: invalid TOML.*models.*gpt-4o"):
        PriceTable.load(path)


def test_a_duplicate_model_in_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    models = '{"gpt-4o": {"input": 1, "output": 1}, "gpt-4o": {"input": 2, "output": 2}}'
    path.write_text(f'{{"version": "v", "currency": "USD", "models": {models}}}',
                    encoding="utf-8")
    with pytest.raises(PriceTableError, match=r"prices\.json: invalid JSON: duplicate key 'gpt-4o'"):
        PriceTable.load(path)


def test_a_duplicate_price_in_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text('{"version": "v", "currency": "USD", "models": {"a": '
                    '{"input": 1, "output": 1, "input": 0}}}', encoding="utf-8")
    with pytest.raises(PriceTableError, match="duplicate key 'input'"):
        PriceTable.load(path)


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("prices.yaml", "version: v", "unsupported file type '.yaml'"),
    ("prices", "{}", "unsupported file type '(no suffix)'"),
    ("prices.json", "{", "invalid JSON"),
    ("prices.toml", "version = ", "invalid TOML"),
    ("prices.json", "[" * 100_000 + "]" * 100_000, "invalid JSON"),
])
def test_a_file_that_cannot_be_read_is_refused(tmp_path: Path, name: str, text: str,
                                                needle: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PriceTableError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        PriceTable.load(path)


def test_a_missing_or_undecodable_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PriceTableError, match="file not found"):
        PriceTable.load(tmp_path / "absent.toml")
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'version = "\xe9"\n')
    with pytest.raises(PriceTableError, match="cannot be read"):
        PriceTable.load(path)


def test_a_bad_table_in_a_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(TOML_TABLE.replace("input = 2_500_000", "input = 2.5"), encoding="utf-8")
    with pytest.raises(PriceTableError, match=rf"^{path}: models.'gpt-4o': input must be"):
        PriceTable.load(path)


def test_the_example_table_loads_and_prices_its_snapshots() -> None:
    table = PriceTable.load(EXAMPLE_TABLE)
    assert table.currency == "USD" and table.version
    assert table.default is None
    for model in table.models:
        assert table.priced_as(model) == model
    assert table.priced_as("gpt-4o-2024-08-06") == "gpt-4o"
    assert table.priced_as("gpt-4o-mini-2024-07-18") == "gpt-4o-mini"
    assert table.priced_as("claude-sonnet-4-5-20250929") == "claude-sonnet-4-5"
    with pytest.raises(UnpricedModel):
        table.price_of("gpt-3.5-turbo")


def test_the_public_names_are_exported() -> None:
    for name in ("PriceTable", "ModelPrice", "PriceRule", "TokenUsage", "UnpricedModel",
                 "PriceTableError"):
        assert name in genai_ratelimit.__all__
        assert getattr(genai_ratelimit, name) is getattr(genai_ratelimit.prices, name)
    assert issubclass(PriceTableError, ValueError)
    assert issubclass(UnpricedModel, LookupError)


def test_the_docs_table_is_a_valid_price_table() -> None:
    # The page's TOML blocks that are price tables (it also shows a tiers file's): those
    # with models.
    tables = [(block, tomllib.loads(block.code)) for block in
              code_blocks(DOCS / "spend-budgets.md") if block.language == "toml"]
    tables = [(block, data) for block, data in tables if "models" in data]
    assert tables
    for block, data in tables:
        table = PriceTable.from_mapping(data, source=block.name)
        assert table.priced_as("gpt-4o-2024-08-06") == "gpt-4o"
