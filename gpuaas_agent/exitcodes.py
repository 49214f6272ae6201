"""The exit codes every ``gpuaas-agent`` command uses, and which error codes map to which.

0 ok, 1 the check or job ran and failed, 2 usage or input error, 3 environment
error (the host's surroundings: NATS, the state dir, enrollment), 130 interrupted.
Scripts and systemd units depend on these: a code never moves between classes.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

USAGE_CODES = frozenset({"root_missing", "config_invalid", "config_unreadable", "netns_missing", "netns_on_fixture",
                         "unknown_profile", "output_exists", "usage"})
ENVIRONMENT_CODES = frozenset({"nats_unreachable", "nats_auth_refused", "enroll_unreachable", "not_enrolled",
                               "state_unreadable", "state_schema_newer", "state_error", "state_locked", "enrollment_record_invalid",
                               "daemon_status_unreadable", "daemon_status_invalid", "command_not_found", "os_error"})
# The control channel's security refusals (control/transport.py): the host's setup, not a failed job.
ENVIRONMENT_CODES |= frozenset({"plaintext_refused", "creds_insecure", "creds_expired", "creds_invalid",
                                "creds_unreadable", "nats_tls_failed", "tls_config_invalid"})


def exit_code_for(code: str) -> int:
    """The documented exit code of an error code; any other refusal is a job that failed: 1."""
    if code in USAGE_CODES:
        return EXIT_USAGE
    if code in ENVIRONMENT_CODES:
        return EXIT_ENVIRONMENT
    return EXIT_FAILED
