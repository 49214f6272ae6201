"""An NVMe disk's SMART log (nvme-cli ``smart-log``) and its verdict: is the drive fit for a tenant.

Used by the quarantine re-check of a disk quarantined ``smart_failing``. ``media_errors`` count for
the drive's life: a drive an operator judged fit with N of them passes while the count stays N, and
fails again on the first new one; ``critical_warning`` must be clear and the wear under 100 %.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from gpuaas_agent.errors import HostError
from gpuaas_agent.host.run import Completed, run

SMART_TIMEOUT_S = 10.0
Runner = Callable[..., Awaitable[Completed]]


def smart_value(doc: dict[str, Any], *names: str) -> int | None:
    """A counter of the log by any of its nvme-cli spellings (1.x flat ints, 2.x ``{"value": N}``)."""
    for name in names:
        value = doc.get(name)
        if isinstance(value, dict):
            value = value.get("value")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def judge_smart(doc: dict[str, Any], *, media_errors_baseline: int = 0) -> tuple[bool, str, dict[str, Any]]:
    """(fit, one-line detail, the counters read). A log without ``critical_warning`` proves nothing: unfit."""
    critical = smart_value(doc, "critical_warning")
    media = smart_value(doc, "media_errors")
    used = smart_value(doc, "percent_used", "percentage_used")
    counters = {"critical_warning": critical, "media_errors": media, "percentage_used": used,
                "media_errors_baseline": media_errors_baseline}
    problems = []
    if critical is None:
        problems.append("smart-log has no critical_warning")
    elif critical:
        problems.append(f"critical_warning={critical:#x}")
    if media is not None and media > media_errors_baseline:
        problems.append(f"media_errors={media} (was {media_errors_baseline} when judged)")
    if used is not None and used >= 100:
        problems.append(f"percentage_used={used}")
    if problems:
        return False, "; ".join(problems), counters
    return True, f"critical_warning=0, media_errors={media}, percentage_used={used}", counters


async def read_smart_log(dev: str, *, runner: Runner = run, timeout: float = SMART_TIMEOUT_S) -> dict[str, Any]:
    """``nvme smart-log -o json <dev>`` as a dict; ``smart_log_unreadable`` when it fails or prints no object."""
    argv = ["nvme", "smart-log", "-o", "json", dev]
    try:
        done = await runner(argv, timeout=timeout)
        doc = json.loads(done.stdout)
    except HostError as exc:
        raise HostError(f"nvme smart-log {dev} failed: {exc.message}", code="smart_log_unreadable",
                        evidence=exc.evidence) from exc
    except ValueError:
        raise HostError(f"nvme smart-log {dev} printed no JSON", code="smart_log_unreadable",
                        evidence={"argv": argv}) from None
    if not isinstance(doc, dict):
        raise HostError(f"nvme smart-log {dev} printed a JSON {type(doc).__name__}", code="smart_log_unreadable",
                        evidence={"argv": argv})
    return doc
