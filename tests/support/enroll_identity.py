"""The host identity the enrollment tests enroll with (one definition, shared by their modules)."""

from __future__ import annotations

from gpuaas_agent.control.enroll import EnrollIdentity

IDENTITY = EnrollIdentity(machine_id="0123456789abcdef0123456789abcdef", hostname="slice-host-01",
                          dmi_serial="SN123", agent_version="0.1.0")
