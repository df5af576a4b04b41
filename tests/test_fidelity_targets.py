"""Every conversion target side by side (linearize.fidelity, ``linearize fidelity --targets``): each column is
the error of the block ``convert`` builds for that target, measured against the teacher on held-out rows; the
fit moves only the block's own parameters and never the teacher's."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from test_cli import assert_one_line_error, run

from linearize.eval import attention_modules, capture_attention, relative_error
from linearize.fidelity import target_fidelity, target_options
from linearize.layers.options import GDNOptions
from linearize.ops.taylor import vala_attention


def rows_of(seed: int, T: int = 48, B: int = 2) -> torch.Tensor:
    return torch.randint(1, 96, (B, T), generator=torch.Generator().manual_seed(seed))


def sharp_teacher(family: str):
    """A tiny random teacher whose attention is peaked, as a trained model's is: with the random init's small
    q/k every linear form is within 1e-4 of its near-uniform softmax, and nothing would tell them apart."""
    teacher = tiny_model(family)
    with torch.no_grad():
        for layer in attention_modules(teacher):
            layer.q_proj.weight.mul_(6)
            layer.k_proj.weight.mul_(6)
    return teacher


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_targets_at_conversion_equal_their_definitions(family):
    """gdn, deltanet and kda compute the same block at conversion; linear is seed eq. va-la (the VaLA
    initialization), computed here from the teacher's own q/k/v in float64."""
    teacher = sharp_teacher(family).double()
    cal, held = rows_of(0), rows_of(1)
    report = target_fidelity(teacher, cal, held, options=GDNOptions(window=8, sinks=2))
    caps = capture_attention(teacher, held)
    for row in report["layers"]:
        assert row["deltanet"] == pytest.approx(row["gdn"], rel=1e-9)
        assert row["kda"] == pytest.approx(row["gdn"], rel=1e-9)
        attn, cap = attention_modules(teacher)[row["layer"]], caps[row["layer"]]
        from linearize.models.adapters import project_qkv

        q, k, v = project_qkv(attn, cap.hidden_states, cap.position_embeddings)
        vala = vala_attention(q, k, v, scale=float(attn.scaling)).reshape(cap.output.shape)
        assert row["linear"] == pytest.approx(relative_error(vala, cap.output), rel=1e-9)
        assert 0 < row["gdn"] < row["linear"]  # the window block is exact on its first 10 tokens


def test_fit_lowers_the_error_and_leaves_the_teacher_alone():
    teacher = sharp_teacher("llama")
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    cal, held = rows_of(2, T=64), rows_of(3, T=64)
    report = target_fidelity(teacher, cal, held, targets=("gdn", "kda", "linear"), options=GDNOptions(window=8, sinks=2),
                             fit_steps=15, lr=1e-2, hybrid=2)
    caps = capture_attention(teacher, cal)
    for row in report["layers"]:
        cap = caps[row["layer"]]
        for t in ("gdn", "kda", "linear"):
            block = _block(teacher, row["layer"], t, cap)
            with torch.no_grad():
                start = relative_error(block.attention_output(cap.hidden_states, cap.position_embeddings), cap.output)
            # on the rows it was fitted on, the error went down (the best point is kept, so it never rises) ...
            assert row[f"{t}_fit_calibration"] < start - 1e-3  # the fit moved: these teachers are far from any block
            assert row[f"{t}_fit"] > 0  # ... and the held-out figure is measured on other rows
    assert all(row["gdn_fit"] < row["gdn"] for row in report["layers"])  # and here it carries to other rows
    assert set(report["keep_softmax"]) == {"gdn", "kda", "linear"}
    assert all(len(v) == 2 for v in report["keep_softmax"].values())
    for n, p in teacher.named_parameters():
        assert torch.equal(p, before[n]), n


def _block(teacher, layer, target, cap):
    """The block target_fidelity builds for ``layer``, as converted (ρ calibrated on ``cap``)."""
    from linearize.conversion import linearize_layer

    opts = target_options(GDNOptions(window=8, sinks=2), target)
    return linearize_layer(attention_modules(teacher)[layer], opts, cap.hidden_states, cap.position_embeddings)


def test_linear_target_drops_the_window():
    opts = target_options(GDNOptions(window=64, sinks=4, output_gate=True), "linear")
    assert (opts.target, opts.window, opts.sinks, opts.output_gate) == ("linear", 0, 0, True)
    assert target_options(GDNOptions(window=64, sinks=4), "kda").window == 64


def test_cli_fidelity_shows_every_target(tiny_dir, tmp_path):
    out = tmp_path / "f.json"
    code, text = run("fidelity", "-m", tiny_dir, "-t", 32, "--calibration-tokens", 32, "--window", 4,
                     "--targets", "gdn,linear", "--fit-steps", 2, "-o", out)
    assert code == 0, text
    assert "gdn: --keep-softmax 1 keeps layers" in text  # the hybrid choice, per target
    report = json.loads(out.read_text())
    t = report["targets"]
    assert t["names"] == ["gdn", "linear"] and t["fit_steps"] == 2 and t["options"]["window"] == 4
    assert set(t["layers"][0]) == {"layer", "gdn", "gdn_fit", "gdn_fit_calibration", "linear", "linear_fit",
                                   "linear_fit_calibration"}
    assert len(t["layers"]) == len(report["layers"]) == 3


@pytest.mark.parametrize("args, needle", [
    (["--targets", "gdn,mamba"], "--targets 'mamba' is not supported"),
    (["--fit-steps", "-1"], "--fit-steps"),
    (["--window", "-2"], "--window"),
])
def test_cli_fidelity_bad_target_options(tiny_dir, tmp_path, args, needle):
    code, text = run("fidelity", "-m", tiny_dir, "-t", 32, *args)
    assert_one_line_error(code, text, needle)
