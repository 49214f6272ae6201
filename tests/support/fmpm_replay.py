#!/usr/bin/env python3
"""A recorded Fabric Manager behind ``fmpm``'s command line: tests copy this file to ``<dir>/fmpm``.

Fabric Manager cannot run without NVSwitches, so the agent's real ``fmpm`` argv (through
``host/run.py``, with its timeout) reaches this replay instead. It answers from recorded
output (``fixtures/fabricmanager/``, in the format fmpm prints: jsoncpp's StyledWriter for
``-l``, ``Failed to ... fmReturn: -N`` on stdout and the negative fmReturn_t as exit status)
and keeps FM's one piece of state, which partitions are active, in ``<dir>/state.json``:

    {"list": "<recorded fmpm -l file>", "active": [3], "calls": [...],
     "answers": {"-a 4": ["Failed to activate partition. fmReturn: -7\\n", 249]},
     "hang": ["-a 5"],              # never answers (the agent's timeout must end it)
     "restart_after": ["-a 3"],     # FM restarts right after answering: every partition inactive
     "ignore_set_activated": true}  # --set-activated-list answers 0 and changes nothing (fmpm 1.0.1's bug)
"""

import json
import sys
import time
from pathlib import Path

STATE = Path(__file__).resolve().parent / "state.json"


def styled(value, indent=""):
    """jsoncpp StyledWriter: 3-space indent, ``"key" : value``, keys sorted, one member a line."""
    inner = indent + "   "
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f'{inner}"{k}" : {styled(value[k], inner)}' for k in sorted(value)]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        if all(not isinstance(v, (dict, list)) for v in value):
            return "[ " + ", ".join(styled(v) for v in value) + " ]"
        return "[\n" + ",\n".join(inner + styled(v, inner) for v in value) + "\n" + indent + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def main(argv):
    state = json.loads(STATE.read_text())
    args = list(argv)
    for option in ("--hostname", "--unix-domain-socket"):  # connection options and their values: not the command
        if option in args:
            del args[args.index(option):args.index(option) + 2]
    key = " ".join(args[:2])
    state.setdefault("calls", []).append(argv)
    STATE.write_text(json.dumps(state))
    if key in state.get("hang", []):
        while True:
            time.sleep(3600)
    if key in state.get("answers", {}):
        out, rc = state["answers"][key]
        sys.stdout.write(out)
        return rc
    if args[:1] == ["-l"]:
        doc = json.loads(Path(state["list"]).read_text())
        for info in doc["partitionInfo"]:
            info["isActive"] = 1 if info["partitionId"] in state["active"] else 0
        sys.stdout.write(styled(doc) + "\n")
        return 0
    if args[:1] in (["-a"], ["-d"]):
        pid = int(args[1])
        active = set(state["active"])
        active = active | {pid} if args[0] == "-a" else active - {pid}
        state["active"] = sorted(active)
        if key in state.get("restart_after", []):
            state["active"] = []
        STATE.write_text(json.dumps(state))
        return 0
    if args[:1] == ["--set-activated-list"]:
        if not state.get("ignore_set_activated"):
            state["active"] = sorted({int(x) for x in args[1].split(",") if x})
            STATE.write_text(json.dumps(state))
        return 0
    sys.stdout.write("Invalid argument.\n")
    return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
