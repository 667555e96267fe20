"""bench's command-line values: durations, level lists, percentages, --burst and --mix."""

from __future__ import annotations

import pytest

from llmdeploy.loadgen.parse import (
    BurstPlan,
    parse_burst,
    parse_duration,
    parse_float_list,
    parse_int_list,
    parse_mix,
    parse_percent,
)


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("2m", 120), ("500ms", 0.5), ("1h", 3600), ("45", 45), (" 1.5s ", 1.5)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "-3s", "0s", "3 days", "1.2.3s", "10x"])
def test_bad_durations_say_how(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_lists_are_sorted_without_repeats_so_the_last_is_the_load_asked():
    assert parse_int_list("16,1, 4,32,4") == [1, 4, 16, 32]
    assert parse_float_list("10,2,5,0.5") == [0.5, 2, 5, 10]


@pytest.mark.parametrize("text", ["", "1,,4", "0,4", "a", "4.5", "-1"])
def test_bad_concurrency_lists(text):
    with pytest.raises(ValueError):
        parse_int_list(text)


@pytest.mark.parametrize("text", ["0", "x", "inf", "1,-2", "nan"])
def test_bad_rate_lists(text):
    with pytest.raises(ValueError):
        parse_float_list(text)


def test_percentages_are_percent_with_or_without_the_sign():
    assert parse_percent("10%") == pytest.approx(0.10)
    assert parse_percent("99") == pytest.approx(0.99)
    assert parse_percent("0.5%") == pytest.approx(0.005)
    for bad in ("ten", "101%", "-1%"):
        with pytest.raises(ValueError):
            parse_percent(bad)


def test_burst():
    assert parse_burst("3x:20s") == BurstPlan(3.0, 20.0, 40.0)
    assert parse_burst("2.5x:1m:90s") == BurstPlan(2.5, 60.0, 90.0)
    assert parse_burst("3x:20s").before_s == 10.0
    assert parse_burst("3x:500ms").after_s == 2.0 and parse_burst("3x:500ms").before_s == 1.0
    for bad in ("3:20s", "3x", "1x:20s", "0.5x:10s", "3x:20s:1m:2m", "x:20s", "3x:never"):
        with pytest.raises(ValueError):
            parse_burst(bad)


def test_mix():
    m = parse_mix("1500:128", "1:4")
    assert (m.long_len, m.short_len, m.long_share) == (1500, 128, pytest.approx(0.2))
    assert parse_mix("100:10").long_share == 0.5
    assert parse_mix("100:10", "0:1").long_share == 0.0
    for lengths, ratio in (
        ("1500", "1:1"),
        ("0:128", "1:1"),
        ("1500:128", "0:0"),
        ("1500:128", "1/4"),
        ("a:b", "1:1"),
    ):
        with pytest.raises(ValueError):
            parse_mix(lengths, ratio)
