"""A small Django project for tests/integrations/test_django.py.

Its views record each execution as a row of an SQLite file (``EFFECTS_DB``),
so a test counts executions apart from what the responses say. A request
with ``X-Gate: NAME`` writes ``NAME.started`` in ``GATES`` and waits for
``NAME.open`` there, so a test can hold a view while it sends retries. The
project runs in the test process (Django's test client) and in a uvicorn
server of its own (``asgi.py``); its settings come from environment
variables in the latter.
"""
