"""The docs site builds with no warning, and what it says about the code is generated from the code.

- ``mkdocs build --strict`` (mkdocs.yml: every page in the nav, links and anchors validated) succeeds without a
  single warning;
- docs/configuration.md equals ``omni-serve graph --config-markdown`` (the specs' fields), and every key it lists
  has a description;
- README.md stays a front door (under 200 lines) whose relative links all name files that exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from omni_serve.graph.config_docs import markdown, undocumented
from omni_serve.graph.registry import families

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict_without_warnings(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "configuration.html").is_file() and (tmp_path / "site" / "index.html").is_file()
    # the README's support matrix is included into the home page, not copied
    assert "prefill/decode split" in (tmp_path / "site" / "index.html").read_text()


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []


def test_the_configuration_reference_is_current():
    with open(ROOT / "docs" / "configuration.md") as f:
        assert f.read() == markdown(families()), (
            "docs/configuration.md is stale: omni-serve graph --config-markdown > docs/configuration.md")


def test_every_configuration_key_has_a_description():
    assert undocumented(families()) == []


def test_the_readme_is_a_front_door_with_working_links():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to the docs"
    assert [link for link in links if "://" not in link and not (ROOT / link).exists()] == []
    for command in ("make run    # serve the default Omni graph at http://127.0.0.1:8000",
                    "make test   # run the whole test suite"):
        assert command in text
