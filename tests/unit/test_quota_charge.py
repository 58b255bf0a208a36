"""What a response costs (quota/charge.py, pure), and the descriptors Envoy is given to say it
(routing/quotas.py): issue 41, finding 1. A stream with `max_tokens: 1` and
`max_completion_tokens: 3000` was charged 23 tokens; the estimate read only max_tokens."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.quota.charge import DEFAULT_OUTPUT_ESTIMATE, MAX_COPIES, MAX_USAGE, charged_tokens, count
from controlplane.routing.quotas import COPIES_FIELDS, OUTPUT_LIMIT_FIELDS


def test_the_estimate_takes_the_largest_output_limit_the_request_carries() -> None:
    # The finding: 92 bytes of request, max_tokens 1, max_completion_tokens 3000.
    assert charged_tokens({"prompt_bytes": "92", "max_tokens": "1", "max_completion_tokens": "3000"}) == (
        23 + 3000,
        "estimate",
    )
    # json_to_metadata writes a JSON number as text with decimals.
    assert charged_tokens({"max_tokens": "1.000000", "max_completion_tokens": "3000.000000"}) == (
        3000,
        "estimate",
    )
    for key in OUTPUT_LIMIT_FIELDS:  # each dialect's name counts alone
        assert charged_tokens({"max_tokens": "none", key: "700"}) == (700, "estimate"), key


def test_n_and_best_of_multiply_the_output() -> None:
    assert charged_tokens({"max_tokens": "100", "n": "3"}) == (300, "estimate")
    assert charged_tokens({"max_tokens": "100", "n": "2", "best_of": "5"}) == (500, "estimate")
    assert charged_tokens({"parameters_best_of": "4"}) == (4 * DEFAULT_OUTPUT_ESTIMATE, "estimate")
    assert charged_tokens({"max_tokens": "10", "n": "1000000"}) == (10 * MAX_COPIES, "estimate")
    assert charged_tokens({"max_tokens": "10", "n": "0"}) == (10, "estimate")
    assert set(COPIES_FIELDS) == {"n", "best_of", "parameters_best_of"}


def test_a_sane_usage_wins_and_anything_else_is_estimated() -> None:
    assert charged_tokens({"usage": "3005", "max_completion_tokens": "3000"}) == (3005, "usage")
    assert charged_tokens({"usage": "0"}) == (0, "usage")
    estimate = {"prompt_bytes": "400", "max_tokens": "10"}
    for bad in ("-5", "1e12", "nan", "inf", "-inf", "lots", "", "none", "1e400", "9" * 50):
        assert charged_tokens({"usage": bad, **estimate}) == (110, "estimate"), bad


def test_absurd_limits_are_bounded_and_never_crash() -> None:
    # 1e400 is infinite as a double: int(float(...)) raised OverflowError, so the charge call
    # failed and the response went free.
    assert charged_tokens({"max_tokens": "1e400"}) == (DEFAULT_OUTPUT_ESTIMATE, "estimate")
    assert charged_tokens({"max_tokens": "1e300"}) == (MAX_USAGE, "estimate")
    assert charged_tokens({"max_tokens": "-1", "n_predict": "-1"}) == (DEFAULT_OUTPUT_ESTIMATE, "estimate")
    assert charged_tokens({"prompt_bytes": "1e300", "max_tokens": "5"}) == (MAX_USAGE, "estimate")
    assert charged_tokens({"max_tokens": "0"}) == (1, "estimate")  # never free
    assert count("  42 ") == 42 and count(None) is None and count("4" * 41) is None


@given(
    st.dictionaries(
        st.sampled_from(["usage", "prompt_bytes", *OUTPUT_LIMIT_FIELDS, *COPIES_FIELDS]), st.text()
    )
)
def test_any_values_give_a_bounded_charge(entries: dict[str, str]) -> None:
    tokens, how = charged_tokens(entries)
    assert how in ("usage", "estimate")
    assert (0 if how == "usage" else 1) <= tokens <= MAX_USAGE
