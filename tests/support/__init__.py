"""What the test suites share: servers, daemons, stores, processes and fakes.

``tests/conftest.py`` loads these modules as pytest plugins, so their fixtures
are seen by every test; their helpers are imported as ``tests.support.<module>``.
tests/README.md lists what each module holds.
"""
