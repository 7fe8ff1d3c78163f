"""plait/bench/engine_options.py: the benchmark scripts' `NAME=VALUE` engine options."""

from __future__ import annotations

import pytest

from plait.bench.engine_options import engine_options, option_value


def test_values_take_their_type() -> None:
    assert option_value("true") is True and option_value("False") is False
    assert option_value("12") == 12 and isinstance(option_value("12"), int)
    assert option_value("0.5") == 0.5
    assert option_value("exact") == "exact" and option_value("") == ""


def test_items_become_keyword_arguments() -> None:
    assert engine_options(["numerics=exact", "num_kv_blocks=64", "native=false",
                           "kv_cache_memory_gb=1.5", "served=a=b"]) == {
        "numerics": "exact", "num_kv_blocks": 64, "native": False,
        "kv_cache_memory_gb": 1.5, "served": "a=b"}
    assert engine_options([]) == {}


@pytest.mark.parametrize("item", ["numerics", "=exact"])
def test_an_item_without_a_name_and_value_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match=f"option {item!r}: expected NAME=VALUE"):
        engine_options([item])
