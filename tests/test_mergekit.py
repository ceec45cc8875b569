"""The mergekit hand-off in the README: align onto one anchor, merge with mergekit; runs only with mergekit."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mergekit")

from safetensors.torch import load_file  # noqa: E402

from symgraph.datasets import load_data  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "symgraph" / "data" / "models"


def _readme_route() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- mergekit-route.*?-->\n```bash\n(.*?)```\n<!-- /mergekit-route -->", text, re.S)
    assert block, "README lost its mergekit example"
    return block.group(1)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.mark.slow
def test_readme_route_runs_and_equals_symgraph_merge(tmp_path):
    symgraph = f'symgraph() {{ "{sys.executable}" -m symgraph "$@"; }}\n'  # this interpreter's symgraph
    _run(["bash", "-euc", symgraph + _readme_route().replace("out/", f"{tmp_path}/")])
    merged = tmp_path / "mergekit" / "merged"
    ours = tmp_path / "symgraph-merge"
    done = _run([sys.executable, "-m", "symgraph", "merge", str(MODELS / "llama-chars-a"),
                 str(MODELS / "llama-chars-b"), "--method", "simple", "--frame", "reference", "-o", str(ours), "--json",
                 str(tmp_path / "merge.json"), "--no-progress"])
    assert json.loads((tmp_path / "merge.json").read_text())["consensus"]["reference"] == 1  # llama-chars-b
    assert "aligned onto the reference" in done.stdout and "llama-chars-b" in done.stdout

    theirs, mine = load_file(merged / "model.safetensors"), load_file(ours / "model.safetensors")
    assert set(theirs) == set(mine)
    assert max(float((theirs[k].double() - mine[k].double()).abs().max()) for k in mine) < 1e-5
    # mergekit copied the shipped tokenizer, and it reads the data as the models were trained on it
    shipped, copied = (load_data("pydoc-chars", model=m, limit=4) for m in (MODELS / "llama-chars-a", merged))
    assert torch.equal(shipped.batches[0].inputs["input_ids"], copied.batches[0].inputs["input_ids"])
