"""Bad input to every command: one line naming the problem and the fix, exit code 2, no traceback,
nothing left behind, and all of it before a model loads. Plus the outputs (atomic, no stray folders,
the umask's modes), custom model code, Ctrl-C and the help screen.

The models here are tiny and random, with a small byte-level BPE tokenizer trained in the fixture:
no real teacher is loaded, so the table runs in seconds.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from typer.testing import CliRunner

from linearize.cli import app

ROOT = Path(__file__).resolve().parents[1]
EVIL = """
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("custom code ran")
from transformers import LlamaConfig, LlamaForCausalLM
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


def _tokenizer():
    from conftest import tiny_tokenizer

    return tiny_tokenizer(320, 20)


def _cut(src: Path, dst: Path, name: str = "model.safetensors") -> Path:
    shutil.copytree(src, dst)
    w = dst / name
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 3])
    return dst


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Every input the table names, built once: good and broken models, data files, a recipe."""
    import linearize

    base = tmp_path_factory.mktemp("inputs")
    tok = _tokenizer()
    p = {"base": base}
    p["tiny"] = base / "tiny"  # 3 layers, 512 positions
    teacher = tiny_model("llama", vocab_size=len(tok), num_hidden_layers=3)
    teacher.save_pretrained(p["tiny"])
    tok.save_pretrained(p["tiny"])
    p["conv"] = base / "converted"
    student = linearize.convert(tiny_model("llama", vocab_size=len(tok), num_hidden_layers=3),
                                calibration_ids=torch.arange(32).view(1, 32))
    linearize.save(student, tok, p["conv"])
    p["cut"] = _cut(p["tiny"], base / "cut")
    p["cut_conv"] = _cut(p["conv"], base / "cut-converted")
    for name, edit in (("bad_json", lambda d: (d / "config.json").write_text("{not json")),
                       ("no_weights", lambda d: (d / "model.safetensors").unlink()),
                       ("tok_remote", lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
                           {**json.loads((d / "tokenizer_config.json").read_text()),
                            "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}})))):
        p[name] = base / name
        shutil.copytree(p["tiny"], p[name])
        edit(p[name])
    p["remote"] = base / "remote"  # custom code that leaves a file behind if it ever runs
    shutil.copytree(p["tiny"], p["remote"])
    cfg = json.loads((p["remote"] / "config.json").read_text())
    cfg.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (p["remote"] / "config.json").write_text(json.dumps(cfg))
    (p["remote"] / "evil.py").write_text(EVIL)
    from transformers import GPT2Config, GPT2LMHeadModel

    p["gpt2"] = base / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok))).save_pretrained(p["gpt2"])
    p["cut_gguf"] = base / "cut.gguf"  # a GGUF header that stops after its counts
    p["cut_gguf"].write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 201, 24)[:12])
    p["junk_gguf"] = base / "junk.gguf"
    p["junk_gguf"].write_bytes(os.urandom(4096))
    p["empty"] = base / "empty-dir"
    p["empty"].mkdir()
    p["file"] = base / "a-file.txt"
    p["file"].write_text("not a folder\n")
    p["existing"] = base / "existing-out"
    p["existing"].mkdir()
    (p["existing"] / "keep.txt").write_text("mine")
    data = base / "data"
    data.mkdir()
    (data / "empty.jsonl").write_bytes(b"")
    (data / "binary.txt").write_bytes(bytes(range(256)) * 16)
    (data / "garbage.jsonl").write_text("this is not json\n{{{\n")
    (data / "notext.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    (data / "ok.jsonl").write_text('{"text": "hello there"}\n{"text": "general kenobi"}\n')
    (data / "bad.parquet").write_bytes(b"PAR1" + os.urandom(64))
    (data / "fake.parquet").write_text("just text\n")
    p["data"] = data
    p["recipe"] = base / "recipe.yaml"
    p["recipe"].write_text(
        f"teacher:\n  model: {p['tiny']}\ndata:\n  source: builtin\n  seq_len: 32\n  eval_tokens: 64\n"
        f"stages:\n  - name: align\n    steps: 2\n    batch_size: 2\noutput:\n  dir: run\n")
    p["bad_yaml"] = base / "bad.yaml"
    p["bad_yaml"].write_text("teacher: [unclosed\n  model: x: y\n")
    return p


# (id, command line with {placeholders} from `inputs`, regex the one error line must match)
CONVERT = [
    ("missing-model", "convert -m {base}/nope -o out", r"not found"),
    ("dir-not-a-model", "convert -m {empty} -o out", r"not a model directory"),
    ("file-not-gguf", "convert -m {file} -o out", r"is a file but not a \.gguf"),
    ("truncated-safetensors", "convert -m {cut} -o out", r"truncated.*complete"),
    ("truncated-safetensors-deep-output", "convert -m {cut} -o deep/er/out", r"truncated"),
    ("truncated-gguf", "convert -m {cut_gguf} -o out", r"cannot read .*cut\.gguf as GGUF.*complete"),
    ("junk-gguf", "convert -m {junk_gguf} -o out", r"as GGUF"),
    ("config-not-json", "convert -m {bad_json} -o out", r"config\.json is not valid JSON"),
    ("no-weights", "convert -m {no_weights} -o out", r"holds no weights"),
    ("auto-map-config", "convert -m {remote} -o out", r"auto_map.*runs no code"),
    ("auto-map-tokenizer", "convert -m {tok_remote} -o out", r"tokenizer_config\.json has auto_map"),
    ("already-converted", "convert -m {conv} -o out", r"already converted \(linearize_llama\)"),
    ("unsupported-family", "convert -m {gpt2} -o out", r"'gpt2' is not supported; supported: llama"),
    ("target", "convert -m {tiny} -o out --to mamba", r"supported targets: gdn"),
    ("form-old-name", "convert -m {tiny} -o out --form taylor-seed", r"--form must be one of 'stable', 'seed'"),
    ("form-unknown", "convert -m {tiny} -o out --form fast", r"--form must be one of"),
    ("window-negative", "convert -m {tiny} -o out --window -3", r"--window must be a whole number of tokens"),
    ("sinks-without-window", "convert -m {tiny} -o out --window 0 --sinks 2", r"--sinks=2 needs a window"),
    ("beta-max-zero", "convert -m {tiny} -o out --beta-max 0", r"--beta-max must be a finite number > 0"),
    ("beta-max-negative", "convert -m {tiny} -o out --beta-max -1", r"--beta-max must be a finite number > 0"),
    ("beta-max-nan", "convert -m {tiny} -o out --beta-max nan", r"--beta-max .*got nan"),
    ("beta-max-inf", "convert -m {tiny} -o out --beta-max inf", r"--beta-max .*got inf"),
    ("beta-max-text", "convert -m {tiny} -o out --beta-max big", r"Invalid value for '--beta-max'.*--help"),
    ("tokens-one", "convert -m {tiny} -o out --tokens 1", r"--tokens must be at least 2"),
    ("tokens-too-many", "convert -m {tiny} -o out --tokens 100000000", r"--tokens .*has about \d+ tokens"),
    ("tokens-text", "convert -m {tiny} -o out --tokens many", r"Invalid value for '--tokens'"),
    ("calibration-zero", "convert -m {tiny} -o out --calibration-tokens 0", r"--calibration-tokens must be at least 1"),
    ("calibration-too-many", "convert -m {tiny} -o out --calibration-tokens 100000000", r"built-in train text"),
    ("layers-reversed", "convert -m {tiny} -o out --layers 1-0", r"--layers: the range '1-0' is empty.*0-1"),
    ("layers-out-of-range", "convert -m {tiny} -o out --layers 0-99", r"layer 3 is out of range; .* 0-2"),
    ("layers-open-out-of-range", "convert -m {tiny} -o out --layers 3-", r"layer 3 is out of range"),
    ("layers-single-out-of-range", "convert -m {tiny} -o out --layers 7", r"layer 7 is out of range"),
    ("layers-garbage", "convert -m {tiny} -o out --layers abc", r"--layers: cannot read 'abc'"),
    ("layers-negative", "convert -m {tiny} -o out --layers=-1", r"--layers: cannot read '-1'"),
    ("layers-empty", "convert -m {tiny} -o out --layers ,", r"--layers ',' names no layer"),
    ("keep-softmax-garbage", "convert -m {tiny} -o out --keep-softmax abc", r"--keep-softmax: cannot read 'abc'"),
    ("keep-softmax-out-of-range", "convert -m {tiny} -o out --keep-softmax 5,", r"--keep-softmax: layer 5 is out"),
    ("keep-softmax-count-all", "convert -m {tiny} -o out --keep-softmax 3", r"nothing would be converted"),
    ("keep-softmax-rule", "convert -m {tiny} -o out --keep-softmax 2:best", r"the rule after ':' must be one of error"),
    ("keep-softmax-all-allowed", "convert -m {tiny} -o out --layers 0-1 --keep-softmax 0,1", r"nothing would be"),
    ("keep-softmax-count-vs-layers", "convert -m {tiny} -o out --layers 1- --keep-softmax 2", r"nothing would be"),
    ("output-cwd", "convert -m {tiny} -o .", r"--output \. is the working directory"),
    ("output-cwd-force", "convert -m {tiny} -o . --force", r"working directory or one of its parents"),
    ("output-parent-force", "convert -m {tiny} -o .. --force", r"working directory or one of its parents"),
    ("output-is-file", "convert -m {tiny} -o {file}", r"is an existing file, not a folder"),
    ("output-is-file-force", "convert -m {tiny} -o {file} --force", r"is an existing file"),
    ("output-exists", "convert -m {tiny} -o {existing}", r"exists; pass --force"),
    ("output-under-a-file", "convert -m {tiny} -o {file}/out", r"cannot write into"),
    ("unknown-option", "convert -m {tiny} -o out --forc", r"No such option: --forc.*--force"),
]
FIDELITY = [
    ("already-converted", "fidelity -m {conv}", r"already converted.*fidelity needs the softmax teacher"),
    ("truncated-safetensors", "fidelity -m {cut}", r"truncated"),
    ("truncated-gguf", "fidelity -m {cut_gguf}", r"as GGUF"),
    ("auto-map", "fidelity -m {remote}", r"auto_map"),
    ("missing-model", "fidelity -m ./nope/none", r"model path not found"),
    ("tokens-one", "fidelity -m {tiny} -t 1", r"--tokens must be at least 2"),
    ("tokens-too-many", "fidelity -m {tiny} -t 100000000", r"built-in heldout text"),
    ("output-is-dir", "fidelity -m {tiny} -o {existing}", r"--output .* is a folder"),
    ("output-parent-missing", "fidelity -m {tiny} -o {base}/nope/f.json", r"cannot write into"),
]
GENERATE = [
    ("empty-prompt", "generate -m {conv} ''", r"the prompt is empty"),
    ("blank-prompt", "generate -m {conv} '   '", r"the prompt is empty"),
    ("no-prompt", "generate -m {conv}", r"no prompt; give text to continue .* or --batch-file"),
    ("prompt-and-batch-file", "generate -m {conv} hi --batch-file {data}/ok.jsonl", r"not both"),
    ("batch-file-missing", "generate -m {conv} --batch-file {base}/nope.txt", r"--batch-file .* is not a file"),
    ("batch-file-empty", "generate -m {conv} --batch-file {data}/empty.jsonl", r"has no prompt"),
    ("batch-file-binary", "generate -m {conv} --batch-file {data}/binary.txt", r"is not UTF-8 text"),
    ("temperature-negative", "generate -m {conv} --temperature -1 hi", r"--temperature must be 0 \(greedy\) or more"),
    ("top-p-zero", "generate -m {conv} --temperature 1 --top-p 0 hi", r"--top-p must be in \(0, 1\]"),
    ("top-k-negative", "generate -m {conv} --temperature 1 --top-k -2 hi", r"--top-k must be 0 \(off\) or more"),
    ("device-unknown", "generate -m {conv} --device tpu hi", r"--device must be cuda or cpu"),
    ("max-new-tokens-zero", "generate -m {conv} -n 0 hi", r"--max-new-tokens must be at least 1"),
    ("not-a-model-dir", "generate -m {empty} hi", r"not a converted model directory"),
    ("missing-dir", "generate -m {base}/nope hi", r"not a converted model directory"),
    ("truncated-safetensors", "generate -m {cut_conv} hi", r"truncated"),
    ("auto-map", "generate -m {remote} hi", r"auto_map"),
    ("config-not-json", "generate -m {bad_json} hi", r"not valid JSON"),
]
DISTILL_FIELDS = [  # key=value override on the base recipe -> regex
    ("stages.0.lr=0", r"stages\.0\.lr must be a finite number > 0"),
    ("stages.0.lr=-1e-3", r"stages\.0\.lr must be"),
    ("stages.0.lr=nan", r"stages\.0\.lr .*got nan"),
    ("stages.0.lr=inf", r"stages\.0\.lr .*got inf"),
    ("stages.0.lr=fast", r"stages\[0\]\.lr.*could not be converted"),
    ("data.heldout_fraction=0", r"data\.heldout_fraction must be between 0 and 1"),
    ("data.heldout_fraction=1", r"data\.heldout_fraction must be between 0 and 1"),
    ("output.eval_every=0", r"output\.eval_every must be at least 1"),
    ("output.log_every=0", r"output\.log_every must be at least 1"),
    ("output.checkpoint_every=0", r"output\.checkpoint_every must be at least 1"),
    ("output.keep_last=0", r"output\.keep_last must be at least 1"),
    ("stages.0.kl_chunk=0", r"stages\.0\.kl_chunk must be at least 1"),
    ("stages.0.temperature=0", r"stages\.0\.temperature must be a finite number > 0"),
    ("stages.0.ce_weight=-1", r"stages\.0\.ce_weight must be a finite number >= 0"),
    ("optim.weight_decay=-0.1", r"optim\.weight_decay must be"),
    ("optim.warmup_steps=-1", r"optim\.warmup_steps must be >= 0"),
    ("optim.grad_clip=-1", r"optim\.grad_clip must be"),
    ("convert.calibration_tokens=0", r"convert\.calibration_tokens must be at least 1"),
    ("data.eval_tokens=0", r"data\.eval_tokens must be at least 1"),
    ("data.seq_len=1", r"data\.seq_len must be at least 2"),
    ("data.seq_len=100000", r"data\.seq_len 100000 exceeds the teacher's 512 positions"),
    ("data.max_documents=0", r"data\.max_documents must be at least 1"),
    ("convert.beta_max=0", r"convert\.beta_max must be a finite number > 0"),
    ("convert.form=taylor-seed", r"convert\.form must be 'stable' or 'seed'"),
    ("convert.window=-8", r"convert\.window must be 0 \(off\) or a number of tokens"),
    ("convert.sinks=4", r"convert\.sinks must be 0, or a number of tokens with a convert\.window"),
    ("convert.keep_softmax=abc", r"convert\.keep_softmax: cannot read 'abc'"),
    ("convert.keep_softmax=3", r"convert\.keep_softmax 3 keeps every one of the 3 layers"),
    ("convert.layers=1-0", r"convert\.layers: the range '1-0' is empty"),
    ("convert.layers=0-99", r"convert\.layers: layer 3 is out of range"),
    ("'stages.0.layer_weights={{7: 1.0}}'", r"stages\.0\.layer_weights: layer 7 is out of range"),
    ("'stages.0.layer_weights={{1: -2.0}}'", r"stages\.0\.layer_weights must be finite and >= 0"),
    ("stages.0.lora_rank=-1", r"stages\.0\.lora_rank must be >= 0"),
    ("stages.0.trainable=lora_", r"trainable names lora_ but no stage has lora_rank > 0"),
    ("stages.0.steps=0", r"stages\.0\.steps must be at least 1"),
    ("stages.0.batch_size=0", r"stages\.0\.batch_size must be at least 1"),
    ("stages.0.name=train", r"stages\.0\.name must be 'align' or 'distill'"),
    ("stages.0.loss=l1", r"stages\.0\.loss must be 'mse' or 'nmse'"),
    ("precision=fp8", r"precision must be 'fp32' or 'bf16'"),
    ("device=tpu", r"device must be"),
    ("parallel=tp", r"parallel must be 'ddp' or 'fsdp'"),
    ("seed=-1", r"seed must be >= 0"),
    ("stages.0.lrr=1", r"unknown recipe key 'stages\.0\.lrr'; did you mean 'stages\.0\.lr'"),
    ("data.source={data}/empty.jsonl", r"data\.source: .*empty\.jsonl is empty"),
    ("data.source={data}/binary.txt", r"data\.source: .*binary\.txt is binary"),
    ("data.source={data}/garbage.jsonl", r"data\.source: cannot read .*garbage\.jsonl as json"),
    ("data.source={data}/notext.jsonl", r"'text'.*data\.text_field"),
    ("data.source={data}/ok.jsonl data.text_field=body", r"'body'.*data\.text_field"),
    ("data.source={data}/missing.jsonl", r"data\.source: file not found"),
    ("data.source={data}/bad.parquet", r"bad\.parquet is not a parquet file"),
    ("data.source={data}/fake.parquet", r"fake\.parquet is not a parquet file"),
    ("data.source={data}/ok.jsonl data.chat_template=true", r"data\.chat_template needs a 'messages' field"),
    ("teacher.model={cut}", r"truncated"),
    ("teacher.model={cut_gguf}", r"as GGUF"),
    ("teacher.model={conv}", r"already converted.*distill needs the softmax teacher"),
    ("teacher.model={remote}", r"auto_map"),
    ("teacher.model={gpt2}", r"'gpt2' is not supported"),
    ("output.dir=.", r"output\.dir \. is the working directory"),
    ("output.dir={file}", r"output\.dir .* is an existing file"),
    ("not-key-value", r"override 'not-key-value' is not key=value"),
]
DISTILL = [(f"field:{o.split('=')[0]}={o.split('=', 1)[-1][:24]}", f"distill {{recipe}} {o}", rx)
           for o, rx in DISTILL_FIELDS] + [
    ("recipe-missing", "distill {base}/nope.yaml", r"recipe not found"),
    ("recipe-not-yaml", "distill {bad_yaml}", r"cannot read .*bad\.yaml as YAML"),
]
TABLE = [(f"{cmd.split()[0]}:{name}", cmd, rx) for name, cmd, rx in CONVERT + FIDELITY + GENERATE + DISTILL]


def run_cli(args, stdin=None):
    result = CliRunner().invoke(app, args, input=stdin)
    return result.exit_code, result.output


@pytest.mark.parametrize("name,command,pattern", TABLE, ids=[t[0] for t in TABLE])
def test_bad_input(name, command, pattern, inputs, tmp_path, monkeypatch):
    import shlex

    work = tmp_path / "work"  # the working directory of the command: must stay empty
    work.mkdir()
    monkeypatch.chdir(work)
    before = sorted(p.relative_to(inputs["base"]) for p in inputs["base"].rglob("*"))
    args = shlex.split(command.format(**{k: str(v) for k, v in inputs.items()}))
    t0 = time.perf_counter()
    code, output = run_cli(args, stdin="y\n")
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2, output
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in output
    assert list(work.iterdir()) == [], f"left behind: {list(work.iterdir())}"
    assert sorted(p.relative_to(inputs["base"]) for p in inputs["base"].rglob("*")) == before
    assert not (inputs["remote"] / "RAN").exists()
    assert time.perf_counter() - t0 < 30, "answered only after loading"  # a tiny model: seconds at most


def test_bad_input_table_size():
    assert len(TABLE) >= 60 and len({t[0] for t in TABLE}) == len(TABLE)


# --- custom model code -----------------------------------------------------------------------------

def test_remote_code_refused_even_with_yes_on_stdin(inputs, tmp_path):
    """A folder with auto_map is refused before loading; "y" on stdin changes nothing, no code runs."""
    proc = subprocess.run([sys.executable, "-m", "linearize", "convert", "-m", str(inputs["remote"]), "-o",
                           str(tmp_path / "out")], input="y\ny\n", capture_output=True, text=True, timeout=120)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "auto_map" in lines[0], proc.stdout + proc.stderr
    assert not (inputs["remote"] / "RAN").exists()
    assert not (tmp_path / "out").exists()


def test_every_from_pretrained_refuses_remote_code():
    """Every from_pretrained call in the package passes trust_remote_code=False (read from the source)."""
    calls = []
    for path in (ROOT / "linearize").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                kw = {k.arg: k.value for k in node.keywords}
                ok = isinstance(kw.get("trust_remote_code"), ast.Constant) and kw["trust_remote_code"].value is False
                calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", ok))
    assert calls, "no from_pretrained call found"
    assert [c for c, ok in calls if not ok] == []


# --- outputs ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    return tiny_model("llama", num_hidden_layers=1)


def test_save_force_never_shows_a_half_output(small, tmp_path):
    """Replacing with force: a reader sees the old output whole or the new one whole, never a mix."""
    from linearize.saving import save

    out = tmp_path / "out"
    out.mkdir()
    for i in range(3000):
        (out / f"old-{i:04d}").write_text("x")
    seen, stop = set(), threading.Event()

    def watch():
        while not stop.is_set():
            try:
                names = os.listdir(out)
            except FileNotFoundError:
                continue  # between the two renames
            old = sum(n.startswith("old-") for n in names)
            seen.add("old" if old == 3000 else "new" if old == 0 and "config.json" in names else f"mixed:{old}")

    t = threading.Thread(target=watch)
    t.start()
    try:
        save(small, None, out, force=True)
    finally:
        stop.set()
        t.join()
    assert (out / "config.json").is_file() and not any(n.startswith("old-") for n in os.listdir(out))
    assert {s for s in seen if s.startswith("mixed")} == set()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_save_failure_leaves_no_parents_and_keeps_the_old_output(small, tmp_path):
    from linearize.saving import save

    def broken(folder):
        raise RuntimeError("report failed")

    with pytest.raises(RuntimeError):
        save(small, None, tmp_path / "a" / "b" / "out", extra=broken)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        save(small, None, tmp_path / "keep", force=True, extra=broken)
    assert (tmp_path / "keep" / "mine.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_check_output_dir_creates_nothing(tmp_path):
    from linearize.saving import check_output_dir

    check_output_dir(tmp_path / "x" / "y" / "out", force=False)
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_folders_are_cleaned(small, tmp_path):
    """Folders of killed runs go at the next run; a live process's folder stays."""
    from linearize.saving import save

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [tmp_path / f".out.tmp-{dead.stdout.strip()}-abc", tmp_path / ".out.tmp-k2j3h4g5",
             tmp_path / f".out.old-{dead.stdout.strip()}-xyz"]
    live = tmp_path / ".out.tmp-1-live"  # pid 1 is alive
    for d in [*stale, live]:
        d.mkdir()
        (d / "half.bin").write_bytes(b"\0" * 10)
    save(small, None, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "out"]


def test_outputs_get_the_umask_modes(small, tmp_path):
    from linearize.saving import save

    old = os.umask(0o027)
    try:
        save(small, None, tmp_path / "out")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()} == {0o640}


# --- data rows without text -------------------------------------------------------------------------

def test_rows_without_text_are_counted(tmp_path):
    from linearize.config import DataConfig
    from linearize.distill.data import DataWarning, load_documents

    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "one"}\n{"title": "no text"}\n{"text": "two"}\n{"text": "  "}\n')
    with pytest.warns(DataWarning, match=r"1 of 4 rows have no 'text' field and 1 have no text"):
        ds = load_documents(DataConfig(source=str(f)))
    assert ds["text"] == ["one", "two"]


def test_held_out_text_that_was_trained_on_is_said(tmp_path):
    """One document (held out: all of it, trained on too), or held-out documents shorter than a row (the last
    training row stands in): the held-out evaluation would read training text, and a warning says so; two long
    documents split cleanly, without one."""
    import warnings

    from conftest import tiny_tokenizer

    from linearize.config import DataConfig
    from linearize.distill.data import DataWarning, build_data

    tok = tiny_tokenizer(300, 5)
    long = "the quick brown fox jumps over the lazy dog " * 40
    cases = {"one": [long], "short": [long, long, "tiny"], "clean": [long, long]}
    for name, texts in cases.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        cfg = DataConfig(source=str(f), seq_len=32, heldout_fraction=0.34)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            build_data(cfg, tok)
        said = [w for w in seen if issubclass(w.category, DataWarning) and "reads training text" in str(w.message)]
        assert bool(said) == (name != "clean"), name


# --- Ctrl-C, the ETA ----------------------------------------------------------------------------------

def test_distill_ctrl_c_says_how_to_resume(inputs, tmp_path):
    """SIGINT mid-run: exit 130 and the command that resumes it; the ETA leaves out the setup time."""
    cmd = [sys.executable, "-m", "linearize", "distill", str(inputs["recipe"]), "stages.0.steps=100000",
           "output.checkpoint_every=1", "data.max_documents=60", "convert.calibration_tokens=32"]
    # SIGINT as a terminal delivers it, whatever the suite's launcher left (a shell's `cmd &` ignores it)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        deadline = time.monotonic() + 180
        while len(lines) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("["):
                lines.append(line)
        assert len(lines) == 3, proc.stderr.read() if proc.poll() is not None else lines
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "eta ?" in lines[0] and re.search(r"eta \d+s", lines[1]), lines
    msg = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert len(msg) == 1 and "Traceback" not in err, err
    step = int(re.match(r"interrupted at step (\d+); resume with: linearize distill (.*) --resume$", msg[0])[1])
    assert step >= 3
    assert f"{inputs['recipe']} stages.0.steps=100000" in msg[0]


# --- the tables and the plot mark layers kept softmax -------------------------------------------------

ROWS = [{"layer": i, "block": b, "uniform": 0.9, "vala": 0.5 + i / 10, "seed": 3.0, "stable": 0.4 + i / 10}
        for i, b in enumerate(["gdn", "softmax", "gdn"])]


def test_print_fidelity_marks_kept_softmax(capsys):
    from linearize.fidelity import print_fidelity

    print_fidelity(ROWS, "t")
    table = capsys.readouterr().out
    row = [line for line in table.splitlines() if "softmax" in line]
    assert len(row) == 1 and re.search(r"\b1\b.*softmax", row[0])


def test_plot_fidelity_marks_kept_softmax(tmp_path):
    from linearize.eval import plot_fidelity

    plain = [{k: v for k, v in r.items() if k != "block"} for r in ROWS]
    plot_fidelity(plain, tmp_path / "plain.png", "t")
    plot_fidelity(ROWS, tmp_path / "kept.png", "t")
    plot_fidelity(plain, tmp_path / "plain2.png", "t")
    assert (tmp_path / "plain.png").read_bytes() == (tmp_path / "plain2.png").read_bytes()  # deterministic
    assert (tmp_path / "plain.png").read_bytes() != (tmp_path / "kept.png").read_bytes()


# --- the help screen ----------------------------------------------------------------------------------

HEAVY = ("torch", "transformers", "datasets", "omegaconf", "rich", "numpy")


@pytest.mark.parametrize("command", [[], ["convert"], ["fidelity"], ["generate"], ["distill"]])
def test_help_is_light(command):
    """--help imports none of the heavy libraries (they made it take 7-13 s)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "linearize", *command, "--help"],
                          capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []
    assert took < 5, took  # about 0.1 s; a loose bound for a busy machine


def test_help_shows_flags_without_types():
    for command in ("convert", "generate", "distill"):
        code, text = run_cli([command, "--help"])
        assert code == 0 and "<bool>" not in text, text
    code, text = run_cli(["convert", "--help"])
    assert re.search(r"^\s+--force\s+Replace", text, re.M), text
    assert "'seed'" in text and "taylor-seed" not in text


def test_convert_open_layer_range_runs_to_the_last_layer(inputs, tmp_path):
    """`--layers 1-` means 1..last (the good twin of the range cases in the table)."""
    out = tmp_path / "out"
    code, text = run_cli(["convert", "-m", str(inputs["tiny"]), "-o", str(out), "--layers", "1-",
                          "--tokens", "32", "--calibration-tokens", "32"])
    assert code == 0, text
    report = json.loads((out / "fidelity.json").read_text())
    assert [r["block"] for r in report["layers"]] == ["softmax", "gdn", "gdn"]
    assert re.search(r"^│\s+0 │ softmax \(kept\)", text, re.M), text
