"""docs/results.md sections: written by the measuring commands, quoted elsewhere only as copies."""
from __future__ import annotations

import pathlib

from kernels.bench.results import copy_sections, keys, read_section, write_section

ROOT = pathlib.Path(__file__).parents[1]


def test_a_section_is_replaced_and_the_others_kept(tmp_path):
    path = tmp_path / "results.md"
    write_section(path, "a", "| x |\n|---|\n| 1 |")
    write_section(path, "b", "second")
    write_section(path, "a", "| x |\n|---|\n| 2 |")
    assert read_section(path, "a") == "| x |\n|---|\n| 2 |"
    assert read_section(path, "b") == "second"
    assert keys(path.read_text()) == ["a", "b"]
    assert read_section(path, "c") is None


def test_quotes_are_copied_from_the_results(tmp_path):
    results, readme = tmp_path / "results.md", tmp_path / "README.md"
    write_section(results, "bench", "new table")
    readme.write_text("intro\n<!-- results: bench -->\nold table\n<!-- /results -->\noutro\n")
    assert copy_sections(results, readme) == ["bench"]
    assert readme.read_text() == "intro\n<!-- results: bench -->\nnew table\n<!-- /results -->\noutro\n"


def test_the_readme_and_notebook_quote_the_results_as_they_stand():
    """Numbers in README.md and the walkthrough are copies of docs/results.md's sections
    (`python -m kernels.bench.results README.md` refreshes them)."""
    results = ROOT / "docs" / "results.md"
    for quoting in (ROOT / "README.md", ROOT / "notebooks" / "walkthrough.ipynb"):
        text = quoting.read_text()
        for key in keys(text):
            section = read_section(results, key)
            assert section is not None, f"{quoting.name} quotes section {key!r}, which docs/results.md lacks"
            assert read_section(quoting, key) == section, f"{quoting.name}: section {key!r} differs from docs/results.md"
