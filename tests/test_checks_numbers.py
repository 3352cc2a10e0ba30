"""Every numeric setting is refused at startup unless it is a real number in its range.

A NaN interval never compares, an infinite one overflows a datetime, "soon" raises
in the dispatcher at its first pass, a negative ``clear_finished_jobs_after``
deletes finished jobs before anyone reads them: each must be a system check error
naming the setting, and a value the checks let through must be one the runtime
can use.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from django.core.checks import Error
from django.tasks import default_task_backend
from django.test import override_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from django_jobs.checks import backend_checks
from django_jobs.limits import MAX_SECONDS

GIB = 2**30

# The documented range of each numeric setting (docs/configuration.md), written out
# here rather than read from the checks, so a check that drifts from it fails.
# name -> (kind, minimum, strict minimum, maximum, None allowed, check id)
DOCUMENTED: dict[str, tuple[str, float, bool, float, bool, str]] = {
    "processes": ("int", 1, False, 1024, False, "E007"),
    "threads": ("int", 1, False, 1024, False, "E007"),
    "batch_size": ("int", 1, False, 10_000, False, "E007"),
    "max_jobs_per_child": ("int", 1, False, 10**9, True, "E007"),
    "max_memory_per_child": ("int", 1, False, 10**7, True, "E007"),
    "max_arguments_size": ("int", 1, False, GIB, False, "E024"),
    "max_result_size": ("int", 1, False, GIB, False, "E024"),
    "max_error_size": ("int", 1000, False, GIB, False, "E024"),
    "polling_interval": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "fallback_polling_interval": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "ready_check_interval": ("seconds", 0, True, MAX_SECONDS, True, "E008"),
    "dispatcher_interval": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "heartbeat_interval": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "alive_threshold": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "shutdown_timeout": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "interrupt_grace": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "cancel_poll_interval": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "maintenance_interval": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "db_retry_max_delay": ("seconds", 0, True, MAX_SECONDS, False, "E008"),
    "clear_finished_jobs_after": ("seconds", 0, False, MAX_SECONDS, True, "E023"),
}


def errors_for(name: str, value: Any) -> list[Error]:
    """The check errors that name ``name`` when ``DJANGO_JOBS`` sets it to ``value``."""
    with override_settings(DJANGO_JOBS={name: value}):
        errors = backend_checks(default_task_backend)
    return [e for e in errors if isinstance(e, Error) and f"[{name!r}]" in e.msg]


def in_documented_range(name: str, value: Any) -> bool:
    kind, low, strict, high, optional, _ = DOCUMENTED[name]
    if value is None:
        return optional
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if kind == "int" and not isinstance(value, int):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    above_low = value > low if strict else value >= low
    return above_low and value <= high


def bad_values(name: str) -> list[Any]:
    kind, low, strict, high, optional, _ = DOCUMENTED[name]
    values = [math.nan, math.inf, -math.inf, -1, True, False, "soon", "5", [1]]
    values += [high + 1, high * 10, 10**400]
    values.append(low if strict else low - 1)
    if kind == "int":
        values += [float(low), low + 0.5]
    if not optional:
        values.append(None)
    return values


CASES = [
    pytest.param(name, value, id=f"{name}={str(value)[:12]}")
    for name in DOCUMENTED
    for value in bad_values(name)
]


@pytest.mark.parametrize(("name", "value"), CASES)
def test_a_broken_number_is_one_error_naming_the_setting(name, value):
    errors = errors_for(name, value)
    assert [e.id for e in errors] == [f"django_jobs.{DOCUMENTED[name][5]}"]
    assert errors[0].msg.startswith(f"DJANGO_JOBS[{name!r}] must be ")


@pytest.mark.parametrize("name", DOCUMENTED)
def test_the_ends_of_each_range_are_accepted(name):
    kind, low, strict, high, optional, _ = DOCUMENTED[name]
    accepted = [high, low + 0.001 if strict else low]
    if kind == "seconds":
        accepted.append(1)
    if optional:
        accepted.append(None)
    for value in accepted:
        assert errors_for(name, value) == [], value


def test_zero_keeps_no_finished_job_and_says_so_when_refusing():
    """0 is allowed (each finished job goes at the next maintenance pass); below is not,
    and the hint says what None and 0 mean."""
    assert errors_for("clear_finished_jobs_after", 0) == []
    (error,) = errors_for("clear_finished_jobs_after", -1)
    assert error.id == "django_jobs.E023"
    assert "None keeps finished jobs forever" in error.hint


def test_a_retention_per_status_is_checked_status_by_status():
    """A dict of finished status -> seconds or None; anything else one error each, E023."""
    good = {"succeeded": 3600, "failed": 30 * 86400.0, "discarded": None}
    assert errors_for("clear_finished_jobs_after", good) == []
    assert errors_for("clear_finished_jobs_after", {}) == []
    bad = {"running": 1, "failed": -1, "succeeded": math.nan, "discarded": "1d"}
    errors = errors_for("clear_finished_jobs_after", bad)
    assert [error.id for error in errors] == ["django_jobs.E023"] * 4
    text = "\n".join(error.msg for error in errors)
    assert "names 'running', which is not a finished status" in text
    assert "['failed'] must be >= 0 seconds, not -1" in text
    assert "['succeeded'] must be a finite number of seconds, not nan" in text
    assert "['discarded'] must be a number of seconds or None, not '1d'" in text


@pytest.mark.parametrize(
    "cap", [0, -1, 1_000_001, math.nan, math.inf, 1.5, True, "3", None], ids=repr
)
def test_a_queue_cap_must_be_an_integer_in_range(cap):
    with override_settings(DJANGO_JOBS={"max_concurrency": {"default": cap}}):
        errors = [e for e in backend_checks(default_task_backend) if isinstance(e, Error)]
    assert [e.id for e in errors] == ["django_jobs.E009"]
    assert "1,000,000" in errors[0].msg


any_value = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.text(max_size=10),
    st.booleans(),
    st.none(),
    st.sampled_from([0, 1, 999, 1000, 1024, 1025, 10_000, 10_001, GIB, GIB + 1]),
    st.sampled_from([MAX_SECONDS, MAX_SECONDS + 1, 5e-324, -0.0, 0.0]),
)


@given(name=st.sampled_from(sorted(DOCUMENTED)), value=any_value)
@settings(max_examples=500)
def test_what_the_checks_accept_is_a_finite_number_in_the_documented_range(name, value):
    errors = errors_for(name, value)
    if errors:
        assert len(errors) == 1 and errors[0].id == f"django_jobs.{DOCUMENTED[name][5]}"
    else:
        assert in_documented_range(name, value), (name, value)


@pytest.mark.django_db  # run_checks() runs the database checks too
def test_the_backends_own_check_and_djangos_check_run_report_the_same_problem():
    """Django asks each backend of TASKS (``check_tasks`` calls ``backend.check()``): a bad
    setting is an error there, and once in ``manage.py check``'s run, not twice."""
    from django.core.checks import run_checks

    with override_settings(DJANGO_JOBS={"batch_size": 0}):
        own = [e.id for e in default_task_backend.check() if "['batch_size']" in e.msg]
        run = [e.id for e in run_checks() if "['batch_size']" in e.msg]
    assert own == run == ["django_jobs.E007"]
