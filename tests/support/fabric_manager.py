"""A Fabric Manager for tests: the real ``fmpm`` argv and timeout against recorded answers (fmpm_replay.py).

``recorded_fm(tmp_path, **state)`` copies the replay next to its state file and returns the agent's
:class:`FabricManager` pointed at it, and a :class:`ReplayState` to read or change FM's side
(which partitions are active, which answers fail, what was called).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gpuaas_agent.host.devices.fabricmanager import FabricManager

REPO = Path(__file__).resolve().parent.parent.parent
FIXTURES = REPO / "fixtures" / "fabricmanager"
LIST = FIXTURES / "hgx-8gpu-xe9680.fmpm-l.json"
REPLAY = Path(__file__).resolve().parent / "fmpm_replay.py"
# GPU i (1-based physical id) of the fixture board: the synthetic XE9680 host's GPUs in bus order.
GPUS = ("0000:18:00.0", "0000:3a:00.0", "0000:4b:00.0", "0000:5c:00.0",
        "0000:9a:00.0", "0000:aa:00.0", "0000:ba:00.0", "0000:da:00.0")


def recorded_answer(name: str, returncode: int) -> list:
    """A recorded failure (``fixtures/fabricmanager/<name>``) as the replay's [stdout, exit status]."""
    return [(FIXTURES / name).read_text(), returncode]


@dataclass
class ReplayState:
    path: Path

    def read(self) -> dict:
        return json.loads(self.path.read_text())

    def update(self, **changes) -> None:
        self.path.write_text(json.dumps({**self.read(), **changes}))

    @property
    def active(self) -> list[int]:
        return self.read()["active"]

    @property
    def calls(self) -> list[list[str]]:
        return self.read().get("calls", [])


def recorded_fm(tmp_path: Path, *, timeout_s: float = 10.0, list_file: Path = LIST,
                **state) -> tuple[FabricManager, ReplayState]:
    where = tmp_path / "fm"
    where.mkdir(exist_ok=True)
    fmpm = where / "fmpm"
    # The test's own interpreter runs it (no PATH lookup, no shim in between).
    fmpm.write_text(f"#!{sys.executable}\n" + REPLAY.read_text().split("\n", 1)[1])
    fmpm.chmod(0o755)
    replay = ReplayState(where / "state.json")
    replay.path.write_text(json.dumps({"list": str(list_file), "active": [], **state}))
    return FabricManager(fmpm=str(fmpm), timeout_s=timeout_s), replay
