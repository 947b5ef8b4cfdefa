"""A command for checking how tests run commands (``python -m
tests.support.exit_probe WHAT``): prints its folder, argv and an environment
variable, then ends as ``WHAT`` says: ``ok``, ``exit-N``, ``raise`` or
``message`` (SystemExit with a string) or ``hang`` (waits forever)."""

import os
import sys
import threading

if __name__ == "__main__":
    print(os.getcwd(), sys.argv[1:], os.environ.get("PROBE_VALUE"))
    print("to stderr", file=sys.stderr)
    what = sys.argv[1]
    if what.startswith("exit-"):
        sys.exit(int(what[5:]))
    if what == "raise":
        raise ValueError("the probe raised")
    if what == "hang":
        threading.Event().wait()
    if what == "message":
        sys.exit("probe: error: said in one line")
