"""Money from token counts: the spec's `cost:` prices applied to what was served locally and by the cloud.

Pure functions over plain numbers; the router (status, dashboard) and `llmdeploy bench` call them. "Tokens"
means input + output tokens unless a name says otherwise. Local serving costs the machine's price per hour
whatever it serves, so its cost per 1M tokens is that hour's price spread over the tokens it served.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

HOUR_S = 3600.0
DAY_S = 86400.0
PER = 1_000_000


@dataclass(frozen=True)
class Prices:
    cloud_input_per_1m: float | None = None
    cloud_output_per_1m: float | None = None
    local_per_hour: float | None = None
    currency: str = "USD"

    @classmethod
    def from_spec(cls, cost: Any) -> Prices:
        """From the spec's CostSpec (or None: no prices)."""
        if cost is None:
            return cls()
        return cls(cost.cloud_input_per_1m, cost.cloud_output_per_1m, cost.local_per_hour, cost.currency)

    @property
    def has_cloud(self) -> bool:
        return self.cloud_input_per_1m is not None or self.cloud_output_per_1m is not None

    @property
    def configured(self) -> bool:
        return self.has_cloud or self.local_per_hour is not None


@dataclass(frozen=True)
class Tokens:
    """Input and output tokens one backend served over some span."""

    input: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        return self.input + self.output


def cloud_cost(prices: Prices, tokens: Tokens) -> float | None:
    """What the cloud charged for these tokens; None without cloud prices."""
    if not prices.has_cloud:
        return None
    return (
        tokens.input * (prices.cloud_input_per_1m or 0.0)
        + tokens.output * (prices.cloud_output_per_1m or 0.0)
    ) / PER


def cloud_per_1m(prices: Prices, tokens: Tokens) -> float | None:
    """The cloud's price per 1M tokens at this input/output mix; with no tokens yet, the mean of the two prices."""
    if not prices.has_cloud:
        return None
    if tokens.total == 0:
        return ((prices.cloud_input_per_1m or 0.0) + (prices.cloud_output_per_1m or 0.0)) / 2
    spent = cloud_cost(prices, tokens)
    return None if spent is None else spent / tokens.total * PER


def local_per_1m(prices: Prices, tokens: Tokens, span_s: float) -> float | None:
    """The machine's cost over `span_s` spread over the tokens it served then; None when nothing was served."""
    if prices.local_per_hour is None or tokens.total == 0 or span_s <= 0:
        return None
    return prices.local_per_hour * (span_s / HOUR_S) / tokens.total * PER


@dataclass(frozen=True)
class CostReport:
    currency: str
    local_per_1m: float | None  # over the last hour (or since start, when shorter)
    cloud_per_1m: float | None
    spill_last_hour: float | None  # what the cloud cost: overflow, bursts and failovers together
    spill_last_day: float | None
    local_tokens_last_hour: int
    cloud_tokens_last_hour: int
    span_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cost_report(
    prices: Prices, local_hour: Tokens, cloud_hour: Tokens, cloud_day: Tokens, span_s: float
) -> CostReport:
    """Status, dashboard: local vs cloud per 1M tokens over the last hour (`span_s`: that hour, or less since the
    router started) and the money the spill to the cloud cost over the last hour and day."""
    return CostReport(
        currency=prices.currency,
        local_per_1m=local_per_1m(prices, local_hour, span_s),
        cloud_per_1m=cloud_per_1m(prices, cloud_hour),
        spill_last_hour=cloud_cost(prices, cloud_hour),
        spill_last_day=cloud_cost(prices, cloud_day),
        local_tokens_last_hour=local_hour.total,
        cloud_tokens_last_hour=cloud_hour.total,
        span_s=span_s,
    )


@dataclass(frozen=True)
class BenchCost:
    """A bench level's tokens priced: the machine at that level's throughput vs the cloud for the same requests."""

    currency: str
    output_tokens_per_s: float
    local_per_1m_output: float | None  # the machine's hour over the output tokens it makes in an hour
    cloud_per_1m_output: float | None  # the cloud's price for the same requests (prompts too), per 1M output

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        def money(v: float | None) -> str:
            return "-" if v is None else f"{v:,.2f} {self.currency}"

        text = f"{money(self.local_per_1m_output)} per 1M output tokens locally"
        text += f" at {self.output_tokens_per_s:.1f} output tokens/s"
        if self.cloud_per_1m_output is not None:
            text += f", {money(self.cloud_per_1m_output)} at the cloud's prices"
        return text


def bench_cost(
    prices: Prices,
    output_tokens_per_s: float,
    mean_prompt_tokens: float | None,
    mean_output_tokens: float | None,
) -> BenchCost | None:
    if not prices.configured:
        return None
    local = None
    if prices.local_per_hour is not None and output_tokens_per_s > 0:
        local = prices.local_per_hour / (output_tokens_per_s * HOUR_S) * PER
    cloud = None
    if prices.has_cloud:
        # each output token brings its request's share of the prompt along
        ratio = (mean_prompt_tokens or 0.0) / mean_output_tokens if mean_output_tokens else 0.0
        cloud = (prices.cloud_output_per_1m or 0.0) + ratio * (prices.cloud_input_per_1m or 0.0)
    return BenchCost(prices.currency, output_tokens_per_s, local, cloud)
