"""``nvme_format``: Format NVM with a secure erase setting (user data, or crypto where FNA bit 2 says so).

Only on a controller that reports Format NVM (OACS bit 1), on the leased namespace, inside the
lease's scope (``nvmewipe.check_scope``); the check, erase and proof are the NVMe methods' (``nvme.py``).
"""

from __future__ import annotations

from typing import Final

from gpuaas_agent.contract.nvmewipe import WipeMethod
from gpuaas_agent.host.storage.wipemethods import nvme

METHOD: Final = WipeMethod.nvme_format
check = nvme.check
wipe = nvme.wipe
prove = nvme.prove
