"""SamplingParams validation: bad values are refused with the parameter's name, never reach the engine."""

import math

import pytest

from scheduler_hooks.io import InvalidRequest, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", -0.5), ("temperature", "hot"), ("top_p", 0.0),
    ("top_p", 1.5), ("top_p", math.inf), ("top_k", 0), ("top_k", 2.5), ("min_p", -0.1),
    ("max_new_tokens", 0), ("max_new_tokens", True), ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0), ("stop", 5), ("stop", [""]), ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("seed", 10 ** 30), ("seed", 1.5),
    ("ignore_eos", "yes"),
])
def test_invalid_values_name_the_parameter(field, value):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({field: value})
    assert e.value.param == field
    assert field in str(e.value)


def test_unknown_parameter_is_refused():
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({"temprature": 0.5})
    assert e.value.param == "temprature"


def test_valid_values_pass_and_stop_string_becomes_list():
    p = SamplingParams.from_dict({"temperature": 0, "top_p": 1, "top_k": 5, "stop": "###", "seed": 2 ** 63,
                                  "stop_token_ids": [1, 2], "max_new_tokens": 3})
    assert p.stop == ["###"] and p.greedy and p.seed == 2 ** 63
