"""Prices with no I/O: a price table the user supplies (a Python mapping, or a TOML / JSON
file read once at start-up), what a request may cost at most when it is admitted
(`worst_case`) and what it cost once its usage is known (`cost`). Nothing here talks to
Redis or HTTP, and nothing is fetched at run time: the table is the user's.

Money is integers. The table names its currency and how many money units make one of it
(`units_per_currency`, by default 1,000,000: amounts are micro-USD when the currency is
USD). Each model's prices are integers of money units per million tokens, one per billed
kind of token:

    version = "2026-12-05"            # required: the date or version of these prices
    currency = "USD"
    units_per_currency = 1_000_000    # money is counted in micro-USD

    [models."gpt-4o"]
    input = 2_500_000                 # $2.50 per million input tokens
    cached_input = 1_250_000          # a prompt-cache read (default: the input price)
    output = 10_000_000               # output, reasoning tokens included
    # cache_write = ...               # a prompt-cache write (default: the input price)
    # request_fee = ...               # money units per request (default: 0)

    [[rules]]                         # dated snapshots priced as their model
    match = "gpt-4o-2???-??-??"       # a glob (fnmatch, case-sensitive)
    price_as = "gpt-4o"

    [default]                         # optional: the price of every other model
    input = 10_000_000
    output = 40_000_000

A model is priced by its exact name first, then by the first rule (in the table's order)
whose glob matches it, then by `default`; with none of them it is refused
(`UnpricedModel`), never free.

A request's cost is exact: the sum over the kinds of tokens x price per million is an
integer of millionths of a money unit, divided by 1,000,000 and rounded UP once, then the
per-request fee is added. No float takes part in any decision.

Bad tables are refused when built (`PriceTableError`, a ValueError), the message naming the
field: a price that is not an integer >= 0 (a float such as 2.5 included: write 2_500_000
micro-USD), an unknown field, a model name longer than MAX_MODEL_NAME_CHARS, a duplicate
model or rule, a rule that prices as a model the table lacks, an empty table."""

from __future__ import annotations

import datetime
import difflib
import fnmatch
import os
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, localcontext
from types import MappingProxyType

from ._native import MAX_LIMIT
from ._tiers_config import read_config_file

__all__ = [
    "PriceTable",
    "ModelPrice",
    "PriceRule",
    "TokenUsage",
    "UnpricedModel",
    "PriceTableError",
    "TOKENS_PER_PRICE",
    "MAX_MODEL_NAME_CHARS",
    "MAX_PRICE",
    "usage_count",
    "ANTHROPIC_USAGE_FIELDS",
]

# Prices are per this many tokens.
TOKENS_PER_PRICE = 1_000_000
# The longest model name (or rule glob) a table takes; a request naming a longer model is
# unpriced. The same bound as the request's `model` the FastAPI layer reads.
MAX_MODEL_NAME_CHARS = 256
# The largest price (money units per million tokens, or a request fee) and the largest
# units_per_currency: 2**53 - 1, what Lua's doubles hold exactly.
MAX_PRICE = MAX_LIMIT
_MAX_LABEL_CHARS = 200  # version and currency
# units_per_currency: money units are a decimal fraction of the currency (cents, micro-units).
_POWERS_OF_TEN = frozenset(10**exponent for exponent in range(16))

PRICE_KINDS = ("input", "cached_input", "cache_write", "output", "request_fee")
_REQUIRED_KINDS = ("input", "output")
_CACHE_KINDS = ("cached_input", "cache_write")  # None: the input price
_TABLE_FIELDS = ("version", "currency", "units_per_currency", "models", "rules", "default")
_RULE_FIELDS = ("match", "price_as")
# The Anthropic Messages usage fields, each a disjoint kind of billed tokens.
ANTHROPIC_USAGE_FIELDS = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                          "cache_read_input_tokens")


class PriceTableError(ValueError):
    """A price table that cannot be used: the message names where it came from, the field
    and why."""


class UnpricedModel(LookupError):
    """A model the table does not price (no exact name, no rule, no default). `model` is
    the name asked for, for the HTTP layer to answer with a 4xx that names it."""

    def __init__(self, model: object, version: str = "") -> None:
        shown = repr(model)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        where = f" (price table {version!r})" if version else ""
        super().__init__(f"model {shown} has no price{where}: no exact name, no rule "
                         "matches it and the table has no default")
        self.model = model


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def usage_count(value: object) -> int | None:
    """A token count as a usage object reports it: an int >= 0 (not a bool); anything else
    is None (not reported). The one rule of what a provider's count is, also read by the
    FastAPI layer's usage scanner."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _bounded_count(value: object) -> int | None:
    count = usage_count(value)
    return None if count is None else min(count, MAX_LIMIT)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


# --- usage ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """A request's tokens by billed kind, each an int from 0 to MAX_LIMIT; the kinds are
    disjoint (no token is in two):

    - `input`: prompt tokens billed at the input price (neither read from nor written to
      a prompt cache);
    - `cached_input`: prompt tokens read from a prompt cache;
    - `cache_write`: prompt tokens written to a prompt cache (Anthropic);
    - `output`: generated tokens, reasoning tokens included."""

    input: int = 0
    cached_input: int = 0
    cache_write: int = 0
    output: int = 0

    def __post_init__(self) -> None:
        for kind in ("input", "cached_input", "cache_write", "output"):
            value = getattr(self, kind)
            if not _is_integer(value):
                raise TypeError(f"TokenUsage.{kind} must be an int, got {_shown(value)}")
            if not 0 <= value <= MAX_LIMIT:
                raise ValueError(f"TokenUsage.{kind} must be from 0 to {MAX_LIMIT}, "
                                 f"got {_shown(value)}")

    @property
    def total(self) -> int:
        """Every token of the request, all kinds together."""
        return self.input + self.cached_input + self.cache_write + self.output

    @classmethod
    def from_usage(cls, usage: object) -> TokenUsage | None:
        """The tokens by kind of a provider's `usage` object (a decoded JSON mapping):

        - OpenAI chat completions (and completions, embeddings): `prompt_tokens` INCLUDES
          `prompt_tokens_details.cached_tokens`, so input = prompt_tokens - cached_tokens
          and cached_input = cached_tokens; output = `completion_tokens`, which includes
          `completion_tokens_details.reasoning_tokens` (billed once, as output).
        - OpenAI Responses: the same with `input_tokens` (including
          `input_tokens_details.cached_tokens`) and `output_tokens` (including
          `output_tokens_details.reasoning_tokens`).
        - Anthropic Messages: `input_tokens` EXCLUDES the cache, so input = input_tokens,
          cached_input = `cache_read_input_tokens`, cache_write =
          `cache_creation_input_tokens`, output = `output_tokens`. A stream's counts are
          its `message_start` usage updated by the `message_delta` ones (cumulative):
          merge them into one mapping first.

        A usage with `prompt_tokens` or `completion_tokens` is read as chat completions;
        else one with `input_tokens_details` or `output_tokens_details` as Responses; else
        as Anthropic (a Responses usage without details reads the same either way). A count
        that is not an int >= 0 counts as not reported (usage_count), a cached count above
        its prompt is the prompt, a count above MAX_LIMIT is MAX_LIMIT. None when the
        mapping reports none of these counts (its cost is unknown: a hold should stay).
        Never raises."""
        if not isinstance(usage, Mapping):
            return None
        if "prompt_tokens" in usage or "completion_tokens" in usage:
            return _openai_usage(usage, "prompt_tokens", "completion_tokens",
                                 "prompt_tokens_details")
        if "input_tokens_details" in usage or "output_tokens_details" in usage:
            return _openai_usage(usage, "input_tokens", "output_tokens", "input_tokens_details")
        counts = [_bounded_count(usage.get(field)) for field in ANTHROPIC_USAGE_FIELDS]
        if all(count is None for count in counts):
            return None
        input_tokens, output, cache_write, cached_input = (count or 0 for count in counts)
        return cls(input=input_tokens, cached_input=cached_input, cache_write=cache_write,
                   output=output)


def _openai_usage(usage: Mapping[object, object], prompt_field: str, output_field: str,
                  details_field: str) -> TokenUsage | None:
    prompt = _bounded_count(usage.get(prompt_field))
    output = _bounded_count(usage.get(output_field))
    if prompt is None and output is None:
        return None
    prompt = prompt or 0
    details = usage.get(details_field)
    cached = _bounded_count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    cached = min(cached or 0, prompt)
    return TokenUsage(input=prompt - cached, cached_input=cached, output=output or 0)


# --- prices ---------------------------------------------------------------------------


def _price(where: str, kind: str, value: object) -> int:
    if isinstance(value, float) or (isinstance(value, str) and value):
        hint = (" (prices are integers of money units per million tokens: 2.50 per million "
                "is 2_500_000 when units_per_currency is 1_000_000)")
    else:
        hint = ""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRICE:
        raise PriceTableError(f"{where}: {kind} must be an integer of money units from 0 to "
                              f"{MAX_PRICE}, got {_shown(value)}{hint}")
    return value


def _unknown_field(where: str, field: object, known: tuple[str, ...]) -> PriceTableError:
    close = difflib.get_close_matches(str(field), known, n=1) if isinstance(field, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return PriceTableError(f"{where}: unknown field {_shown(field)}{hint}; the fields are "
                           f"{', '.join(known)}")


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """One model's prices: integers of money units per million tokens of each billed kind
    (`cached_input` and `cache_write` default to `input`: a table that leaves them out
    never prices a cached token below an uncached one), and `request_fee`, money units per
    request. Raises PriceTableError for a price that is not an integer from 0 to
    MAX_PRICE."""

    input: int
    output: int
    cached_input: int | None = None
    cache_write: int | None = None
    request_fee: int = 0

    def __post_init__(self) -> None:
        for kind in PRICE_KINDS:
            value = getattr(self, kind)
            if value is None and kind in _CACHE_KINDS:
                object.__setattr__(self, kind, self.input)  # checked first: PRICE_KINDS[0]
            else:
                _price("ModelPrice", kind, value)

    @classmethod
    def from_mapping(cls, data: object, where: str = "price") -> ModelPrice:
        """A model's price from its table ({"input": ..., "output": ..., ...}); raises
        PriceTableError naming `where` and the field."""
        if not isinstance(data, Mapping):
            raise PriceTableError(f"{where} must be a table of prices, got {_shown(data)}")
        for field in data:
            if field not in PRICE_KINDS:
                raise _unknown_field(where, field, PRICE_KINDS)
        for kind in _REQUIRED_KINDS:
            if kind not in data:
                raise PriceTableError(f"{where}: {kind} is required (money units per million "
                                      "tokens)")
        prices = {kind: _price(where, kind, data[kind]) for kind in PRICE_KINDS if kind in data}
        return cls(**prices)

    def _prices(self) -> tuple[int, int, int, int]:
        # __post_init__ filled both defaults.
        assert self.cached_input is not None and self.cache_write is not None
        return self.input, self.cached_input, self.cache_write, self.output

    def cost(self, usage: TokenUsage) -> int:
        """The exact cost of a request, in money units: the sum over the kinds of tokens x
        price per million, divided by TOKENS_PER_PRICE rounded up (once), plus the
        request fee."""
        if not isinstance(usage, TokenUsage):
            raise TypeError(f"usage must be a TokenUsage, got {type(usage).__name__} "
                            "(TokenUsage.from_usage reads a provider's usage)")
        input_price, cached_price, write_price, output_price = self._prices()
        micro = (usage.input * input_price + usage.cached_input * cached_price
                 + usage.cache_write * write_price + usage.output * output_price)
        return _ceil_div(micro, TOKENS_PER_PRICE) + self.request_fee

    def worst_case(self, input_tokens: int, max_output_tokens: int) -> int:
        """The most a request may cost, in money units, to hold when it is admitted:
        input_tokens at the highest price a prompt token can have (the input, cached input
        and cache write prices: an Anthropic prompt may be written to the cache whole, at
        more than the input price), max_output_tokens at the output price, rounded up once,
        plus the request fee. Never below cost() of a usage with at most these tokens."""
        for name, value in (("input_tokens", input_tokens),
                            ("max_output_tokens", max_output_tokens)):
            if not _is_integer(value):
                raise TypeError(f"{name} must be an int, got {_shown(value)}")
            if not 0 <= value <= MAX_LIMIT:
                raise ValueError(f"{name} must be from 0 to {MAX_LIMIT}, got {_shown(value)}")
        input_price, cached_price, write_price, output_price = self._prices()
        micro = (input_tokens * max(input_price, cached_price, write_price)
                 + max_output_tokens * output_price)
        return _ceil_div(micro, TOKENS_PER_PRICE) + self.request_fee


def _model_name(where: str, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise PriceTableError(f"{where}: a model name must be a non-empty string, got "
                              f"{_shown(name)}")
    if len(name) > MAX_MODEL_NAME_CHARS:
        raise PriceTableError(f"{where}: model name {_shown(name)} is {len(name)} characters, "
                              f"more than {MAX_MODEL_NAME_CHARS}")
    return name


@dataclass(frozen=True, slots=True)
class PriceRule:
    """Models whose name matches the glob `match` (fnmatch, case-sensitive: `*` any run of
    characters, `?` one, `[...]` a set) are priced as the table's model `price_as`."""

    match: str
    price_as: str

    def matches(self, model: str) -> bool:
        return fnmatch.fnmatchcase(model, self.match)


def _label(where: str, field: str, value: object) -> str:
    if isinstance(value, datetime.date):  # TOML's bare date: version = 2026-12-05
        value = value.isoformat()
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_LABEL_CHARS:
        raise PriceTableError(f"{where}: {field} must be a non-empty string of at most "
                              f"{_MAX_LABEL_CHARS} characters, got {_shown(value)}")
    return value


def _units(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in _POWERS_OF_TEN:
        raise PriceTableError(f"{where}: units_per_currency must be a power of ten from 1 to "
                              f"10**15 (1_000_000: micro-units), got {_shown(value)}")
    return value


class PriceTable:
    """A validated price table (immutable). Build it with `PriceTable.from_mapping(data)`
    or `PriceTable.load(path)`; read a model's price with `price_of`, a request's hold with
    `worst_case` and its settlement with `cost` (money units, ints)."""

    __slots__ = ("version", "currency", "units_per_currency", "models", "rules", "default")

    version: str
    currency: str
    units_per_currency: int
    models: Mapping[str, ModelPrice]
    rules: tuple[PriceRule, ...]
    default: ModelPrice | None

    def __init__(self, *, version: str, currency: str, models: Mapping[str, ModelPrice],
                 rules: tuple[PriceRule, ...] = (), default: ModelPrice | None = None,
                 units_per_currency: int = 1_000_000, source: str = "price table") -> None:
        where = source
        version, currency = _label(where, "version", version), _label(where, "currency", currency)
        _units(where, units_per_currency)
        if not models and default is None:
            raise PriceTableError(f"{where} {version!r}: empty: it prices no model and has "
                                  "no default")
        for name, price in models.items():
            _model_name(f"{where}: models", name)
            if not isinstance(price, ModelPrice):
                raise PriceTableError(f"{where}: models.{name!r} must be a ModelPrice")
        seen: set[str] = set()
        for index, rule in enumerate(rules):
            if not isinstance(rule, PriceRule):
                raise PriceTableError(f"{where}: rules[{index}] must be a PriceRule")
            _model_name(f"{where}: rules[{index}].match", rule.match)
            if rule.match in seen:
                raise PriceTableError(f"{where}: rules[{index}].match {rule.match!r} is a "
                                      "duplicate (an earlier rule has it)")
            seen.add(rule.match)
            if rule.price_as not in models:
                raise PriceTableError(f"{where}: rules[{index}].price_as {_shown(rule.price_as)} "
                                      "is not a model of the table")
        if default is not None and not isinstance(default, ModelPrice):
            raise PriceTableError(f"{where}: default must be a ModelPrice")
        set_ = object.__setattr__
        set_(self, "version", version)
        set_(self, "currency", currency)
        set_(self, "units_per_currency", units_per_currency)
        set_(self, "models", MappingProxyType(dict(models)))
        set_(self, "rules", tuple(rules))
        set_(self, "default", default)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a PriceTable is immutable")

    def __repr__(self) -> str:
        return (f"PriceTable(version={self.version!r}, currency={self.currency!r}, "
                f"models={len(self.models)}, rules={len(self.rules)}, "
                f"default={'yes' if self.default is not None else 'no'})")

    @classmethod
    def from_mapping(cls, data: object, *, source: str = "price table") -> PriceTable:
        """A table from its mapping (the shape of the TOML / JSON file: version, currency,
        units_per_currency, models, rules, default). Raises PriceTableError whose message
        starts with `source` and names the field."""
        if not isinstance(data, Mapping):
            raise PriceTableError(f"{source}: must be a table (a mapping), got {_shown(data)}")
        for field in data:
            if field not in _TABLE_FIELDS:
                raise _unknown_field(source, field, _TABLE_FIELDS)
        for field in ("version", "currency"):
            if field not in data:
                raise PriceTableError(f"{source}: {field} is required")
        version = _label(source, "version", data["version"])
        currency = _label(source, "currency", data["currency"])
        units = _units(source, data.get("units_per_currency", 1_000_000))
        raw_models = data.get("models", {})
        if not isinstance(raw_models, Mapping):
            raise PriceTableError(f"{source}: models must be a table of model -> prices, got "
                                  f"{_shown(raw_models)}")
        models: dict[str, ModelPrice] = {}
        for name, prices in raw_models.items():
            name = _model_name(f"{source}: models", name)
            models[name] = ModelPrice.from_mapping(prices, f"{source}: models.{name!r}")
        raw_rules = data.get("rules", [])
        if not isinstance(raw_rules, (list, tuple)):
            raise PriceTableError(f"{source}: rules must be a list of tables "
                                  f"{{match, price_as}}, got {_shown(raw_rules)}")
        rules: list[PriceRule] = []
        for index, rule in enumerate(raw_rules):
            where = f"{source}: rules[{index}]"
            if not isinstance(rule, Mapping):
                raise PriceTableError(f"{where} must be a table {{match, price_as}}, got "
                                      f"{_shown(rule)}")
            for field in rule:
                if field not in _RULE_FIELDS:
                    raise _unknown_field(where, field, _RULE_FIELDS)
            for field in _RULE_FIELDS:
                if field not in rule:
                    raise PriceTableError(f"{where}: {field} is required")
            rules.append(PriceRule(match=_model_name(f"{where}.match", rule["match"]),
                                   price_as=_model_name(f"{where}.price_as", rule["price_as"])))
        default = (ModelPrice.from_mapping(data["default"], f"{source}: default")
                   if "default" in data else None)
        return cls(version=version, currency=currency, units_per_currency=units,
                   models=models, rules=tuple(rules), default=default, source=source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PriceTable:
        """A table from a `.toml` or `.json` file (UTF-8), read once. Raises
        PriceTableError naming the file: unreadable, not TOML / JSON, a duplicate key (both
        formats refuse one), or a table from_mapping refuses."""
        where = str(path)
        data = read_config_file(path, where, PriceTableError)
        return cls.from_mapping(data, source=where)

    def priced_as(self, model: str) -> str | None:
        """The table's name for the price of `model`: itself when the table has it, else
        the `price_as` of the first rule that matches it, else None (the default prices
        it, or UnpricedModel when there is none)."""
        if not isinstance(model, str) or not model or len(model) > MAX_MODEL_NAME_CHARS:
            return None
        if model in self.models:
            return model
        for rule in self.rules:
            if rule.matches(model):
                return rule.price_as
        return None

    def price_of(self, model: str) -> ModelPrice:
        """The price of `model` (exact name, then the first rule that matches, then the
        default). Raises UnpricedModel when none prices it (a name that is not a str of 1
        to MAX_MODEL_NAME_CHARS characters included)."""
        name = self.priced_as(model)
        if name is not None:
            return self.models[name]
        if self.default is not None:
            return self.default
        raise UnpricedModel(model, self.version)

    def cost(self, model: str, usage: TokenUsage) -> int:
        """The exact cost of a request to `model`, in money units (ModelPrice.cost).
        Raises UnpricedModel."""
        return self.price_of(model).cost(usage)

    def worst_case(self, model: str, input_tokens: int, max_output_tokens: int) -> int:
        """The hold of a request to `model` at admission, in money units
        (ModelPrice.worst_case). Raises UnpricedModel."""
        return self.price_of(model).worst_case(input_tokens, max_output_tokens)

    def to_currency(self, amount: int) -> Decimal:
        """An amount of money units in the currency, exactly (a Decimal, for display:
        2_500_000 micro-USD is Decimal('2.5'); units_per_currency is a power of ten, so
        the quotient has finitely many digits)."""
        if not _is_integer(amount):
            raise TypeError(f"amount must be an int, got {_shown(amount)}")
        with localcontext() as context:  # enough digits for an exact quotient
            context.prec = len(str(abs(amount))) + 2
            return Decimal(amount) / Decimal(self.units_per_currency)
