"""The doctor's own figure, ``doctor.png`` (docs/guides/doctor.md).

Runs ``feeder-doctor`` on a generated image folder with a simulated model step
slower than the loader (the model-bound case), for a few seconds, and keeps
the ``doctor.png`` it writes. Seconds on a CPU::

    python docs/figures/doctor.py [OUT_DIR]   # default: docs/figures/

``FEEDER_FIGURE_QUICK=1`` runs the doctor for 2 seconds instead of 8, with a
50 ms step (still the model-bound case) and without its worker-process run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from feeder.synthetic import make_image_folder

NAME = "doctor.png"
# FEEDER_FIGURE_QUICK=1: a short run (the docs tests draw the figure that way).
QUICK = os.environ.get("FEEDER_FIGURE_QUICK") == "1"
# The command, after "feeder-doctor DATA".
ARGS = ["--batch-size", "16", "--transforms", "eval", "-q",
        *(["--step-ms", "50", "--seconds", "2", "--no-process"] if QUICK
          else ["--step-ms", "200", "--seconds", "8"])]


def main(out_dir: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "train")
        make_image_folder(data, classes=2, per_class=64, size_range=(120, 200), seed=1)
        report = os.path.join(tmp, "report")
        proc = subprocess.run([sys.executable, "-m", "feeder.doctor", data, *ARGS, "--out", report],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"feeder-doctor failed:\n{proc.stderr[-3000:]}")
        os.makedirs(out_dir, exist_ok=True)
        return shutil.copyfile(os.path.join(report, NAME), os.path.join(out_dir, NAME))


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))))
