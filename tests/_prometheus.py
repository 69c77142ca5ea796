"""A real ``prometheus`` server for tests: started on a free port, scraping the targets a test names
every half second (and evaluating its rule files as often), asked through its HTTP API, stopped after.

Tests get it through :func:`require_prometheus` (``PrometheusServer.start`` calls it): where the
binary is missing the test is skipped with the reason; under CI (``$CI`` set) a missing binary fails
the test instead, since ``make test`` installs it there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _redis import free_port, in_ci

INTERVAL = "500ms"  # scrape and rule-evaluation interval: a test waits a few of these at most


def require_prometheus() -> str:
    """Path of ``prometheus``; skips the calling test where it is missing (fails it under CI)."""
    path = shutil.which("prometheus")
    if path is not None:
        return path
    reason = "prometheus not found on PATH: install it (apt-get install prometheus) or run `make test`"
    if in_ci():
        pytest.fail(
            f"{reason}; CI is set, where `make test` installs it, so this is an error, not a skip", pytrace=False
        )
    pytest.skip(reason)


@dataclass
class PrometheusServer:
    """One ``prometheus`` process in its own directory, scraping ``targets`` (``host:port``)."""

    workdir: Path
    targets: list[str]
    rule_files: list[Path] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        binary = require_prometheus()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {  # JSON is YAML: prometheus reads it as is
            "global": {"scrape_interval": INTERVAL, "scrape_timeout": INTERVAL, "evaluation_interval": INTERVAL},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [{"job_name": "warmstart", "static_configs": [{"targets": self.targets}]}],
        }
        config_file = self.workdir / "prometheus.yml"
        config_file.write_text(json.dumps(config, indent=1))
        with open(self.workdir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout  # hang guard for start-up, not a speed check
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        log = self.workdir / "prometheus.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """The instant vector ``expr`` evaluates to now (``/api/v1/query``): (labels, value) per series,
        ``__name__`` among the labels."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        assert body["data"]["resultType"] == "vector", body
        return [(item["metric"], float(item["value"][1])) for item in body["data"]["result"]]

    def wait_for(self, expr: str, ok: Callable[[list], bool], timeout: float = 20.0) -> list:
        """Query ``expr`` until ``ok(result)`` holds; fails the test with the last result after ``timeout``."""
        deadline = time.monotonic() + timeout  # a few scrape intervals are enough; this guards a hang
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus: {expr} is {result} after {timeout:g} s\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
