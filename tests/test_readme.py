"""The README's Python blocks run as written, so they cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    namespace: dict = {"__name__": f"readme_block_{index}"}
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), namespace)
    out = capsys.readouterr().out
    if "print(" in BLOCKS[index]:
        assert out.strip(), "a README block that prints printed nothing"
