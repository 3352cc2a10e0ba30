"""Models and migrations agree, for the app and the demo project."""

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations(capsys):
    call_command("makemigrations", "--check", "--dry-run", verbosity=1)
    assert "No changes detected" in capsys.readouterr().out
