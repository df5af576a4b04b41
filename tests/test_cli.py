"""The ``linearize`` command line: the main job on a small model, generate, and every bad input."""

from __future__ import annotations

import json
import os

from conftest import run_and_kill_when
from typer.testing import CliRunner

from linearize.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(map(str, args)))
    return result.exit_code, result.output


def assert_one_line_error(code, output, needle):
    assert code == 2, output
    err = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and needle in err[0], output
    assert "Traceback" not in output


def test_cli_version():
    code, out = run("--version")
    assert code == 0 and out.startswith("linearize ")


def test_cli_convert_and_generate(tiny_dir, tmp_path):
    out = tmp_path / "gdn"
    code, text = run("convert", "--model", tiny_dir, "--output", out, "--tokens", 64, "--calibration-tokens", 64,
                     "--keep-softmax", "1")
    assert code == 0, text
    assert "held-out perplexity" in text and "stable" in text
    report = json.loads((out / "fidelity.json").read_text())
    assert [r["block"] for r in report["layers"]].count("softmax") == 1
    assert (out / "fidelity.png").stat().st_size > 0 and (out / "config.json").is_file()
    code, text = run("generate", "--model", out, "-n", 5, "Hello")
    assert code == 0, text
    assert "tokens/s (eager)" in text
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n\nThe quick brown fox\nOnce\n")
    code, text = run("generate", "--model", out, "-n", 4, "--batch-file", prompts, "--temperature", 0.8, "--top-k", 5,
                     "--seed", 1)
    assert code == 0, text
    assert "--- 1" in text and "--- 3" in text and "--- 4" not in text and "3 prompt(s)" in text
    _, again = run("generate", "--model", out, "-n", 4, "--batch-file", prompts, "--temperature", 0.8, "--top-k", 5,
                   "--seed", 1)
    texts = lambda out: out[out.index("--- 1"):].splitlines()[:-1]  # noqa: E731 (the last line: timings)
    assert texts(again) == texts(text)  # same seed, same text
    code, text = run("generate", "--model", out, "-n", 5, "--rope-scaling", "yarn:4:16", "Hello")  # the kept layer
    assert code == 0, text
    assert_one_line_error(*run("generate", "--model", out, "--rope-scaling", "yarn", "Hello"), "KIND:FACTOR")


def test_cli_convert_to_deltanet_and_generate(tiny_dir, tmp_path):
    out = tmp_path / "delta"
    code, text = run("convert", "--model", tiny_dir, "--output", out, "--to", "deltanet", "--tokens", 64,
                     "--calibration-tokens", 64)
    assert code == 0, text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["linearize"]["options"]["target"] == "deltanet"
    assert json.loads((out / "fidelity.json").read_text())["options"]["target"] == "deltanet"
    code, text = run("generate", "--model", out, "-n", 4, "Hello")
    assert code == 0, text


def test_cli_convert_missing_path(tmp_path):
    assert_one_line_error(*run("convert", "--model", tmp_path / "nope", "-o", tmp_path / "o"), "not found")


def test_cli_convert_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*run("convert", "--model", tmp_path / "empty", "-o", tmp_path / "o"), "not a model directory")


def test_cli_convert_truncated_weights(tiny_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 3])
    assert_one_line_error(*run("convert", "--model", bad, "-o", tmp_path / "o"), "truncated")
    assert not (tmp_path / "o").exists()


def test_cli_convert_unsupported_architecture(tmp_path, smollm2):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(smollm2[1]))).save_pretrained(d)
    smollm2[1].save_pretrained(d)
    assert_one_line_error(*run("convert", "--model", d, "-o", tmp_path / "o"), "supported: llama, mistral")


def test_cli_convert_bad_target(tmp_path):
    assert_one_line_error(*run("convert", "--to", "mamba", "-o", tmp_path / "o"), "supported targets: gdn")


def test_cli_convert_layer_out_of_range(tiny_dir, tmp_path):
    assert_one_line_error(*run("convert", "--model", tiny_dir, "-o", tmp_path / "o", "--layers", "0-7"), "out of range")
    assert not (tmp_path / "o").exists()


def test_cli_convert_refuses_existing_output_unless_force(tiny_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(*run("convert", "--model", tiny_dir, "-o", out), "--force")
    assert (out / "keep.txt").read_text() == "mine"
    code, text = run("convert", "--model", tiny_dir, "-o", out, "--force", "--tokens", 32, "--calibration-tokens", 32)
    assert code == 0, text
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_cli_convert_unwritable_output(tiny_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the parent directory should be
    assert_one_line_error(*run("convert", "--model", tiny_dir, "-o", blocker / "o"), "cannot write")


def test_save_killed_halfway_leaves_no_output(tmp_path):
    """SIGKILL while the model is being written: the output directory never appears."""
    out, flag = tmp_path / "out", tmp_path / "writing"
    script = f"""
import time, torch, linearize, sys
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from conftest import tiny_model
m = linearize.convert(tiny_model("llama"), calibration_ids=torch.ones(1, 16, dtype=torch.long))
def slow(folder):
    open({str(flag)!r}, "w").close()
    time.sleep(60)
linearize.save(m, None, {str(out)!r}, extra=slow)
"""
    run_and_kill_when(script, flag)
    assert not out.exists()
