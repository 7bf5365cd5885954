"""The library works without its extras; what needs one names it.

Without the ``cli`` extra (rich, prometheus-client) the library works and the
CLI commands that need it say so; without the ``redis`` extra (redis-py) the
package, the embedded store, the daemon and the CLI work, and every Redis part
raises :class:`~dedupcore.errors.MissingExtraError` naming ``dedupcore[redis]``.

Each check runs in a subprocess whose import system refuses the extra's
modules (as if they were not installed), so what this process has already
imported does not matter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The top-level modules of each extra that the checks hide.
CLI_MODULES = ("rich", "prometheus_client")
REDIS_MODULES = ("redis", "hiredis")


def _block(blocked: tuple[str, ...]) -> str:
    return textwrap.dedent(
        f"""
        import importlib.abc
        import sys

        BLOCKED = {blocked!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        for name in list(sys.modules):
            if name.split(".")[0] in BLOCKED:
                del sys.modules[name]
        sys.meta_path.insert(0, Block())
        """
    )


def _run(
    body: str, tmp: Path, blocked: tuple[str, ...] = CLI_MODULES
) -> subprocess.CompletedProcess[str]:
    script = tmp / "check.py"
    script.write_text(_block(blocked) + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script), str(tmp)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


def test_the_import_hook_really_blocks(tmp_path: Path) -> None:
    out = _run(
        """
        for name in ("rich", "prometheus_client", "rich.progress", "redis", "redis.exceptions"):
            try:
                __import__(name)
            except ImportError:
                continue
            raise SystemExit(f"{name} imported")
        print("blocked")
        """,
        tmp_path,
        blocked=CLI_MODULES + REDIS_MODULES,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "blocked"


def test_library_imports_and_claims_without_the_cli_extra(tmp_path: Path) -> None:
    out = _run(
        """
        import json
        import sys

        import dedupcore
        import dedupcore.cli
        from dedupcore import DedupStore, Outcome
        from dedupcore.store import front as store_module

        with DedupStore.open(sys.argv[1] + "/data") as store:
            c = store.claim("k", namespace="n")
            store.complete("k", c.token, namespace="n", result="done")
            dup = store.claim("k", namespace="n")
        # A long rebuild on a terminal would draw a bar with rich: without it, no bar.
        sys.stderr.isatty = lambda: True
        update = store_module._progress(1_000_000, "rebuilding")
        update(10)
        update(1_000_000)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("rich", "prometheus_client"))
        print(json.dumps([c.outcome.value, dup.outcome.value, dup.result, loaded]))
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["new", "duplicate", "done", []]


def test_cli_commands_that_need_the_extra_say_what_to_install(tmp_path: Path) -> None:
    out = _run(
        """
        import contextlib
        import io
        import json
        import os
        import sys

        from dedupcore.cli import main

        tmp = sys.argv[1]
        answers = {}
        for name, argv in [
            ("demo", ["demo", "--keys", "10"]),
            ("stats", ["stats", "--socket", tmp + "/none.sock"]),
            ("stats-json", ["stats", "--json", "--socket", tmp + "/none.sock"]),
            (
                "serve-metrics",
                ["serve", "--data", tmp + "/served", "--socket", tmp + "/s.sock",
                 "--metrics-port", "9"],
            ),
        ]:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(argv)
            answers[name] = [rc, err.getvalue()]
        answers["served-dir-made"] = os.path.exists(tmp + "/served")
        print(json.dumps(answers))
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout)
    for name in ("demo", "stats", "serve-metrics"):
        rc, said = answers[name]
        assert rc == 2, (name, said)
        assert "install dedupcore[cli]" in said, (name, said)
    assert "rich" in answers["demo"][1] and "prometheus-client" in answers["serve-metrics"][1]
    # JSON stats need no extra: it gets as far as the (absent) daemon.
    rc, said = answers["stats-json"]
    assert rc == 1 and "dedupcore[cli]" not in said
    assert answers["served-dir-made"] is False  # refused before opening a store


def test_package_store_daemon_and_cli_work_without_the_redis_extra(tmp_path: Path) -> None:
    serve = tmp_path / "serve.py"
    serve.write_text(
        _block(REDIS_MODULES) + "from dedupcore.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    out = _run(
        """
        import json
        import os
        import signal
        import subprocess
        import sys
        import time

        import dedupcore
        import dedupcore.cli
        import dedupcore.factory
        import dedupcore.stack
        import dedupcore.sql
        from dedupcore import Client, DedupStore, open_store

        tmp = sys.argv[1]
        answers = {}
        with DedupStore.open(tmp + "/embedded") as store:
            c = store.claim("k", namespace="n")
            store.complete("k", c.token, namespace="n", result="done")
            answers["embedded"] = [c.outcome.value, store.claim("k", namespace="n").outcome.value]
        with open_store(tmp + "/opened") as store:
            answers["open_store"] = store.claim("k", namespace="n").outcome.value

        # The daemon, run by the command line in a process that cannot import redis either.
        sock = tmp + "/d.sock"
        daemon = subprocess.Popen(
            [sys.executable, tmp + "/serve.py", "serve", "--data", tmp + "/served",
             "--socket", sock],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(sock) and daemon.poll() is None:
                if time.monotonic() > deadline:
                    raise SystemExit("the daemon made no socket")
                time.sleep(0.05)
            if daemon.poll() is not None:
                raise SystemExit("serve exited: " + daemon.stderr.read())
            with Client(sock) as client:
                first = client.claim("k", namespace="n")
                client.complete("k", first.token, namespace="n")
                again = client.claim("k", namespace="n")
                answers["daemon"] = [first.outcome.value, again.outcome.value]
        finally:
            daemon.send_signal(signal.SIGTERM)
            answers["daemon_rc"] = daemon.wait(timeout=120)
        answers["redis_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "redis")
        print(json.dumps(answers))
        """,
        tmp_path,
        blocked=REDIS_MODULES,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "embedded": ["new", "duplicate"],
        "open_store": "new",
        "daemon": ["new", "duplicate"],
        "daemon_rc": 0,
        "redis_loaded": [],
    }


def test_redis_parts_without_the_extra_name_it(tmp_path: Path) -> None:
    out = _run(
        """
        import contextlib
        import importlib
        import io
        import json
        import os
        import sys

        from dedupcore import open_store
        from dedupcore.cli import main
        from dedupcore.errors import DedupError, MissingExtraError

        tmp = sys.argv[1]
        answers = {}

        def attempt(name, call):
            try:
                call()
            except MissingExtraError as exc:
                kinds = [isinstance(exc, ImportError), isinstance(exc, DedupError)]
                answers[name] = [*kinds, str(exc)]
            else:
                answers[name] = "no error"

        attempt("redis", lambda: importlib.import_module("dedupcore.redis"))
        attempt("tiers.redis", lambda: importlib.import_module("dedupcore.tiers.redis"))
        attempt("tiers.cache", lambda: importlib.import_module("dedupcore.tiers.cache"))
        attempt("authority", lambda: open_store("redis://127.0.0.1:6379/0"))
        attempt("cache", lambda: open_store(tmp + "/local", cache="redis://127.0.0.1:6379/0"))
        for name, argv in [
            ("serve-authority", ["serve", "--authority", "redis://127.0.0.1:6379/0"]),
            ("serve-cache", ["serve", "--data", tmp + "/served", "--cache", "redis://127.0.0.1:6379/0"]),
        ]:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main([*argv, "--socket", tmp + "/s.sock"])
            answers[name] = [rc, err.getvalue()]
        answers["socket-made"] = os.path.exists(tmp + "/s.sock")
        print(json.dumps(answers))
        """,
        tmp_path,
        blocked=REDIS_MODULES,
    )
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout)
    for name in ("redis", "tiers.redis", "tiers.cache", "authority", "cache"):
        is_import_error, is_dedup_error, said = answers[name]
        assert is_import_error and is_dedup_error, (name, said)
        assert "pip install 'dedupcore[redis]'" in said, (name, said)
    for name in ("serve-authority", "serve-cache"):
        rc, said = answers[name]
        assert rc == 1, (name, said)
        assert "pip install 'dedupcore[redis]'" in said and "Traceback" not in said, (name, said)
    assert answers["socket-made"] is False  # refused before serving


#: Each framework integration, the top-level module of its framework, and its extra.
FRAMEWORKS = [
    ("dedupcore.integrations.celery", "celery", "celery"),
    ("dedupcore.integrations.django", "django", "django"),
    ("dedupcore.integrations.faststream", "faststream", "faststream"),
    ("dedupcore.integrations.dramatiq", "dramatiq", "dramatiq"),
    ("dedupcore.tracing", "opentelemetry", "otel"),
]


def test_each_framework_integration_without_its_extra_names_it(tmp_path: Path) -> None:
    for module, framework, extra in FRAMEWORKS:
        out = _run(
            f"""
            import importlib
            from dedupcore.errors import MissingExtraError

            try:
                importlib.import_module({module!r})
            except MissingExtraError as exc:
                print(str(exc))
            else:
                raise SystemExit("imported without {framework}")
            """,
            tmp_path,
            blocked=(framework,),
        )
        assert out.returncode == 0, (module, out.stderr)
        assert f"pip install 'dedupcore[{extra}]'" in out.stdout, (module, out.stdout)
