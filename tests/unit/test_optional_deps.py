"""The library works without the ``cli`` extra (rich, prometheus-client); the CLI names it.

Each check runs in a subprocess whose import system refuses ``rich`` and
``prometheus_client`` (as if they were not installed), so what this process
has already imported does not matter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCK = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = ("rich", "prometheus_client")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    sys.meta_path.insert(0, Block())
    """
)


def _run(body: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    script = tmp / "check.py"
    script.write_text(BLOCK + textwrap.dedent(body))
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
        for name in ("rich", "prometheus_client", "rich.progress"):
            try:
                __import__(name)
            except ImportError:
                continue
            raise SystemExit(f"{name} imported")
        print("blocked")
        """,
        tmp_path,
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
        from dedupcore import store as store_module

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
