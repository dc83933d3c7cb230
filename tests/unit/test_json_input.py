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


def test_unused_fields_hold_their_documented_types():
    """check_types (app/io/checks.py): the rule for fields a route accepts and does not use."""
    from app.io.checks import check_types

    types = {"model": (str,), "duration": (float,), "speed": (float, str), "flag": (bool,), "ctl": (dict,)}
    good = {"model": "tts-1", "duration": 5, "speed": "slow", "flag": False, "ctl": {}}
    check_types(good, types, "bad_params")
    check_types({k: None for k in types}, types, "bad_params")  # null is left out
    check_types({"speed": 1.5, "other": object()}, types, "bad_params")  # only the named fields
    for key, value in (
        ("model", 3),
        ("model", ["tts-1"]),
        ("model", True),
        ("duration", True),  # a boolean is no number
        ("duration", "5"),
        ("duration", float("nan")),
        ("duration", 10**400),
        ("speed", []),
        ("flag", 0),
        ("ctl", []),
    ):
        with pytest.raises(RequestError) as e:
            check_types({key: value}, types, "bad_message", "voice.")
        assert e.value.code == "bad_message" and f"voice.{key} must be" in str(e.value), (key, value)
