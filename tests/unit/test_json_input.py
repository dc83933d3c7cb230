"""The one rule on the keys of a client's JSON object (app/io/json_input.py `check_fields`), as each caller words it."""

from __future__ import annotations

import pytest

from app.core.options import PARAM_KEYS, parse_options
from app.io.errors import RequestError
from app.io.json_input import check_fields


def test_only_the_fields_a_body_takes_pass() -> None:
    check_fields({"a": 1, "t": 0.5}, {"a", "b", "t"}, "bad_params")
    with pytest.raises(RequestError) as e:
        check_fields({"a": 1, "weight": 0.2, "": None}, {"a", "b", "t"}, "bad_blend")
    assert e.value.code == "bad_blend" and str(e.value) == "unknown fields ['', 'weight']"


def test_params_name_the_keys_they_take() -> None:
    with pytest.raises(RequestError) as e:
        parse_options({"seed": 3, "sede": 3}, 100)
    assert e.value.code == "bad_params"
    assert str(e.value) == f"unknown params ['sede']; known: {sorted(PARAM_KEYS)}"
