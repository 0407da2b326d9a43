"""docs/results.md: the latest measured tables, one section per command and setting, each written
by the command that measured it (`--results PATH` on `fuse bench`, `fuse report` and
`python -m kernels.bench`). A section sits between `<!-- results: KEY -->` and `<!-- /results -->`;
writing one replaces that section and leaves the others.

Other files (README.md) may quote a section inside the same markers;
`python -m kernels.bench.results README.md` copies the current sections into them, and a test
checks they agree."""
from __future__ import annotations

import datetime
import pathlib
import re
import sys

import torch

from kernels.triton_util import triton_version

END = "<!-- /results -->"


def _begin(key: str) -> str:
    return f"<!-- results: {key} -->"


def _block(key: str) -> re.Pattern:
    return re.compile(re.escape(_begin(key)) + r"\n(.*?)\n?" + re.escape(END), re.S)


def machine() -> str:
    """The machine and versions a measurement ran on, for the section's header line."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    return f"{device}, torch {torch.__version__}, triton {triton_version() or '-'}, {datetime.date.today().isoformat()}"


def read_section(path: str | pathlib.Path, key: str) -> str | None:
    path = pathlib.Path(path)
    if not path.exists():
        return None
    found = _block(key).search(path.read_text())
    return found.group(1).strip("\n") if found else None


def keys(text: str) -> list[str]:
    return re.findall(r"<!-- results: (.+?) -->", text)


def write_section(path: str | pathlib.Path, key: str, markdown: str) -> None:
    """Replace section `key` of `path` by `markdown` (appended if the file has none)."""
    path = pathlib.Path(path)
    text = path.read_text() if path.exists() else "# Results\n"
    block = f"{_begin(key)}\n{markdown.strip()}\n{END}"
    if _block(key).search(text):
        text = _block(key).sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def copy_sections(source: str | pathlib.Path, target: str | pathlib.Path) -> list[str]:
    """Copy into `target` every section it quotes from `source`; returns the keys copied."""
    target = pathlib.Path(target)
    copied = []
    for key in keys(target.read_text()):
        section = read_section(source, key)
        if section is not None:
            write_section(target, key, section)
            copied.append(key)
    return copied


if __name__ == "__main__":
    source = pathlib.Path(__file__).parents[2] / "docs" / "results.md"
    for name in sys.argv[1:]:
        print(f"{name}: copied {copy_sections(source, name) or 'nothing'} from {source}")
