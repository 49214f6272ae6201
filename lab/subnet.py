"""Whether the lab's subnet is free on this machine: read from ``ip -j route``, nothing changed."""

from __future__ import annotations

from ipaddress import IPv4Network


def subnet_routed_elsewhere(routes: list[dict], subnet: IPv4Network) -> list[str]:
    """The routes of ``ip -j route show`` that overlap the lab's subnet (``"10.231.0.0/24 dev br0"``), default excluded.

    The lab owns its subnet: a route left by a killed run (a stale bridge holding the gateway) takes the guests'
    traffic, and the lab would fail minutes later with unreachable guests instead of saying why at the start.
    """
    held = []
    for route in routes:
        dst = route.get("dst", "")
        if dst == "default" or not dst:
            continue
        try:
            network = IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:  # an IPv6 or unusual entry: not the lab's
            continue
        if network.overlaps(subnet):
            held.append(f"{dst} dev {route.get('dev', '?')}")
    return held
