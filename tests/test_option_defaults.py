"""A task option's default is one immutable, hashable value: checked when the module loads."""

from dataclasses import MISSING

import pytest

from django_jobs.tasks.job_task import JOB_OPTION_DEFAULTS, check_option_defaults
from tests import tasks


def test_every_option_has_a_hashable_default_and_a_task_hashes():
    check_option_defaults(JOB_OPTION_DEFAULTS)
    assert hash(tasks.add) == hash(tasks.add.using(max_attempts=1))


@pytest.mark.parametrize("default", [MISSING, [], {}])
def test_a_collection_default_fails_naming_the_option(default):
    # A field declared with default_factory=list leaves MISSING as its dataclass default.
    with pytest.raises(TypeError, match=r"JobTask\.tags: .*\(a collection is a tuple"):
        check_option_defaults({**JOB_OPTION_DEFAULTS, "tags": default})
