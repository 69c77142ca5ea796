"""The operator files in server/ stay in step with the code: the config templates name what the
generator writes, and every deployment example passes only options ``warmstart server start`` has."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from warmstart.cli.server import start as start_command
from warmstart.server.acl import render_acl_file
from warmstart.server.config import ServerOptions, render_redis_conf

SERVER = Path(__file__).resolve().parents[2] / "server"


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(tls_cert="/c.pem", tls_key="/k.pem"),
        dict(cluster=3, bind="0.0.0.0", advertise="10.0.0.5", aof=True, tls_cert="/c.pem", tls_key="/k.pem"),
    ],
    ids=["single", "tls", "cluster-tls"],
)
def test_redis_conf_template_names_every_generated_directive(tmp_path, options):
    template = (SERVER / "redis.conf.template").read_text()
    documented = {m.group(1) for m in re.finditer(r"^(?:# )?([a-z][a-z-]+) ", template, re.M)}
    conf = render_redis_conf(ServerOptions(dir=tmp_path, **options), 0, daemonize=True)
    directives = {line.split()[0] for line in conf.splitlines() if line and not line.startswith("#")}
    assert directives - documented == set()


def test_acl_template_is_the_generated_acl_with_placeholders():
    passwords = {"admin": "a", "writer": "w", "reader": "r"}
    generated = render_acl_file(passwords)
    for user in passwords:
        generated = re.sub(
            rf"(user {user} reset on )#[0-9a-f]{{64}}", rf"\1#{{SHA256_OF_{user.upper()}_PASSWORD}}", generated
        )
    assert (SERVER / "users.acl.template").read_text() == generated


def _check_start_args(args: list[str]) -> None:
    assert "--foreground" in args  # a supervisor (systemd, Docker, Kubernetes) owns the process
    start_command.make_context("start", list(args))  # raises on an unknown option or a bad value


def test_systemd_unit_runs_a_valid_start_command():
    unit = (SERVER / "warmstart-server.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*?)(?<!\\)$", unit.replace("\\\n", " "), re.M).group(1)
    argv = shlex.split(exec_start)
    assert argv[:3] == ["/usr/local/bin/warmstart", "server", "start"]
    _check_start_args(argv[3:])


def test_container_examples_run_valid_start_commands():
    dockerfile = (SERVER / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    assert entrypoint[:3] == ["warmstart", "server", "start"]
    _check_start_args(entrypoint[3:] + cmd)
    compose = (SERVER / "docker-compose.yml").read_text()
    command = json.loads(re.search(r"command: (\[.*?\])", compose, re.S).group(1))
    _check_start_args(entrypoint[3:] + command)
    kube = (SERVER / "kubernetes" / "warmstart-cache.yaml").read_text()
    args = json.loads(re.search(r"args: (\[.*?\])", kube, re.S).group(1))
    _check_start_args(entrypoint[3:] + args)
