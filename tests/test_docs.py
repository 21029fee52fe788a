"""The docs stay navigable: every nav entry exists and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _nav_files(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    return []


def test_every_nav_entry_exists_and_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    for name in nav:
        assert (ROOT / "docs" / name).is_file(), name
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(nav), f"pages missing from the nav: {sorted(pages - set(nav))}"


def test_relative_links_resolve() -> None:
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name}: dead link {target}"


# Docs describe the product as it is; how it got there is in git log. These catch the two
# shapes a lab notebook takes: dated entries and numbered sessions or rounds of work.
NARRATION = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?:session|round) \d+\b|\b(?:this|last|previous) session\b", re.I)


def _narration(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if NARRATION.search(line)
    ]


def test_docs_readme_and_package_hold_no_dated_entries_nor_numbered_sessions() -> None:
    files = [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "zmq_omni").rglob("*.py"),
    ]
    found = [hit for path in files for hit in _narration(path)]
    assert found == [], "\n".join(found)


def test_the_benchmarks_page_is_a_reference_page() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) < 250
    # Every grid's figures come with the command that reproduces them.
    for command in ("zmq-omni bench", *(f"python benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py"))):
        assert command in page, command
