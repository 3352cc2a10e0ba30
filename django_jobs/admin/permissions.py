"""Who may see and do what: the ``Job`` model's permissions govern every jobs page.

The dashboard, stuck and blocked pages are proxies without permissions of their
own, so a project grants one thing: ``view_job`` to look, ``change_job`` to act.
"""

from __future__ import annotations

from django.http import HttpRequest

VIEW = "django_jobs.view_job"
CHANGE = "django_jobs.change_job"


def can_view_jobs(request: HttpRequest) -> bool:
    user = request.user
    return bool(user.is_active and user.is_staff and (user.has_perm(VIEW) or user.has_perm(CHANGE)))


def can_act_on_jobs(request: HttpRequest) -> bool:
    user = request.user
    return bool(user.is_active and user.is_staff and user.has_perm(CHANGE))
