"""Job.progress_*: the last progress a task reported (django_jobs.set_progress).

Four nullable columns without defaults: adding them rewrites no row (PostgreSQL, MariaDB
instant ADD COLUMN), and a job that never reports keeps NULL in them.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0008_job_trace_context"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="progress_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="progress_done",
            field=models.FloatField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="progress_message",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="progress_total",
            field=models.FloatField(blank=True, null=True),
        ),
    ]
