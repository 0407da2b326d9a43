"""The walkthrough notebook runs top to bottom on the CPU (every cell; any error fails)."""
from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOK = pathlib.Path(__file__).parents[1] / "notebooks" / "walkthrough.ipynb"


def test_walkthrough_executes():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    outputs = "".join(
        o.get("text", "") + str(o.get("data", {}).get("text/markdown", ""))
        for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs
    )
    assert "max relative difference over 4 steps" in outputs
    assert "| glue |" in outputs
    assert "start from the artifact" in outputs and "compiles 0, graph breaks 0" in outputs  # it compiled nothing
