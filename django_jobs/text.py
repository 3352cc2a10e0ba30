"""Text that came from a job (its exception, progress, keys, task path), made safe to
write and to show.

A job's data is the user's, not ours: a NUL that PostgreSQL refuses, a
megabyte-long message, a newline that forges a log line or an ANSI escape
that rewrites an operator's terminal must end at the job, never at the
worker that records it or the person who reads it (docs/design.md,
invariant 10).
"""

from __future__ import annotations

import logging
import numbers
import re
from typing import Any

# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators some
# terminals and log viewers treat as newlines. Tab and newline are kept by ``printable``
# only where the caller says so (a traceback is meant to span lines).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
CONTROL_BUT_LAYOUT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_control(match: re.Match[str]) -> str:
    char = match.group()
    if char in NAMED_ESCAPES:
        return NAMED_ESCAPES[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def printable(value: object, *, keep_lines: bool = False) -> str:
    """``value`` as one line of text with every control character escaped (``\\n``,
    ``\\x1b``...), for a log line or a terminal. ``keep_lines`` keeps newlines and tabs
    (a traceback), escaping the rest."""
    text = value if isinstance(value, str) else safe_str(value)
    return (CONTROL_BUT_LAYOUT if keep_lines else CONTROL).sub(escape_control, text)


def safe_str(value: object) -> str:
    """``str(value)``, or a description of the value when its ``__str__`` raises: a
    task's exception may be of any class, and recording it must not fail."""
    try:
        text = str(value)
    except Exception as exc:
        return f"<{type(value).__name__} whose str() raised {type(exc).__name__}>"
    return text if isinstance(text, str) else f"<{type(value).__name__}>"


def safe_repr(value: Any, limit: int = 200) -> str:
    """A short ``repr`` for a message or a log line: the value may be huge, nested past
    Python's recursion limit, or have a ``__repr__`` that raises."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def without_nul(text: str) -> str:
    """``text`` with each NUL written ``\\x00``: PostgreSQL's text columns cannot hold one."""
    return text.replace("\x00", "\\x00") if "\x00" in text else text


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    note = ""
    for _ in range(2):  # the note's own length changes how much is cut, once at most
        kept = limit - len(note)
        note = f"... [{len(text) - kept:,} more characters cut]"
    kept = limit - len(note)
    if kept <= 0:
        return text[:limit]
    return text[:kept] + note


def storable_text(value: object, limit: int) -> str:
    """Text of a job's making (an exception's message, a traceback, a progress message)
    as it can be written on every database: a string, no NUL, at most ``limit``
    characters."""
    return clip(without_nul(value if isinstance(value, str) else safe_str(value)), limit)


class EscapeControlCharacters(logging.Filter):
    """Escapes control characters in the values a log line interpolates, and in the
    text of its exception, so that a job's data cannot forge a line of its own or send
    escape sequences to the terminal that shows the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.clean(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: self.clean(arg) for key, arg in record.args.items()}
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = printable(
                logging.Formatter().formatException(record.exc_info), keep_lines=True
            )
        return True

    @staticmethod
    def clean(arg: object) -> object:
        # Numbers stay numbers, for the line's %d and %.3f. The exact types first: every
        # job logs two lines, and the ABC check on every str argument was a tenth of the
        # logging's CPU (yappi, a worker draining no-op jobs).
        kind = type(arg)
        if kind is str:
            return printable(arg)
        if kind in PLAIN_TYPES or isinstance(arg, numbers.Number):
            return arg
        return printable(arg)


# Arguments a log line keeps as they are (bool and None have no control characters either).
PLAIN_TYPES = frozenset({int, float, bool, type(None)})


ESCAPE_FILTER = EscapeControlCharacters()


def jobs_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with control characters escaped in its lines (a filter
    on a logger applies to the records logged through it, so each of ours gets one)."""
    logger = logging.getLogger(name)
    if ESCAPE_FILTER not in logger.filters:
        logger.addFilter(ESCAPE_FILTER)
    return logger
