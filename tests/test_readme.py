"""The README's Python example runs as written, on the shipped models."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- python-api:.*?-->\n```python\n(.*?)```\n", text, re.S)
    assert block, "README lost its Python example"
    monkeypatch.chdir(tmp_path)  # the example writes out/merged-vit-digits relative to where it runs
    exec(compile(block.group(1), "README.md (Python API)", "exec"), {})
    assert (tmp_path / "out" / "merged-vit-digits" / "model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "qk" in printed and "'full':" in printed
