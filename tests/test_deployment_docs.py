"""docs/deployment.md's recipes, checked as far as this machine can: the systemd unit parsed
(and verified by ``systemd-analyze`` where it is installed), the Procfile, the Kubernetes
Deployment parsed as YAML, and every ``manage.py`` command in the page read by that command's
own parser, so that an option misspelt or removed fails here. The stop timeouts are held to
``shutdown_timeout`` + ``interrupt_grace`` + a margin, and the probes' exact commands are run
against the test database, with and without a live ``run_jobs``."""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, get_commands, load_command_class

from django_jobs.conf import JobsSettings
from django_jobs.models import Process
from tests.harness import FAST_ENV, MANAGE, REPO_ROOT, database_url, wait_until

# The recipes are the same on every database (manage.py jobs_health, the probes' command, is
# checked on each in tests/test_jobs_health.py): tox runs this module in one database's
# environment (pyproject.toml, marker one_database).
pytestmark = pytest.mark.one_database

PAGE = REPO_ROOT / "docs" / "deployment.md"
# What a stop needs beyond shutdown_timeout + interrupt_grace: writing the last outcomes,
# handing back, deregistering (docs/deployment.md, "What every deployment needs").
MARGIN = 10.0
HEROKU_KILL_AFTER = 30.0  # seconds from Heroku's SIGTERM to its SIGKILL
# A probe starts a Python process that imports Django: less than this is a timeout waiting
# to happen on a busy node.
PROBE_TIMEOUT_AT_LEAST = 10
# "A dedicated jobs database" declares the alias "jobs"; the test project has one database.
PAGE_ALIASES = {"jobs": "default"}


def fenced_blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced block of the page."""
    text = PAGE.read_text()
    return re.findall(r"^```([\w-]*)\n(.*?)^```", text, flags=re.M | re.S)


def the_block(language: str, marker: str) -> str:
    found = [body for lang, body in fenced_blocks() if lang == language and marker in body]
    assert len(found) == 1, f"expected one ```{language} block with {marker!r}, found {found}"
    return found[0]


def parse_command(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """``python manage.py NAME ARGS...`` read by NAME's own parser: an unknown command fails
    an assertion, an option it does not accept raises CommandError."""
    at = next(i for i, word in enumerate(argv) if word.endswith("manage.py"))
    name, args = argv[at + 1], argv[at + 2 :]
    # The page's database aliases, as the test project names them (``--database`` takes
    # only the project's aliases).
    args = [
        PAGE_ALIASES.get(arg, arg) if i > 0 and args[i - 1] == "--database" else arg
        for i, arg in enumerate(args)
    ]
    commands = get_commands()
    assert name in commands, f"manage.py {name}: no such command ({argv})"
    command = load_command_class(commands[name], name)
    return name, command.create_parser("manage.py", name).parse_args(args)


def script_commands(script: str) -> list[list[str]]:
    """The ``manage.py`` commands of a shell script (``sh -c "...; test $? -ne 1"``)."""
    commands = []
    for part in re.split(r"[;&|]+", script):
        words = shlex.split(part, comments=True)
        if any(word.endswith("manage.py") for word in words):
            commands.append(words)
    return commands


def stop_takes(options: argparse.Namespace) -> float:
    """Seconds a graceful stop of ``run_jobs`` with these options may take, with the
    settings' defaults for what the command line does not say."""
    defaults = JobsSettings()
    shutdown = options.shutdown_timeout
    if shutdown is None:
        shutdown = defaults.shutdown_timeout
    return shutdown + defaults.interrupt_grace + MARGIN


def seconds(value: str) -> float:
    """A systemd time span as the unit writes it: ``20``, ``20s``, ``1min 30s``."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        assert unit in units, f"unknown time unit in {value!r}"
        total += float(number) * units[unit]
    return total


# --- every command in the page ----------------------------------------------------------


def page_commands() -> list[list[str]]:
    """Every ``manage.py`` command of the page's fenced blocks: exec-form arrays (Docker,
    Compose, Kubernetes) and the ``sh -c`` scripts inside them, ``ExecStart=`` lines, the
    Procfile's lines and the shell examples."""
    found: list[list[str]] = []
    for language, body in fenced_blocks():
        for array in re.findall(r"\[\s*\"[^\[\]]*\"\s*\]", body, flags=re.S):
            words = json.loads(array)
            if any(word.endswith("manage.py") for word in words):
                found.append(words)
            elif words[:2] == ["sh", "-c"]:
                found += script_commands(words[2])
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        if language == "ini":
            scripts = [line.split("=", 1)[1] for line in lines if line.startswith("ExecStart=")]
        elif language == "" and all(re.match(r"^\w+: ", line) for line in lines):
            scripts = [line.split(": ", 1)[1] for line in lines]  # a Procfile
        elif language == "sh":
            scripts = [line.removeprefix("$ ") for line in lines]
        else:
            scripts = []
        for script in scripts:
            found += script_commands(script)
    return found


def test_every_manage_py_command_in_the_page_is_read_by_its_own_parser():
    commands = page_commands()
    names = [parse_command(argv)[0] for argv in commands]
    # The extraction found the recipes (an empty list would check nothing): systemd,
    # Docker's command and health check, Compose, the Procfile, Kubernetes and its probes.
    assert names.count("run_jobs") >= 5, commands
    assert names.count("jobs_health") >= 3, commands
    assert "migrate" in names


def test_a_misspelt_option_fails_the_check():
    """What the test above relies on: the parser refuses what the command does not take."""
    with pytest.raises(CommandError, match="unrecognized arguments: --shutdown-timout"):
        parse_command(["python", "manage.py", "run_jobs", "--shutdown-timout", "45"])
    with pytest.raises(AssertionError, match="no such command"):
        parse_command(["python", "manage.py", "jobs_healthy"])


# --- systemd ----------------------------------------------------------------------------


def systemd_unit() -> str:
    return the_block("ini", "[Service]")


def test_the_systemd_unit_stops_gracefully_before_systemd_kills():
    unit = configparser.ConfigParser(interpolation=None, strict=True, delimiters=("=",))
    unit.optionxform = str  # systemd's keys are case-sensitive
    unit.read_string(systemd_unit())
    service = unit["Service"]
    name, options = parse_command(shlex.split(service["ExecStart"]))
    assert name == "run_jobs"
    assert service["KillSignal"] == "SIGTERM"
    # The main process alone gets the SIGTERM; the final SIGKILL reaches every process.
    assert service["KillMode"] == "mixed"
    assert seconds(service["TimeoutStopSec"]) >= stop_takes(options)
    # run_jobs exits 0 after a graceful stop and 1 when pruned as dead: restart after both.
    assert service["Restart"] == "always"
    assert "PYTHONUNBUFFERED=1" in service["Environment"].split()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    """systemd's own reading: an unknown key or a bad value is a warning on stderr (its exit
    status stays 0), so the check is that it says nothing. The interpreter's path is this
    machine's, since systemd checks that ExecStart's program exists."""
    text = re.sub(
        r"^ExecStart=\S+", f"ExecStart={sys.executable}", systemd_unit(), count=1, flags=re.M
    )
    path = tmp_path / "myproject-jobs.service"
    path.write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    path.write_text(text.replace("KillMode=mixed", "KillMode=mixd"))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert "kill mode" in done.stderr  # the check above can fail


# --- Procfile ---------------------------------------------------------------------------


def test_the_procfile_runs_one_process_per_dyno_that_stops_within_herokus_grace():
    lines = dict(
        line.split(": ", 1) for line in the_block("", "worker:").splitlines() if line.strip()
    )
    assert set(lines) == {"release", "web", "worker"}
    assert parse_command(shlex.split(lines["release"]))[0] == "migrate"
    name, options = parse_command(shlex.split(lines["worker"]))
    assert name == "run_jobs"
    # Heroku signals every process of a dyno: no supervisor's children to be signalled twice.
    assert options.single_process is True
    assert stop_takes(options) <= HEROKU_KILL_AFTER


# --- Kubernetes -------------------------------------------------------------------------


def deployment() -> dict[str, Any]:
    return yaml.safe_load(the_block("yaml", "kind: Deployment"))


def jobs_container() -> tuple[dict[str, Any], dict[str, Any]]:
    spec = deployment()["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def probe_command(probe: dict[str, Any]) -> list[str]:
    return probe["exec"]["command"]


def probed_commands(command: list[str]) -> list[list[str]]:
    if command[:2] == ["sh", "-c"]:
        return script_commands(command[2])
    return [command]


def test_the_kubernetes_deployment_waits_for_a_graceful_stop_and_probes_its_own_processes():
    document = deployment()
    assert (document["apiVersion"], document["kind"]) == ("apps/v1", "Deployment")
    rolling = document["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0  # an old pod goes only once a new one is ready
    spec, container = jobs_container()
    # Exec form: run_jobs is PID 1, the process the kubelet signals.
    command = container["command"]
    assert command[:3] == ["python", "manage.py", "run_jobs"]
    _, options = parse_command(command)
    assert spec["terminationGracePeriodSeconds"] >= stop_takes(options)
    for kind in ("readinessProbe", "livenessProbe"):
        probe = container[kind]
        commands = probed_commands(probe_command(probe))
        assert commands, f"{kind} runs no manage.py command"
        for argv in commands:
            assert parse_command(argv)[0] == "jobs_health"
        assert probe["timeoutSeconds"] >= PROBE_TIMEOUT_AT_LEAST
        assert probe["periodSeconds"] >= probe["timeoutSeconds"]
    # Liveness must not restart pods for a database outage (jobs_health's exit 2).
    assert "test $? -ne 1" in probe_command(container["livenessProbe"])[2]


def run_probe(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The probe's exact command, with this machine's interpreter and manage.py."""
    python, manage = shlex.quote(sys.executable), shlex.quote(str(MANAGE))
    if command[:2] == ["sh", "-c"]:
        script = command[2].replace("python manage.py", f"{python} {manage}")
        argv = [*command[:2], script]
    else:
        assert command[:2] == ["python", "manage.py"]
        argv = [sys.executable, str(MANAGE), *command[2:]]
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def probe_env(url: str) -> dict[str, str]:
    env = {**os.environ, **FAST_ENV, "PYTHONUNBUFFERED": "1", "DATABASE_URL": url}
    env.pop("TEST_DATABASE_NAME", None)
    return env


@pytest.mark.workers
def test_the_probes_exit_codes_without_and_with_a_live_worker(run_jobs, tmp_path):
    _, container = jobs_container()
    ready = probe_command(container["readinessProbe"])
    alive = probe_command(container["livenessProbe"])
    env = probe_env(database_url())

    # No run_jobs on this host: neither ready nor alive.
    for command in (ready, alive):
        done = run_probe(command, env)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "no worker; no dispatcher" in done.stderr

    # The database cannot be read: not ready, but not restarted either.
    unreadable = probe_env(f"sqlite:///{tmp_path}/no-such-dir/jobs.sqlite3")
    assert run_probe(ready, unreadable).returncode == 2
    assert run_probe(alive, unreadable).returncode == 0

    # A live run_jobs (worker and dispatcher): ready and alive.
    worker = run_jobs()
    # Its rows first, read here: each probe is a Python process importing Django, and
    # probes started back to back while run_jobs starts only slow that start down.
    wait_until(
        lambda: (
            {Process.Kind.WORKER, Process.Kind.DISPATCHER}
            <= set(Process.objects.values_list("kind", flat=True))
        ),
        timeout=60,
        what="run_jobs' worker and dispatcher registered",
    )
    wait_until(lambda: run_probe(ready, env).returncode == 0, timeout=60, what="readiness")
    done = run_probe(alive, env)
    assert done.returncode == 0, done.stderr
    assert "ok on host" in done.stdout
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0
    assert run_probe(ready, env).returncode == 1
