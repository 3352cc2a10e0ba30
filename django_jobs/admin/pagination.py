"""A paginator that never counts more rows than it could ever page through."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.utils.functional import cached_property

COUNT_CAP = 10_000


class CappedCountPaginator(Paginator):
    """Counts at most ``COUNT_CAP + 1`` rows, so a page load costs the same with a
    hundred jobs or a hundred million: ``COUNT(*)`` over a subquery with a LIMIT
    stops at the cap instead of scanning the table. The pages past the cap are
    not offered; filters narrow the list instead.

    The count is taken without the list's ordering: ``ORDER BY id DESC LIMIT cap`` must
    find and sort every matching row before it can stop, where the rows of an index range
    (a state, a queue, "finished in the last hour") are counted as they are read, up to
    the cap (a 540 ms count over 3M jobs became a bounded index range scan).
    """

    @property
    def cap(self) -> int:
        return COUNT_CAP

    @cached_property
    def count(self) -> int:
        object_list = self.object_list
        if isinstance(object_list, QuerySet):
            return object_list.order_by()[: COUNT_CAP + 1].count()
        return min(len(object_list), COUNT_CAP + 1)
