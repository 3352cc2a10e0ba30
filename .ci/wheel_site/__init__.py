"""A throwaway Django site that .ci/package_check.py runs against the installed wheel.

It is copied into a temporary directory, away from the checkout, so ``import django_jobs``
can only find the wheel's copy in the fresh venv, never the source tree.
"""
