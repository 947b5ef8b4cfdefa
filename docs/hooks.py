"""MkDocs hook: serve the repository's bench/results/ files in the site.

The measured figures live once, in bench/results/ (text reports, CSV, plots,
summary JSON). Adding those files to the build under ``bench-results/`` lets
every page link the report it quotes, with the strict build checking that
the file exists, instead of copying the numbers into the docs.
"""

from __future__ import annotations

import os

from mkdocs.structure.files import File, Files

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results")
KINDS = (".txt", ".csv", ".json", ".png")


def on_files(files: Files, config) -> Files:
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith(KINDS):
            files.append(File.generated(config, f"bench-results/{name}",
                                        abs_src_path=os.path.join(RESULTS, name)))
    return files
