"""Settings of the test project (read from the environment by a server process)."""

from __future__ import annotations

import json
import os

SECRET_KEY = "dedupcore-tests"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.integrations.django_app.urls"
USE_TZ = True
INSTALLED_APPS: list[str] = []
DATABASES: dict[str, dict[str, str]] = {}

#: The idempotency middleware, behind the stand-in for authentication it scopes keys to.
WITH_MIDDLEWARE = [
    "tests.integrations.django_app.middleware.went_away",
    "tests.integrations.django_app.middleware.header_user",
    "dedupcore.integrations.django.idempotency_middleware",
]
WITHOUT_MIDDLEWARE = WITH_MIDDLEWARE[:2]
MIDDLEWARE = WITHOUT_MIDDLEWARE if os.environ.get("DJANGO_APP_MODE") == "views" else WITH_MIDDLEWARE

DEDUPCORE_STORE = "tests.integrations.django_app.stores.open_store"
#: More keywords of the middleware (JSON), as the kill tests give them: heartbeat, lease.
DEDUPCORE_IDEMPOTENCY = {
    "namespace": os.environ.get("DJANGO_APP_NAMESPACE", "http"),
    **json.loads(os.environ.get("DJANGO_APP_OPTIONS", "{}")),
}

#: Where the views record executions and find their gates; the store when there is no daemon.
EFFECTS_DB = os.environ.get("DJANGO_APP_EFFECTS", "")
GATES = os.environ.get("DJANGO_APP_GATES", "")
STORE_DIR = os.environ.get("DJANGO_APP_STORE", "")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"dedupcore": {"handlers": ["console"], "level": "INFO"}},
}
