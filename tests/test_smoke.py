import pytest

from tests import tasks


@pytest.mark.django_db(transaction=True)
def test_enqueue_and_run_once(run_jobs):
    result = tasks.add.enqueue(2, 3)
    proc = run_jobs("--once")
    assert proc.wait() == 0, proc.output()
    result.refresh()
    assert result.status == "SUCCESSFUL"
    assert result.return_value == 5
