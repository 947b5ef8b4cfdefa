"""MkDocs hooks of the documentation site.

* ``on_files``: serve the repository's bench/results/ files, its folders' too, in
  the site. The measured figures live once, in bench/results/ (text reports, CSV,
  plots, summary JSON); adding those files to the build under ``bench-results/``
  lets every page link the report it quotes, with the strict build checking that
  the file exists, instead of copying the numbers into the docs.
* ``on_page_content``: the code's docstrings cross-reference in Sphinx's roles
  (``:class:`~feeder.ImageFolder```), which Markdown renders as literal text.
  Each becomes a cross-reference for mkdocs-autorefs, marked optional: a link
  where the target is on a page of the site, plain code otherwise (a private
  module, a name relative to its class).
"""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File, Files

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results")
KINDS = (".txt", ".csv", ".json", ".png")
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([\w.]+?)(\(\))?</code>")


def on_files(files: Files, config) -> Files:
    for folder, dirs, names in os.walk(RESULTS):
        dirs.sort()
        relative = os.path.relpath(folder, RESULTS).replace(os.sep, "/")
        prefix = "" if relative == "." else relative + "/"
        for name in sorted(names):
            if name.endswith(KINDS):
                files.append(File.generated(config, f"bench-results/{prefix}{name}",
                                            abs_src_path=os.path.join(folder, name)))
    return files


def _autoref(match: re.Match) -> str:
    short, name, call = match.groups()
    title = (name.rsplit(".", 1)[-1] if short else name) + (call or "")
    return f'<autoref identifier="{name}" optional><code>{title}</code></autoref>'


def on_page_content(html: str, page, config, files) -> str:
    return ROLE.sub(_autoref, html)
