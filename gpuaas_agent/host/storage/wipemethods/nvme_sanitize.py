"""``nvme_sanitize``: Sanitize (crypto erase, block erase or overwrite), polled through the sanitize status log.

Only with the SANICAP bit of the action, and only where the leased namespace is the subsystem's
only one (Sanitize acts on the whole NVM subsystem: ``nvmewipe.check_scope``); the check, erase and
proof are the NVMe methods' (``nvme.py``).
"""

from __future__ import annotations

from typing import Final

from gpuaas_agent.contract.nvmewipe import WipeMethod
from gpuaas_agent.host.storage.wipemethods import nvme

METHOD: Final = WipeMethod.nvme_sanitize
check = nvme.check
wipe = nvme.wipe
prove = nvme.prove
