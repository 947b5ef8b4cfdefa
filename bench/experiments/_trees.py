"""Run a child script against one source tree of feeder (A/B experiments between
two checkouts): the child's last stdout line is its JSON result, and it must have
imported feeder from that tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_in_tree(tree: str, child: str, argv: list[str], timeout: float) -> dict:
    out = subprocess.run([sys.executable, "-c", child, *argv], env=dict(os.environ, PYTHONPATH=tree),
                         cwd=tree, capture_output=True, text=True, timeout=timeout, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["feeder"].startswith(os.path.abspath(tree)), result["feeder"]
    return result
