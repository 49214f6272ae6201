"""The wipe methods: one module per :class:`~gpuaas_agent.contract.nvmewipe.WipeMethod` a policy can run.

Each module offers ``check`` (prove, writing nothing, that the method can wipe the leased disk:
validate's question), ``wipe`` (erase the disk the guard let through) and ``prove`` (read it
back: the proof, or ``wipe_unverified``); see :class:`~.base.WipeMethodModule`. Adding a method
touches its module, :data:`WIPE_METHODS` and the contract's ``WipeMethod``; the table is checked
against the enum when this package is imported, so a method without a module, or a module under
a name the contract does not have, fails loudly instead of wiping some other way.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gpuaas_agent.contract.nvmewipe import RUNNABLE, WipeMethod
from gpuaas_agent.host.storage.wipemethods import discard, nvme_format, nvme_sanitize, zeroout
from gpuaas_agent.host.storage.wipemethods.base import WipeMethodModule


class WipeMethodTableError(LookupError):
    """The table of wipe methods and the contract's enum disagree: a programming error, raised at import."""


def checked_table(table: Mapping[WipeMethod, WipeMethodModule]) -> Mapping[WipeMethod, WipeMethodModule]:
    """``table``, read-only, once it maps every runnable method of the contract, and only those, each to the
    module that says it is that method; else :class:`WipeMethodTableError` naming what is wrong."""
    problems = [f"{m.value}: a method a policy can name has no module in the table"
                for m in sorted(RUNNABLE - table.keys(), key=lambda m: m.value)]
    problems += [f"{m!r}: not a method a policy can run (contract WipeMethod, RUNNABLE)"
                 for m in table if m not in RUNNABLE]
    problems += [f"{m.value}: registered to a module that is {module.METHOD.value}"
                 for m, module in table.items() if m in RUNNABLE and module.METHOD is not m]
    if problems:
        raise WipeMethodTableError("the wipe method table disagrees with the contract: " + "; ".join(problems))
    return MappingProxyType(dict(table))


WIPE_METHODS: Mapping[WipeMethod, WipeMethodModule] = checked_table({
    WipeMethod.discard: discard,
    WipeMethod.zeroout: zeroout,
    WipeMethod.nvme_format: nvme_format,
    WipeMethod.nvme_sanitize: nvme_sanitize,
})


def wipe_method(method: WipeMethod) -> WipeMethodModule:
    """The module that runs ``method``; ``auto`` must be resolved first, and ``zero_fill`` is no policy's."""
    try:
        return WIPE_METHODS[method]
    except KeyError:
        raise WipeMethodTableError(f"no wipe method module runs {method.value!r}: resolve auto first; "
                                   f"a policy names one of {sorted(m.value for m in WIPE_METHODS)}") from None
