from tests.control.conftest import nats_server  # noqa: F401 - the real nats-server fixture
from tests.control.test_daemon import agents, short_dir  # noqa: F401 - agent processes stopped by PID; short AF_UNIX dirs
from tests.dnsmasq_fixture import dhcp_lab, net_lab  # noqa: F401 - namespaces + a real dnsmasq
