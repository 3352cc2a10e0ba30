"""Job.trace_context: the enqueuer's OpenTelemetry context, for django_jobs.tracing.

Nullable and without a default: adding it rewrites no row (PostgreSQL, MariaDB instant ADD
COLUMN), and a project without OpenTelemetry keeps NULL in it.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0007_job_timeout_and_cancel"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="trace_context",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
