"""``dedupcore sql init`` and ``dedupcore serve`` with a partitioned SQL table, chosen on
the command line or in the settings file, on the machine's PostgreSQL and MariaDB
(docs/sql-partitions.md, "From the command line").

The table is checked in the database's own catalog: partitioned by RANGE on ``part``,
partitions of the span asked for, and each claimed key's row in the partition of the
time inside its id.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedupcore.api import Outcome
from dedupcore.ids import IdGenerator, time_of
from tests.support.daemon import Lab
from tests.support.procs import PATIENCE, run_cli
from tests.support.servers import SERVERS
from tests.support.stores import SqlTable, sql_table, unique_ns

SPANS = {"day": 86400, "hour": 3600}


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[SqlTable]:
    eng = sql_table("postgresql", tmp_path, prefix="dc_srv")
    yield eng
    eng.drop()


@pytest.fixture
def mariadb(tmp_path: Path) -> Iterator[SqlTable]:
    eng = sql_table("mysql", tmp_path, prefix="dc_srv")
    yield eng
    eng.drop()


def partition_bounds(engine: SqlTable) -> list[tuple[int, int]]:
    """(start, end) of each partition of the table, from the catalog, in order."""
    if engine.name == "postgresql":
        [(strategy, column)] = engine.execute(
            "SELECT p.partstrat, a.attname FROM pg_partitioned_table p JOIN pg_attribute a "
            "ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0] "
            f"WHERE p.partrelid = to_regclass('{engine.table}')"
        )
        assert (strategy, column) == ("r", "part")  # RANGE on part
        rows = engine.execute(
            "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c "
            f"ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass('{engine.table}')"
        )
        bounds = []
        for (text,) in rows:
            m = re.fullmatch(r"FOR VALUES FROM \('(\d+)'\) TO \('(\d+)'\)", text)
            assert m, text
            bounds.append((int(m.group(1)), int(m.group(2))))
        return sorted(bounds)
    rows = engine.execute(
        "SELECT PARTITION_NAME, PARTITION_METHOD, PARTITION_EXPRESSION, PARTITION_DESCRIPTION "
        "FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() "
        f"AND TABLE_NAME = '{engine.table}' ORDER BY PARTITION_ORDINAL_POSITION"
    )
    assert rows and all(r[0] is not None for r in rows), rows  # partitioned at all
    bounds = []
    for name, method, expression, upper in rows:
        assert method == "RANGE" and expression.strip("`") == "part", (method, expression)
        start = int(name.removeprefix("p_p"))
        bounds.append((start, int(upper)))
    return bounds


def assert_partitioned(engine: SqlTable, span: int) -> list[tuple[int, int]]:
    bounds = partition_bounds(engine)
    assert len(bounds) >= 3, bounds
    for start, end in bounds:
        assert start % span == 0 and end - start == span, (start, end)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), bounds
    assert bounds[-1][1] > time.time()  # partitions ahead of now
    return bounds


def claim_ids_through(lab: Lab, engine: SqlTable, serve_args: list[str], span: int) -> None:
    """Claims time-ordered ids through a daemon; each row lands in its id's partition."""
    daemon = lab.daemon(*serve_args)
    ns = unique_ns("parts")
    keys = IdGenerator(region=1).next_many(5)
    with daemon.client(timeout=PATIENCE) as client:
        claims = client.claim_many(keys, namespace=ns)
        assert [c.outcome for c in claims] == [Outcome.NEW] * 5
        client.complete_many([(c.key, c.token, b"done") for c in claims], namespace=ns)
        again = client.claim_many(keys, namespace=ns)
        assert [(c.outcome, c.result) for c in again] == [(Outcome.DUPLICATE, b"done")] * 5
    for key in keys:
        start = time_of(key) // 1000 // span * span
        k = key.replace("'", "")
        if engine.name == "postgresql":
            rows = engine.execute(
                f'SELECT part, tableoid::regclass::text FROM "{engine.table}" '
                f"WHERE namespace = '{ns}' AND key = convert_to('{k}', 'UTF8')"
            )
            assert rows == [(start, f"{engine.table}_p{start}")], (key, rows)
        else:
            rows = engine.execute(
                f"SELECT part FROM `{engine.table}` PARTITION (`p_p{start}`) "
                f"WHERE namespace = '{ns}' AND `key` = '{k}'"
            )
            assert rows == [(start,)], (key, rows)
    assert daemon.stop() == 0


def test_postgresql_hour_partitions_from_the_settings_file(
    lab: Lab, postgres: SqlTable, tmp_path: Path
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        f'authority = ["{SERVERS.postgresql}"]\n'
        f'table = "{postgres.table}"\n'
        'partition = "hour"\n'
        'partition_tolerance = "2m"\n'
        "partitions_ahead = 2\n"
        "[retention]\n"
        'exact_window = "3h"\n'
    )
    init = run_cli("sql", "init", "--config", str(config))
    assert init.returncode == 0, init.stderr
    assert f"dedup table '{postgres.table}' ready on postgresql" in init.stdout
    assert "partitioned by hour" in init.stdout
    bounds = assert_partitioned(postgres, SPANS["hour"])
    # The window back (3 hours and the tolerance) and 2 hours ahead: 6 or 7 partitions.
    assert 6 <= len(bounds) <= 7, bounds
    assert postgres.execute(f'SELECT span FROM "{postgres.table}_parts"') == [(3600,)]
    claim_ids_through(lab, postgres, ["--config", str(config)], SPANS["hour"])


def test_mariadb_day_partitions_from_the_command_line(lab: Lab, mariadb: SqlTable) -> None:
    table_options = ["--table", mariadb.table, "--partition", "day"]
    init = run_cli(
        "sql", "init", "--url", SERVERS.mariadb, *table_options, "--partitions-ahead", "4"
    )
    assert init.returncode == 0, init.stderr
    assert "partitioned by day" in init.stdout
    bounds = assert_partitioned(mariadb, SPANS["day"])
    assert bounds[-1][0] >= time.time() // 86400 * 86400 + 4 * 86400 - 1  # 4 ahead
    assert mariadb.execute(f"SELECT span FROM `{mariadb.table}_parts`") == [(86400,)]
    serve = ["--authority", SERVERS.mariadb, *table_options, "--partition-tolerance", "10m"]
    claim_ids_through(lab, mariadb, serve, SPANS["day"])


def test_a_partition_setting_is_for_a_sql_authority_only(lab: Lab) -> None:
    rc, out = lab.serve_expecting_refusal(
        "--data", str(lab.tmpdir() / "d"), "--socket", str(lab.tmpdir() / "s"), "--partition", "day"
    )
    assert rc == 1, out
    assert "partition: only a SQL authority" in out and "Traceback" not in out, out
    rc, out = lab.serve_expecting_refusal("--partition-tolerance", "5m", "--print-config")
    assert rc == 1 and "partition_tolerance: set with no partition" in out, out
    bad = run_cli("sql", "init", "--url", SERVERS.mariadb, "--partition", "week")
    assert bad.returncode == 1 and "partition: must be one of day, hour" in bad.stderr
