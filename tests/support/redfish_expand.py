"""sushy-static that also answers DMTF DSP0266 ``$expand=.($levels=N)`` from the documents it holds.

Run as a script in place of sushy-static (``RedfishServer(..., expand=True)``), same arguments. A GET with
``?$expand=.($levels=N)`` answers the held document with every subordinate reference (a ``{"@odata.id": ...}``
object outside a ``Links`` object, DSP0266 §7.3: ``.`` is "subordinate links, not Links") replaced by the
held document it names, recursively for N levels. A reference to a document it does not hold, or that is not
a ``/redfish/v1`` path of this server, stays a reference, as a service leaves what it cannot expand. Any other
query is a 400; a path it does not hold a 404, as sushy-static answers it. Every request is logged as
sushy-static logs it (headers on stdout, the request line on stderr).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any
from urllib.parse import unquote

from sushy_tools.static import main as static

ROOT = "/redfish/v1"
EXPAND = re.compile(r"^\$expand=\.\(\$levels=([1-9])\)$")
MAX_LEVELS = 5  # what the captured DGX H100 service root advertises (ExpandQuery.MaxLevels)


def _held(link: str) -> Any:
    path = link.rstrip("/")
    if not path.startswith(ROOT) or ".." in path:
        return None
    fpath = os.path.join(str(static.REDFISH_MOCKUP_FILES), path[len(ROOT):].lstrip("/"), "index.json")
    if not os.path.isfile(fpath):
        return None
    with open(fpath) as f:
        return json.load(f)


def _expand(node: Any, levels: int, in_links: bool = False) -> Any:
    if isinstance(node, list):
        return [_expand(v, levels, in_links) for v in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"@odata.id"} and isinstance(node["@odata.id"], str):
        if in_links or levels <= 0:
            return node
        doc = _held(node["@odata.id"])
        return node if doc is None else _expand(doc, levels - 1)
    return {k: _expand(v, levels, in_links or k == "Links") for k, v in node.items()}


class ExpandingHandler(static.RequestHandler):
    def do_GET(self) -> None:
        if "?" not in self.path:
            super().do_GET()
            return
        self._log_request("GET")
        path, query = self.path.split("?", 1)
        match = EXPAND.match(unquote(query))
        if match is None or int(match.group(1)) > MAX_LEVELS:
            self.send_error(400, f"query {query[:100]!r} is not supported")
            return
        doc = _held(path)
        if doc is None:
            self.send_error(404, f"Sub-URI {path} not found")
            return
        body = json.dumps(_expand(doc, int(match.group(1)))).encode()
        self.send_response(200)
        self.send_header("Content-type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    static.RequestHandler = ExpandingHandler  # type: ignore[misc]  # main() builds its server with this name
    sys.exit(static.main())
