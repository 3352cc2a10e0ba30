"""An audit trail the stress test's jobs write about themselves.

Each attempt inserts a row when the function starts and stamps it when the
function ends, from inside the job, so the test can prove the invariants from
what actually ran rather than from what the queue believes.
"""

from django.db import models


class AuditEvent(models.Model):
    job_id = models.BigIntegerField(db_index=True)
    key = models.CharField(max_length=255)
    limit = models.PositiveIntegerField()
    attempt = models.PositiveIntegerField()
    pid = models.PositiveIntegerField()
    started = models.FloatField(help_text="time.time() when the function started")
    ended = models.FloatField(null=True, help_text="time.time() when it returned or raised")

    class Meta:
        indexes = [models.Index(fields=["key", "started"], name="demo_audit_key_started")]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} on {self.key}"
