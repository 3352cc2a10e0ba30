"""``JobTask``: Django's ``Task`` plus the options this backend understands.

Django 6.1 forwards unknown ``@task(...)`` keywords to the backend's
``task_class``; Django 6.0 does not, so :func:`task` here accepts the same
options on both. Every option is checked when the task is declared (or
``.using()`` is called), so a typo fails at import time, not in a worker.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from datetime import datetime, timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Literal,
    NamedTuple,
    TypedDict,
    Unpack,
    cast,
    get_args,
    overload,
)

from django.tasks import DEFAULT_TASK_BACKEND_ALIAS, DEFAULT_TASK_QUEUE_NAME, Task
from django.tasks.base import DEFAULT_TASK_PRIORITY
from django.tasks.exceptions import InvalidTask

from django_jobs.conf import did_you_mean
from django_jobs.exceptions import InvalidDependency, InvalidTaskArguments
from django_jobs.limits import (
    MAX_ATTEMPTS,
    MAX_FAIR_WEIGHT,
    MIN_FAIR_WEIGHT,
    declared_seconds,
    is_number,
)
from django_jobs.tasks.backoff import BackoffSpec, Exponential, validate_backoff
from django_jobs.tasks.rates import Rate, is_rate, parse_rate, resolve_rate
from django_jobs.text import safe_repr

if TYPE_CHECKING:
    from django.tasks import TaskContext, TaskResult

ConcurrencyKey = str | Callable[..., str] | None
OnConflict = Literal["block", "discard"]
UniqueUntil = Literal["start", "finish"]
OnDependencyFailure = Literal["cancel", "run", "fail"]
ON_DEPENDENCY_FAILURE_CHOICES: tuple[str, ...] = get_args(OnDependencyFailure)
ON_CONFLICT_CHOICES: tuple[str, ...] = get_args(OnConflict)
UNIQUE_UNTIL_CHOICES: tuple[str, ...] = get_args(UniqueUntil)
# Jobs of one key running at once. Far above any real limit, far below the column's
# 2**31 - 1 (PostgreSQL and MariaDB refuse a bigger one at enqueue, not declaration).
MAX_CONCURRENCY_LIMIT = 1_000_000
# Characters of a resolved fair key: the size of ``Job.fair_key`` and ``FairTurn.fair_key``.
MAX_FAIR_KEY_LENGTH = 255

if TYPE_CHECKING:
    TaskBase = Task
else:

    class TaskBase:
        """``TaskBase[P, R]`` is Django's ``Task`` at run time: only django-stubs makes
        ``Task`` generic (in its call's parameters and return value), the class is not."""

        def __class_getitem__(cls, params: object) -> type[Task]:
            return Task


class Dependency(NamedTuple):
    """A job another waits for: its backend's alias (None: the waiting task's own) and id."""

    backend: str | None
    job_id: int


def as_dependencies(after: Any) -> tuple[Dependency, ...]:
    """``after=`` as dependencies: ``TaskResult``s, a ``BatchResult`` (every item), job ids,
    or anything with ``as_dependencies()`` (a workflow's node, once enqueued).

    Anything else, or a job id that is not a positive integer, raises ``InvalidTask``
    here, where ``using(after=...)`` is called, not in the enqueue.
    """
    if after is None:
        return ()
    if isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
        after = [after]
    found: list[Dependency] = []
    for item in after:
        if isinstance(item, Dependency):
            found.append(item)
        elif hasattr(item, "as_dependencies"):
            found.extend(item.as_dependencies())
        elif hasattr(item, "results") and not hasattr(item, "task"):  # a BatchResult
            found.extend(as_dependencies(item.results))
        elif hasattr(item, "id") and hasattr(item, "backend") and hasattr(item, "task"):
            check_backend_is_ours(item.backend)
            found.append(Dependency(item.backend, job_id_of(item.id)))
        elif is_int(item) or isinstance(item, str):
            found.append(Dependency(None, job_id_of(item)))
        else:
            raise InvalidDependency(
                f"after= takes task results, batch results or job ids, not {safe_repr(item, 60)}"
            )
    return tuple(dict.fromkeys(found))  # each once, in order


def check_backend_is_ours(alias: str) -> None:
    """A result of another backend's (Django's ImmediateBackend in tests) is no job to
    wait for: refused as such, not as an id that is not a number."""
    from django.tasks import task_backends

    from django_jobs.tasks.other_backends import is_ours, needs_jobs_backend

    if alias in task_backends.settings and not is_ours(task_backends[alias]):
        raise needs_jobs_backend(alias, "after=")


def job_id_of(value: Any) -> int:
    try:
        job_id = int(value)
    except (TypeError, ValueError):
        job_id = 0
    if job_id < 1 or job_id > 2**63 - 1:
        raise InvalidDependency(f"after= names {safe_repr(value, 40)}, which is not a job id")
    return job_id


class JobOptions(TypedDict, total=False):
    """The options ``@task(...)`` and ``JobTask.using(...)`` take beyond Django's: the
    fields of :class:`JobTask` (a test checks that the two name the same options)."""

    max_attempts: int
    backoff: BackoffSpec
    concurrency_key: ConcurrencyKey
    concurrency_limit: int
    concurrency_group: str | None
    concurrency_duration: float | timedelta | None
    on_conflict: OnConflict
    unique_key: ConcurrencyKey
    unique_until: UniqueUntil
    timeout: float | timedelta | None
    rate_limit: str | None
    rate_key: ConcurrencyKey
    fair_key: ConcurrencyKey
    fair_weight: float | None
    on_dependency_failure: OnDependencyFailure
    after: Iterable[Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobTask[**P, R](TaskBase[P, R]):
    """A ``django.tasks.Task`` with this backend's options (docs/tasks.md).

    ``P`` and ``R``: the task function's parameters and return value, as in django-stubs'
    ``Task[P, R]``.

    - ``max_attempts``: attempts in all, retries included (1: never retried).
    - ``backoff``: seconds before a retry: a number, ``Exponential(...)`` or a
      module-level function of the attempt number.
    - ``concurrency_key``, ``concurrency_limit``, ``concurrency_group``,
      ``concurrency_duration``, ``on_conflict``: at most ``concurrency_limit`` jobs
      of one key run at once (docs/concurrency.md).
    - ``unique_key``, ``unique_until``: one waiting (or unfinished) job per key
      (docs/unique.md).
    - ``timeout``: seconds an attempt may run before it is interrupted and recorded
      as ``JobTimeout`` (docs/control.md).
    - ``rate_limit``, ``rate_key``: at most N starts per period of one key, a rate
      (``"10/m"``) or the name of one in ``DJANGO_JOBS["rate_limits"]``
      (docs/rate_limits.md).
    - ``fair_key``, ``fair_weight``: the job's group (a tenant, say) and its weight among
      the ready jobs of a queue of ``DJANGO_JOBS["fair_queues"]``, which take turns by
      group rather than by age; refused at enqueue into any other queue
      (docs/fairness.md).
    - ``after`` (per call, through ``using()``), ``on_dependency_failure``: wait for other
      jobs to succeed first, and what to do if one fails for good (docs/workflows.md).

    Every option is checked when the task is declared or ``using()`` is called.
    """

    max_attempts: int = 1
    backoff: BackoffSpec = None
    concurrency_key: ConcurrencyKey = None
    concurrency_limit: int = 1
    concurrency_group: str | None = None
    concurrency_duration: float | timedelta | None = None
    on_conflict: OnConflict = "block"
    unique_key: ConcurrencyKey = None
    unique_until: UniqueUntil = "finish"
    timeout: float | timedelta | None = None
    rate_limit: str | None = None
    rate_key: ConcurrencyKey = None
    fair_key: ConcurrencyKey = None
    fair_weight: float | None = None
    on_dependency_failure: OnDependencyFailure = "cancel"
    # Per call only (``using(after=...)``): the jobs this one waits for.
    after: tuple[Dependency, ...] = ()

    def __post_init__(self) -> None:
        validate_job_options(self)
        Task.__post_init__(self)

    def using(
        self,
        *,
        priority: int | None = None,
        queue_name: str | None = None,
        run_after: datetime | None = None,
        backend: str | None = None,
        **options: Unpack[JobOptions],
    ) -> JobTask[P, R]:
        """Django's ``using()``, plus per-call overrides of this backend's options."""
        reject_unknown_options(options, "Unknown task option(s) for using()")
        backoff = options.get("backoff")
        if (
            callable(backoff)
            and not isinstance(backoff, Exponential)
            and backoff is not self.backoff
        ):
            # A job row names its backoff; a worker calls only the function its task
            # declares (docs/tasks.md), so a per-call one would be dropped there, silently.
            raise InvalidTask(
                f"{self.module_path}: a backoff function is declared with the task "
                "(@task(backoff=...)), not per call; per call, give seconds or Exponential(...)"
            )
        # Task.using is dataclasses.replace(self, ...): a copy of this JobTask.
        base = cast(
            "JobTask[P, R]",
            Task.using(
                self, priority=priority, queue_name=queue_name, run_after=run_after, backend=backend
            ),
        )
        if not options:
            return base
        chosen: dict[str, Any] = dict(options)
        if "after" in chosen:
            # Kept as what the enqueue reads: (backend, job id) pairs, checked here.
            chosen["after"] = as_dependencies(chosen["after"])
        return replace(base, **chosen)

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskResult[P, R]:
        """Django's ``enqueue``; a job that waits for others (``after=``) needs our backend."""
        if self.after:
            self.check_waiting_is_possible()
        return Task.enqueue(self, *args, **kwargs)

    async def aenqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskResult[P, R]:
        """Django's ``aenqueue``, with ``enqueue``'s check."""
        if self.after:
            self.check_waiting_is_possible()
        return await Task.aenqueue(self, *args, **kwargs)

    def check_waiting_is_possible(self) -> None:
        """``after=`` under another backend (which would run the job at once, or never,
        whatever it waits for) is refused, not ignored."""
        from django_jobs.tasks.other_backends import is_ours, needs_jobs_backend

        if not is_ours(self.get_backend()):
            raise needs_jobs_backend(self.backend, f"{self.module_path}: after=")

    def resolve_concurrency_key(
        self,
        args: list[Any],
        kwargs: dict[str, Any],
        arguments: Mapping[str, Any] | None = None,
    ) -> str | None:
        """The semaphore key of one call: ``group/key``, the key filled from the arguments.

        The group defaults to the task's path, so two tasks share a limit only
        when they name the same ``concurrency_group``. ``arguments``: the call
        already bound by :func:`bound_arguments`, if the caller has it.
        """
        return self.resolve_key(
            "concurrency_key", self.concurrency_group or self.module_path, args, kwargs, arguments
        )

    def resolve_unique_key(
        self,
        args: list[Any],
        kwargs: dict[str, Any],
        arguments: Mapping[str, Any] | None = None,
    ) -> str | None:
        """The unique key of one call, ``task path/key``: unique per task, like a limit's group."""
        return self.resolve_key("unique_key", self.module_path, args, kwargs, arguments)

    def resolve_rate(
        self,
        args: list[Any],
        kwargs: dict[str, Any],
        arguments: Mapping[str, Any] | None = None,
    ) -> tuple[str, Rate] | None:
        """The rate key and rate of one call, or None without a ``rate_limit``.

        A named limit (settings) is shared by every task naming it: its key is
        the name, ``name/key`` with a ``rate_key``. An inline rate is the task's
        own, like a concurrency limit: ``task path`` or ``task path/key``.
        """
        if self.rate_limit is None:
            return None
        try:
            name, rate = resolve_rate(self.rate_limit, self.module_path)
        except ValueError as exc:
            raise InvalidTask(str(exc)) from None
        prefix = name or self.module_path
        key = self.resolve_key("rate_key", prefix, args, kwargs, arguments)
        return (key or prefix), rate

    def resolve_fair_key(
        self,
        args: list[Any],
        kwargs: dict[str, Any],
        arguments: Mapping[str, Any] | None = None,
    ) -> str | None:
        """The fair key of one call, as it is: not prefixed with the task's path.

        Unlike a concurrency or unique key, a fair key names a group that every task of
        the queue shares (a tenant's id): two tasks that give ``"42"`` take turns as one
        group. None without a ``fair_key`` (the caller gives such a job of a fair queue
        the group ``''``). A key that is empty (the group of the jobs of no key, which
        only a job without one joins), not a string, longer than its column or holding a
        NUL (which PostgreSQL's text refuses: refused on every database alike) raises
        ``InvalidTask`` here, before anything is written.
        """
        if self.fair_key is None:
            return None
        resolved = self.fill_key("fair_key", args, kwargs, arguments)
        path = self.module_path
        if not isinstance(resolved, str):
            raise InvalidTask(
                f"fair_key of {path} must give a string, not {safe_repr(resolved, 60)}"
            )
        if not resolved:
            raise InvalidTask(
                f"fair_key of {path} gave an empty string: a fair key names a group, and '' "
                "is the group of the jobs of no key (for those, give no fair_key)"
            )
        if len(resolved) > MAX_FAIR_KEY_LENGTH:
            raise InvalidTask(
                f"fair_key of {path} gave {resolved[:60]!r}..., {len(resolved)} characters "
                f"long; it may be at most {MAX_FAIR_KEY_LENGTH}"
            )
        if "\x00" in resolved:
            raise InvalidTask(
                f"fair_key of {path} gave {safe_repr(resolved, 60)}, which holds a NUL "
                "character (\\x00): no fair key may hold one"
            )
        return resolved

    def fill_key(
        self,
        option: str,
        args: list[Any],
        kwargs: dict[str, Any],
        arguments: Mapping[str, Any] | None = None,
    ) -> Any:
        """The key option ``option`` (a template or a callable, not None) filled from one
        call's arguments: what the callable returned, unchecked."""
        key = getattr(self, option)
        if callable(key):
            return key(*args, **kwargs)
        if arguments is None:
            arguments = bound_arguments(self, args, kwargs)
        return key.format(**arguments)

    def resolve_key(
        self,
        option: str,
        prefix: str,
        args: list[Any],
        kwargs: dict[str, Any],
        arguments: Mapping[str, Any] | None = None,
    ) -> str | None:
        """Fill the key option ``option`` (a template or a callable) from one call's arguments."""
        if getattr(self, option) is None:
            return None
        resolved = self.fill_key(option, args, kwargs, arguments)
        if not isinstance(resolved, str) or not resolved:
            raise InvalidTask(f"{option} of {self.module_path} must give a non-empty string")
        full = f"{prefix}/{resolved}"
        if len(full) > 255:
            kind = option.replace("_", " ")
            raise InvalidTask(f"{kind} {full[:60]!r}... is longer than 255 characters")
        return full

    @property
    def lease_seconds(self) -> float | None:
        duration = self.concurrency_duration
        if isinstance(duration, timedelta):
            return duration.total_seconds()
        return None if duration is None else float(duration)


# The options, in declaration order, and each one's default (for a plain Django ``Task``):
# JobTask's own fields, so that a new option is one field (and its line in JobOptions).
OPTION_FIELDS = [f for f in fields(JobTask) if f.name not in {t.name for t in fields(Task)}]
JOB_OPTION_NAMES = tuple(f.name for f in OPTION_FIELDS)
JOB_OPTION_DEFAULTS: dict[str, Any] = {f.name: f.default for f in OPTION_FIELDS}


def check_option_defaults(defaults: Mapping[str, Any]) -> None:
    """Each option's default is one immutable, hashable value, or this fails at import.

    A ``JobTask`` is frozen and hashable, as Django's ``Task`` is, and a plain ``Task``
    takes these defaults: an option declared with a ``default_factory`` (a list, a dict)
    gave a plain task ``MISSING`` and made every ``JobTask`` unhashable, and every test
    still passed. A collection is a tuple, default ``()``, as ``after`` is.
    """
    for name, default in defaults.items():
        try:
            hashable = default is not MISSING and hash(default) is not None
        except TypeError:
            hashable = False
        if not hashable:
            raise TypeError(
                f"JobTask.{name}: an option's default must be one immutable, hashable value "
                "(a collection is a tuple, default ()), not a default_factory"
            )


check_option_defaults(JOB_OPTION_DEFAULTS)


@functools.lru_cache(maxsize=1024)
def signature_of(func: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature``, once per function: every enqueue binds its call."""
    return inspect.signature(func)


def bound_arguments(task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied, the context left out.

    The one place a call is checked against the task's function: every enqueue
    goes through it, keyed or not, so a call the function would refuse fails in
    the caller, naming the argument, instead of in a worker later.
    """
    signature = signature_of(task.func)
    call_args = [None, *args] if task.takes_context else list(args)
    try:
        bound = signature.bind(*call_args, **kwargs)
    except TypeError as exc:
        reason = binding_problem(task, signature, len(args), exc)
        raise InvalidTaskArguments(
            f"Arguments do not match {task.module_path}{bare(signature)}: {reason}"
        ) from exc
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if task.takes_context:
        arguments.pop(next(iter(signature.parameters)), None)
    return arguments


def bare(signature: inspect.Signature) -> inspect.Signature:
    """The signature without annotations: ``(a, b=2)`` reads better in an error."""
    empty = inspect.Parameter.empty
    return signature.replace(
        parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )


def binding_problem(task: Task, signature: inspect.Signature, given: int, exc: TypeError) -> str:
    """Python's reason, naming the argument; its "too many positional arguments" names none."""
    reason = str(exc)
    if reason != "too many positional arguments":
        return reason
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    accepted = sum(p.kind in kinds for p in signature.parameters.values())
    if task.takes_context:
        accepted -= 1
    return (
        f"positional argument {accepted} is one too many "
        f"(it takes {accepted} positionally, {given} were given)"
    )


def is_int(value: Any) -> bool:
    """An int, not a bool: ``max_attempts=True`` is a mistake, not one attempt."""
    return isinstance(value, int) and not isinstance(value, bool)


def reject_unknown_options(options: Mapping[str, Any], message: str) -> None:
    """A ``TypeError`` (as for any unexpected keyword) naming the unknown options,
    with the option each one likely meant."""
    unknown = sorted(set(options) - set(JOB_OPTION_NAMES))
    if unknown:
        hints = [did_you_mean(name, JOB_OPTION_NAMES) for name in unknown]
        hint = " ".join(hint for hint in hints if hint)
        raise TypeError(f"{message}: {', '.join(unknown)}.{f' {hint}' if hint else ''}")


def refuse_generator(task: JobTask) -> None:
    """A function that yields gives a generator, which no job can store as its result: every
    job of it would fail in a worker, so the declaration fails instead, saying why."""
    func = task.func
    if inspect.isasyncgenfunction(func) or inspect.isgeneratorfunction(func):
        kind = "an async generator" if inspect.isasyncgenfunction(func) else "a generator"
        raise InvalidTask(
            f"{task.module_path} is {kind} function: a task returns its result "
            f"({'async ' if inspect.isasyncgenfunction(func) else ''}def ... return), "
            "it does not yield"
        )


def validate_job_options(task: JobTask) -> None:
    """Every option checked and bounded where it is written.

    A number that passes here is later stored in a row and added to a time in a
    worker: ``concurrency_duration=inf`` once made every claim of its key raise
    ``OverflowError``, and ``timeout=nan`` never timed out. So each is finite and
    within ``limits``, or the declaration fails naming it.
    """
    refuse_generator(task)
    attempts = task.max_attempts
    if not is_int(attempts) or not 1 <= attempts <= MAX_ATTEMPTS:
        raise InvalidTask(
            f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS:,}, "
            f"not {safe_repr(attempts, 40)}"
        )
    try:
        validate_backoff(task.backoff)
    except ValueError as exc:
        raise InvalidTask(str(exc)) from exc
    limit = task.concurrency_limit
    if not is_int(limit) or not 1 <= limit <= MAX_CONCURRENCY_LIMIT:
        raise InvalidTask(
            f"concurrency_limit must be an integer from 1 to {MAX_CONCURRENCY_LIMIT:,}, "
            f"not {safe_repr(limit, 40)}"
        )
    group = task.concurrency_group
    if group is not None and (not isinstance(group, str) or not group or "/" in group):
        raise InvalidTask("concurrency_group must be a non-empty string without '/'")
    duration = task.concurrency_duration
    timeout = task.timeout
    for name, value in (("concurrency_duration", duration), ("timeout", timeout)):
        if value is not None:
            try:
                declared_seconds(value, name, strict=True)
            except ValueError as exc:
                raise InvalidTask(f"{exc} (a number of seconds or a timedelta)") from None
    if task.on_conflict not in ON_CONFLICT_CHOICES:
        raise InvalidTask(f"on_conflict must be one of {', '.join(ON_CONFLICT_CHOICES)}")
    if task.unique_until not in UNIQUE_UNTIL_CHOICES:
        raise InvalidTask(f"unique_until must be one of {', '.join(UNIQUE_UNTIL_CHOICES)}")
    unique = task.unique_key
    if unique is not None and not callable(unique):
        if not isinstance(unique, str) or not unique:
            raise InvalidTask("unique_key must be a non-empty format string or a callable")
        validate_key_template(task, unique, "unique_key")
    validate_rate_options(task)
    if task.on_dependency_failure not in ON_DEPENDENCY_FAILURE_CHOICES:
        raise InvalidTask(
            f"on_dependency_failure must be one of {', '.join(ON_DEPENDENCY_FAILURE_CHOICES)}"
        )
    if not isinstance(task.after, tuple) or not all(
        isinstance(item, Dependency) for item in task.after
    ):
        raise InvalidTask("after must be given through using(after=...)")
    key = task.concurrency_key
    if key is None and (group is not None or duration is not None):
        raise InvalidTask("concurrency_group and concurrency_duration need a concurrency_key")
    if key is not None and not callable(key):
        if not isinstance(key, str) or not key:
            raise InvalidTask("concurrency_key must be a non-empty format string or a callable")
        validate_key_template(task, key)
    validate_fair_options(task)


def validate_fair_options(task: JobTask) -> None:
    """``fair_key`` a template naming the function's arguments (or a callable), and
    ``fair_weight`` None or a number within ``limits``' bounds.

    The weight divides the turns between a group's jobs (``core.fairness.step_of``): a
    weight of 0 or a negative one would give a group every turn or none, a NaN never
    compares, and an ``inf`` or a huge one makes the step 0; so each is refused here, by
    name, not quietly clamped where the turns are given. Whether the task's queue is fair
    is a setting read at enqueue (``using(queue_name=...)`` can change it).
    """
    key = task.fair_key
    if key is not None and not callable(key):
        if not isinstance(key, str) or not key:
            raise InvalidTask("fair_key must be a non-empty format string or a callable")
        validate_key_template(task, key, "fair_key")
    weight = task.fair_weight
    if weight is None:
        return
    if not is_number(weight) or not MIN_FAIR_WEIGHT <= weight <= MAX_FAIR_WEIGHT:
        raise InvalidTask(
            f"fair_weight must be a number from {MIN_FAIR_WEIGHT:g} to {MAX_FAIR_WEIGHT:g} "
            f"(None: 1, an even share), not {safe_repr(weight, 40)}"
        )


def validate_rate_options(task: JobTask) -> None:
    """A malformed rate fails at declaration; so does an unknown name, once settings load."""
    from django.conf import settings

    spec, key = task.rate_limit, task.rate_key
    if spec is None:
        if key is not None:
            raise InvalidTask("rate_key needs a rate_limit")
        return
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidTask("rate_limit must be a rate like '10/m' or the name of one in settings")
    if is_rate(spec):
        try:
            parse_rate(spec)
        except ValueError as exc:
            raise InvalidTask(f"rate_limit {exc}") from None
    elif settings.configured:
        try:
            resolve_rate(spec, task.module_path)
        except ValueError as exc:
            raise InvalidTask(str(exc)) from None
    if key is not None and not callable(key):
        if not isinstance(key, str) or not key:
            raise InvalidTask("rate_key must be a non-empty format string or a callable")
        validate_key_template(task, key, "rate_key")


def validate_key_template(task: Task, template: str, option: str = "concurrency_key") -> None:
    """Reject a template naming an argument the function does not take."""
    import string

    parameters = inspect.signature(task.func).parameters
    takes_var_kwargs = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise InvalidTask(f"{option} {template!r} is not a valid format string") from exc
    for name in names:
        root = name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise InvalidTask(f"{option} fields must name arguments, e.g. '{{account_id}}'")
        if root not in parameters and not takes_var_kwargs:
            raise InvalidTask(
                f"{option} {template!r} names {root!r}, which {task.module_path} does not take"
            )


# The overloads are django-stubs' own for django.tasks.task (a function, or options first
# and then a function; with or without the context as first parameter), with this
# backend's options. Each returns a JobTask: what a django-jobs backend's task_class makes.
@overload
def task[**P, R](
    function: Callable[Concatenate[TaskContext, P], R],
    *,
    priority: int = ...,
    queue_name: str = ...,
    backend: str = ...,
    takes_context: Literal[True],
    **options: Unpack[JobOptions],
) -> JobTask[P, R]: ...
@overload
def task[**P, R](
    function: Callable[P, R],
    *,
    priority: int = ...,
    queue_name: str = ...,
    backend: str = ...,
    takes_context: Literal[False] = False,
    **options: Unpack[JobOptions],
) -> JobTask[P, R]: ...
@overload
def task[**P, R](
    *,
    priority: int = ...,
    queue_name: str = ...,
    backend: str = ...,
    takes_context: Literal[True],
    **options: Unpack[JobOptions],
) -> Callable[[Callable[Concatenate[TaskContext, P], R]], JobTask[P, R]]: ...
@overload
def task[**P, R](
    *,
    priority: int = ...,
    queue_name: str = ...,
    backend: str = ...,
    takes_context: Literal[False] = False,
    **options: Unpack[JobOptions],
) -> Callable[[Callable[P, R]], JobTask[P, R]]: ...
def task(
    function: Callable[..., Any] | None = None,
    *,
    priority: int = DEFAULT_TASK_PRIORITY,
    queue_name: str = DEFAULT_TASK_QUEUE_NAME,
    backend: str = DEFAULT_TASK_BACKEND_ALIAS,
    takes_context: bool = False,
    **options: Unpack[JobOptions],
) -> Task[..., Any] | Callable[[Callable[..., Any]], Task[..., Any]]:
    """``django.tasks.task`` with this backend's options (:class:`JobOptions`), on
    Django 6.0 as on 6.1.

    ``@task`` on a function, or ``@task(max_attempts=3, ...)``, makes a task of the
    backend's ``task_class``: a :class:`JobTask` with a django-jobs backend. Under another
    backend (Django's ``ImmediateBackend`` or ``DummyBackend`` in test settings), it makes
    a :class:`JobTask` all the same, which that backend runs ignoring its options: one
    ``IgnoredJobOptions`` warning per process says so (docs/testing.md).
    """
    from django.tasks import task_backends

    reject_unknown_options(options, "Unknown task option(s)")
    if options.get("after"):
        raise InvalidTask("after= is given per call, with .using(after=...), not with @task")

    def wrapper(func: Callable[..., Any]) -> Task[..., Any]:
        task_class: Callable[..., Task[..., Any]] = task_backends[backend].task_class
        if not issubclass(task_backends[backend].task_class, JobTask) and (
            options or task_class is Task
        ):
            # Another backend (Django's ImmediateBackend in test settings): the task is
            # ours all the same (``using()`` takes our options), its options checked,
            # and that backend ignores them. A backend's own task class is kept where
            # no option needs ours.
            if options:
                from django_jobs.tasks.other_backends import warn_ignored_options

                path = f"{func.__module__}.{func.__qualname__}"
                warn_ignored_options(backend, path, list(options))
            task_class = JobTask
        return task_class(
            func=func,
            priority=priority,
            queue_name=queue_name,
            backend=backend,
            takes_context=takes_context,
            run_after=None,
            **options,
        )

    if function is not None:
        return wrapper(function)
    return wrapper


def with_options(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with its ``**options`` spelled out: one keyword per option of
    :class:`JobTask`, with its default, as ``help()`` and ``inspect.signature`` show it."""
    kept = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    keyword = inspect.Parameter.KEYWORD_ONLY
    options = [
        inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
        for f in OPTION_FIELDS
    ]
    return signature.replace(parameters=[*kept, *options])


# typeshed declares no __signature__ on a function; inspect.signature reads it.
task.__signature__ = with_options(inspect.signature(task))  # type: ignore[attr-defined]


def job_options(task: Task) -> dict[str, Any]:
    """This backend's options of ``task``, defaults for a plain Django ``Task``."""
    if isinstance(task, JobTask):
        return {name: getattr(task, name) for name in JOB_OPTION_NAMES}
    return dict(JOB_OPTION_DEFAULTS)


Call = tuple[Task, Sequence[Any], Mapping[str, Any]]


def checked_calls(calls: Iterable[Any], where: str) -> list[Call]:
    """``calls`` as a list, each a ``(task, args, kwargs)`` whose task is a ``Task``.

    Raises Django's ``InvalidTask`` naming the call at fault, before anything is
    written: a plain function (the ``@task`` forgotten) would otherwise surface
    as an ``AttributeError`` from deep inside the enqueue.
    """
    calls = list(calls)
    for index, call in enumerate(calls):
        if not isinstance(call, tuple | list) or len(call) != 3:
            raise InvalidTask(
                f"{where}: call {index} must be a (task, args, kwargs) tuple, "
                f"not {safe_repr(call, 80)}"
            )
        task, args, kwargs = call
        if not isinstance(task, Task):
            raise InvalidTask(
                f"{where}: call {index} names {safe_repr(task, 80)}, which is not a task "
                "(a function decorated with @task)"
            )
        if isinstance(args, str | bytes) or not isinstance(args, Sequence):
            raise InvalidTask(f"{where}: call {index}'s args must be a list or a tuple")
        if not isinstance(kwargs, Mapping):
            raise InvalidTask(f"{where}: call {index}'s kwargs must be a dict")
    return calls
