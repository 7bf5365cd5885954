"""The ASGI application a server process runs (settings from the environment)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.integrations.django_app.settings")
application = get_asgi_application()
