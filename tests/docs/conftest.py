"""Every code block of README.md and docs/*.md, run by Sybil against real stores and servers.

The documents live outside ``tests/``, where pytest never walks, so this
directory's collector hands them to Sybil's own ``pytest_collect_file``
(:data:`DOCUMENTS`); each document is then a test module of its own and
each block a test, reported against the document's path and line.

Parsers (what each kind of block must do to pass):

- ``python``: run; a document's blocks share one namespace (doctest blocks,
  ``>>>``, compare their output);
- ``bash``, ``sh``, ``console``: run by :class:`ShellBlockParser` with
  ``bash -eo pipefail`` in the document's directory, the virtualenv's
  ``bin`` first on ``PATH``, within :data:`SHELL_TIMEOUT` seconds
  (``console`` blocks: the lines after ``$ ``);
- ``toml``: loaded through ``dedupcore serve``'s settings loader
  (:func:`dedupcore.cli.config.load`), so a setting that does not exist or
  a value it refuses fails;
- ``yaml``, ``json``: parsed;
- ``<!-- skip: next "reason" -->`` / ``skip: start``/``end``: Sybil's skip
  directive, reported as a skipped test with its reason.

Per document (:func:`doc_env`): a fresh short temporary directory as the
working directory; when the document names them, ``REDIS_URL`` (a Redis
database of its own, flushed before and after), ``POSTGRES_URL`` and
``MARIADB_URL`` (a database created for the document and dropped after),
``AMQP_URL``, ``NATS_URL`` and ``KAFKA_BOOTSTRAP``; and when it uses the
daemon, a ``dedupcore serve`` started with the launcher of
tests/support/daemon.py, its socket in ``DEDUPCORE_SOCKET``. The same names
are the environment of shell blocks. The servers' addresses come from
``DEDUPCORE_TEST_REDIS``, ``DEDUPCORE_TEST_POSTGRES``,
``DEDUPCORE_TEST_MARIADB``, ``DEDUPCORE_TEST_AMQP``, ``DEDUPCORE_TEST_NATS``
and ``DEDUPCORE_KAFKA_BOOTSTRAP``, with the local servers as defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

from dedupcore.api import ClaimAPI
from dedupcore.cli import config as serve_config
from tests.support.daemon import Lab
from tests.support.servers import require_server

ROOT = Path(__file__).resolve().parents[2]
#: The documents whose blocks are run.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Seconds a shell block may take.
SHELL_TIMEOUT = 300.0

REDIS = os.environ.get("DEDUPCORE_TEST_REDIS", "redis://127.0.0.1:6379")
POSTGRES = os.environ.get("DEDUPCORE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
MARIADB = os.environ.get("DEDUPCORE_TEST_MARIADB", "mysql://root@127.0.0.1:3306/test")
AMQP = os.environ.get("DEDUPCORE_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS = os.environ.get("DEDUPCORE_TEST_NATS", "nats://127.0.0.1:4222")
KAFKA = os.environ.get("DEDUPCORE_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
#: Redis databases the documents take in turn (the other tests use 0 and 9..15).
REDIS_DBS = itertools.cycle(range(1, 9))
#: What in a document's text means it talks to the daemon.
DAEMON_MARKS = ("Client(", "DEDUPCORE_SOCKET", "dedupcore stats")


# -- the parsers --------------------------------------------------------------------------


class ShellBlockParser(CodeBlockParser):
    """Runs a ``bash``/``sh``/``console`` block in a subprocess in the document's directory."""

    def __init__(self, language: str) -> None:
        super().__init__(language=language)

    def script(self, source: str) -> str:
        if self.language != "console":
            return source
        return "\n".join(line[2:] for line in source.splitlines() if line.startswith("$ "))

    def evaluate(self, example: Example) -> str | None:
        env: dict[str, Any] = example.namespace["_docs"]
        bin_dir = str(Path(sys.executable).parent)
        environ = {**os.environ, **env["environ"]}
        environ["PATH"] = bin_dir + os.pathsep + environ.get("PATH", "")
        try:
            proc = subprocess.run(
                ["bash", "-eo", "pipefail", "-c", self.script(example.parsed)],
                cwd=env["home"],
                env=environ,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=SHELL_TIMEOUT,
            )
        except subprocess.TimeoutExpired as exc:
            return f"the block did not finish within {SHELL_TIMEOUT} s:\n{exc.stdout}{exc.stderr}"
        if proc.returncode != 0:
            return (
                f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                f"\n--- stderr\n{proc.stderr[-4000:]}"
            )
        return None


def evaluate_toml(example: Example) -> str | None:
    """Loads the block as a ``dedupcore serve --config`` file (a SettingsError fails it)."""
    path = Path(example.namespace["_docs"]["home"]) / f"block-{example.line}.toml"
    path.write_text(example.parsed)
    serve_config.load(argparse.Namespace(config=str(path)), environ={})
    return None


def evaluate_yaml(example: Example) -> str | None:
    yaml.safe_load(example.parsed)
    return None


def evaluate_json(example: Example) -> str | None:
    json.loads(example.parsed)
    return None


# -- what a document gets ------------------------------------------------------------------


def _with_path(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))


def _require(name: str, url: str, default_port: int) -> None:
    """Skips (outside CI) or fails when a local server is down; remote ones are not probed."""
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    if parts.hostname in ("127.0.0.1", "localhost"):
        require_server(name, parts.port or default_port)


@contextlib.contextmanager
def _redis_db() -> Iterator[str]:
    import redis

    _require("redis", REDIS, 6379)
    url = _with_path(REDIS, f"/{next(REDIS_DBS)}")
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


@contextlib.contextmanager
def _postgres_db() -> Iterator[str]:
    import psycopg

    _require("postgresql", POSTGRES, 5432)
    name = f"docs_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield _with_path(POSTGRES, f"/{name}")
    finally:
        with psycopg.connect(POSTGRES, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


@contextlib.contextmanager
def _mariadb_db() -> Iterator[str]:
    import pymysql

    _require("mariadb", MARIADB, 3306)
    parts = urlsplit(MARIADB)
    name = f"docs_{uuid.uuid4().hex[:12]}"

    def admin() -> Any:
        return pymysql.connect(
            host=parts.hostname,
            port=parts.port or 3306,
            user=parts.username or "root",
            password=parts.password or "",
            autocommit=True,
        )

    with admin() as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    try:
        yield _with_path(MARIADB, f"/{name}")
    finally:
        with admin() as conn, conn.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")


def _close_stores(namespace: dict[str, Any]) -> None:
    """Closes what a document left open (a store's threads must not outlive its directory)."""
    for value in list(namespace.values()):
        if isinstance(value, ClaimAPI):
            with contextlib.suppress(Exception):
                value.close()


@pytest.fixture(scope="module")
def doc_env(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """One document's directory, servers and daemon; its names put into its namespace.

    Module scope is the document's scope: Sybil makes each document a module.
    """
    document_file = request.node
    text = document_file.path.read_text()
    home = Path(tempfile.mkdtemp(prefix="dcdoc"))
    values: dict[str, str] = {}
    old_cwd = Path.cwd()
    old_socket = os.environ.get("DEDUPCORE_SOCKET")
    old_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    lab = Lab()
    with contextlib.ExitStack() as stack:
        if "REDIS_URL" in text:
            values["REDIS_URL"] = stack.enter_context(_redis_db())
        if "POSTGRES_URL" in text:
            values["POSTGRES_URL"] = stack.enter_context(_postgres_db())
        if "MARIADB_URL" in text:
            values["MARIADB_URL"] = stack.enter_context(_mariadb_db())
        if "AMQP_URL" in text:
            _require("rabbitmq", AMQP, 5672)
            values["AMQP_URL"] = AMQP
        if "NATS_URL" in text:
            _require("nats", NATS, 4222)
            values["NATS_URL"] = NATS
        if "KAFKA_BOOTSTRAP" in text:
            _require("kafka", KAFKA, 9092)
            values["KAFKA_BOOTSTRAP"] = KAFKA
        if any(mark in text for mark in DAEMON_MARKS):
            stack.callback(lab.close)
            values["DEDUPCORE_SOCKET"] = str(lab.daemon().socket)
            os.environ["DEDUPCORE_SOCKET"] = values["DEDUPCORE_SOCKET"]
        env = {"home": str(home), "environ": dict(values)}
        namespaces = [d.namespace for d in document_file.documents]
        for namespace in namespaces:
            namespace.update(values)
            namespace["_docs"] = env
        os.chdir(home)
        try:
            yield env
        finally:
            os.chdir(old_cwd)
            for namespace in namespaces:
                _close_stores(namespace)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            if old_socket is None:
                os.environ.pop("DEDUPCORE_SOCKET", None)
            else:
                os.environ["DEDUPCORE_SOCKET"] = old_socket
            shutil.rmtree(home, ignore_errors=True)


# -- collection ------------------------------------------------------------------------------

_DOCS = Sybil(
    parsers=[
        PythonCodeBlockParser(),
        ShellBlockParser("bash"),
        ShellBlockParser("sh"),
        ShellBlockParser("console"),
        CodeBlockParser("toml", evaluate_toml),
        CodeBlockParser("yaml", evaluate_yaml),
        CodeBlockParser("json", evaluate_json),
        SkipParser(),
    ],
    path=str(ROOT),
    patterns=["README.md", "docs/*.md"],
    fixtures=["doc_env"],
    name="docs",
)
_collect_document = _DOCS.pytest()


class Documents(pytest.File):
    """README.md and docs/*.md, collected from here since pytest does not walk into them."""

    def collect(self) -> Iterator[pytest.Collector]:
        for path in DOCUMENTS:
            node = _collect_document(path, self)
            if node is not None:
                yield node


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """This conftest stands for the documents (see the module docstring)."""
    if file_path == Path(__file__):
        return Documents.from_parent(parent, path=file_path)
    return None
