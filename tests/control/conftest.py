"""The nats-server fixture is a pytest plugin now: tests/support/nats_server.py (tests/conftest.py registers it).

Re-exported here only for tests/deploy/test_deb.py and tests/control/test_transport.py, which other
branches were editing when the fixture moved; once they import from ``tests.support.nats_server`` this
file goes (tests/test_test_hygiene.py names it as the one re-export left).
"""

from tests.support.nats_server import NatsServer, free_port, nats_server

__all__ = ["NatsServer", "free_port", "nats_server"]
