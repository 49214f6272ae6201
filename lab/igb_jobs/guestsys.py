"""Runs INSIDE the igb guest: the sysfs reads every igb job makes, in one place.

``lab/igb_guest.py`` ships this directory with every run as the ``igb_jobs`` package (on the guest's
``PYTHONPATH``), so a job imports ``from igb_jobs.guestsys import ...`` instead of carrying its own copy.
"""

import os


def sysfs(path):
    with open(path) as fh:
        return fh.read().strip()


def driver_of(netdev):
    """The driver bound to ``netdev``'s device, or None (a virtual link has none)."""
    link = f"/sys/class/net/{netdev}/device/driver"
    return os.path.basename(os.path.realpath(link)) if os.path.exists(link) else None


def igb_pfs():
    """The guest's igb PF netdevs, by name (the emulated NIC under test is the first)."""
    return [n for n in sorted(os.listdir("/sys/class/net")) if driver_of(n) == "igb"]
