"""One evaluation run: each model (the converted one, its teacher) loaded in turn and measured on
the same rows — zero-shot tasks, per-domain perplexity, passkey retrieval — into one JSON-ready dict.

    plan = Plan(model="out/model", teacher="smollm2-135m", tasks=["piqa"], limit=100)
    result = evaluate(plan)
    print_tables(result)
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checks import UserError


@dataclass
class Plan:
    model: str
    teacher: str | None = None
    tasks: list[str] = field(default_factory=list)  # empty: no harness tasks
    limit: int | None = None
    eval_data: str | None = None
    batch_size: int = 8
    corpus: str | None = None  # None: the built-in held-out text
    corpus_split: str = "heldout"  # or "test": the documents kept out of development too (linearize.corpus.reader)
    seq_len: int = 512
    ppl_tokens: int = 16384  # 0: no perplexity
    passkey_lengths: list[int] = field(default_factory=list)  # empty: no passkey
    passkey_trials: int = 5
    passkey_depths: int = 4  # evenly from 0 (the key first) to 0.75 (a quarter of the filler after it)
    passkey_keys: int = 1  # key sentences a prompt, one asked for by name (quality.passkey)
    rope_scaling: str | None = None  # KIND:FACTOR[:ORIGINAL], set on both sides (linearize.models.rope)
    rope_scaling_layers: str = "all"  # or "softmax": only the layers a hybrid kept softmax
    sparse_cache: int | None = None  # the model's sparse cache resized to this many slots (layers.options)
    seed: int = 0
    device: str | None = None
    dtype: str = "float32"


def recipe_teacher(model: str) -> str | None:
    """The teacher named in the ``recipe.yaml`` of the distill run ``model`` came from, if any
    (``linearize distill`` saves the model as ``<run>/model`` beside ``<run>/recipe.yaml``)."""
    import yaml

    p = Path(model).expanduser()
    for folder in (p, p.parent):
        f = folder / "recipe.yaml"
        if p.is_dir() and f.is_file():
            try:
                name = (yaml.safe_load(f.read_text()) or {}).get("teacher", {}).get("model")
            except (yaml.YAMLError, AttributeError):
                return None
            return name if isinstance(name, str) and name.strip() else None
    return None


def load_model(spec: str, dtype: str = "float32", device: str | None = None):
    """``(model, tokenizer)``: a converted directory through :func:`linearize.load`, anything else
    (alias, .gguf, directory, hub id) through :func:`linearize.models.load_teacher`. No remote code."""
    import torch

    from ..checks import inspect_model, loaded

    src, info = inspect_model(spec)
    torch_dtype = getattr(torch, dtype)
    if (info.model_type or "").startswith("linearize_"):
        from transformers import AutoTokenizer

        from ..saving import load

        lm = loaded(spec, lambda: load(src.path, dtype=torch_dtype))
        tok = loaded(spec, lambda: AutoTokenizer.from_pretrained(src.path, trust_remote_code=False))
    else:
        from ..models import load_teacher

        lm, tok = loaded(spec, lambda: load_teacher(src, dtype=torch_dtype))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return lm.to(device), tok


def _fingerprint(rows) -> str:
    return hashlib.sha1(rows.contiguous().numpy().tobytes()).hexdigest()[:16]


def measure(plan: Plan, lm, tok, edges: tuple[int, ...] = ()) -> dict:
    """Everything the plan asks, for one loaded model (``edges``: extra cuts of perplexity by context length)."""
    from . import harness, passkey, perplexity

    got = {}
    if plan.passkey_lengths:
        passkey.make_prompt(tok, min(plan.passkey_lengths), 0.0, "00000", plan.passkey_keys)  # too short: before any work
    if plan.tasks:
        scores = harness.run_tasks(lm, tok, plan.tasks, plan.limit, plan.eval_data, plan.batch_size)
        got["harness"] = {**scores, "average": harness.average(scores)}
    if plan.ppl_tokens:
        if plan.corpus is not None:
            rows = perplexity.corpus_rows(plan.corpus, plan.seq_len, plan.ppl_tokens, tokenizer=tok,
                                          split=plan.corpus_split)
            perplexity.check_vocab(rows, lm.get_input_embeddings().num_embeddings, "the model")
        else:
            rows = perplexity.builtin_rows(tok, plan.seq_len, plan.ppl_tokens)
        got["perplexity"] = {d: {**perplexity.domain_perplexity(lm, r, plan.batch_size, edges), "rows": int(r.shape[0]),
                                 "rows_sha1": _fingerprint(r)} for d, r in rows.items()}
    if plan.passkey_lengths:
        got["passkey"] = passkey.run_passkey(lm, tok, plan.passkey_lengths, depths=passkey.depths(plan.passkey_depths),
                                             trials=plan.passkey_trials, seed=plan.seed, needles=plan.passkey_keys)
    return got


def evaluate(plan: Plan, progress=print) -> dict:
    """Measure ``plan.model`` and then ``plan.teacher`` (one in memory at a time)."""
    import gc

    sides = {"model": plan.model, **({"teacher": plan.teacher} if plan.teacher else {})}
    result = {"plan": asdict(plan), "models": sides, "results": {}, "seconds": {}}
    if plan.tasks:
        from . import harness

        result["harness"] = {"lm_eval": harness.lm_eval_version(), "primary": {t: harness.PRIMARY[t] for t in plan.tasks},
                             "split": {t: "test" if t in ("lambada", "mmlu") else "validation" for t in plan.tasks}}
    if plan.passkey_lengths:
        from .passkey import depths

        result["passkey"] = {"depths": depths(plan.passkey_depths), "filler": "grass/sky/sun (Mohtashami & Jaggi 2023)",
                             "needles": plan.passkey_keys}
    for side, spec in sides.items():
        t0 = time.perf_counter()
        progress(f"{side}: loading {spec}")
        lm, tok = load_model(spec, plan.dtype, plan.device)
        if plan.rope_scaling:
            from ..models.rope import rope_scaling

            rope_scaling(lm, plan.rope_scaling, plan.rope_scaling_layers if side == "model" else "all")
        if side == "model":
            from ..checks import resize_sparse_cache

            resize_sparse_cache(lm, plan.sparse_cache, spec)
        if side == "model":  # the teacher's perplexity split at the same context lengths: where the exact part ends
            from .perplexity import exact_reach

            result["context_edges"] = list(exact_reach(lm))
        progress(f"{side}: measuring")
        result["results"][side] = measure(plan, lm, tok, tuple(result["context_edges"]))
        result["seconds"][side] = round(time.perf_counter() - t0, 1)
        del lm
        gc.collect()
    ppl = [r.get("perplexity") for r in result["results"].values()]
    if len(ppl) == 2 and all(ppl):
        result["perplexity_same_rows"] = all(ppl[0][d]["rows_sha1"] == ppl[1].get(d, {}).get("rows_sha1") for d in ppl[0])
    return result


def check_plan(plan: Plan) -> None:
    """Option checks that need no model: before anything loads."""
    from ..checks import sparse_cache_size
    from ..models.rope import check_layers, parse_rope_scaling

    if plan.rope_scaling:
        parse_rope_scaling(plan.rope_scaling)
    check_layers(plan.rope_scaling_layers)
    if plan.limit is not None and plan.limit < 1:
        raise UserError(f"--limit must be at least 1 (rows per task); got {plan.limit}")
    for flag, value, least in (("--batch-size", plan.batch_size, 1), ("--seq-len", plan.seq_len, 2),
                               ("--passkey-trials", plan.passkey_trials, 1), ("--passkey-depths", plan.passkey_depths, 2),
                               ("--ppl-tokens", plan.ppl_tokens, 0)):
        if value < least:
            raise UserError(f"{flag} must be at least {least}; got {value}")
    from .passkey import check_needles

    check_needles(plan.passkey_keys)
    sparse_cache_size(plan.sparse_cache)
    if plan.ppl_tokens and plan.ppl_tokens < plan.seq_len:
        raise UserError(f"--ppl-tokens {plan.ppl_tokens} is less than one row of --seq-len {plan.seq_len}; "
                        "raise --ppl-tokens or lower --seq-len")
    if plan.dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype must be float32, bfloat16 or float16; got {plan.dtype}")
    if plan.tasks:
        from .data import check

        check(plan.eval_data, plan.tasks)
    if plan.corpus_split not in ("heldout", "test"):
        raise UserError(f"--corpus-split must be heldout or test; got {plan.corpus_split!r}")
    if plan.corpus_split == "test" and plan.corpus is None and plan.ppl_tokens:
        raise UserError("--corpus-split test needs --corpus: the built-in text has no test split")
    if plan.corpus is not None and plan.ppl_tokens:
        if not Path(plan.corpus).is_dir():
            raise UserError(f"--corpus {plan.corpus} is not a folder; build one with linearize's corpus tools")
        from ..corpus.reader import open_corpus
        from .perplexity import too_short

        corpus = open_corpus(plan.corpus)  # a bad corpus fails here, before any model loads
        try:  # the reader refuses a split the corpus lacks (one built before the test split)
            short = [d for d in corpus.domains if corpus.tokens(d, plan.corpus_split) < plan.seq_len]
        except ValueError as e:
            raise UserError(f"--corpus-split {plan.corpus_split}: {e}") from None
        if short:
            raise too_short(plan.corpus, short, plan.seq_len, plan.corpus_split)


def command(opts: dict, command_line: str, echo=print) -> None:
    """``linearize eval``: ``opts`` are its options by name."""
    from .. import checks
    from . import data
    from .harness import parse_tasks

    if opts["fetch_data"]:
        echo(f"fetched the evaluation data into {data.fetch(opts['eval_data'])}")
        return
    model, output = opts["model"], opts["output"]
    if model is None:
        raise UserError("--model is missing; give the model to evaluate, e.g. linearize eval -m smollm2-135m-gdn")
    checks.positive(opts["passkey_len"], "--passkey-len", 16)
    checks.json_output(output)
    teacher = opts["teacher"]
    teacher = None if teacher == "none" else teacher or recipe_teacher(model)
    plan = Plan(model=model, teacher=teacher,
                tasks=[] if opts["tasks"].strip() == "none" else parse_tasks(opts["tasks"]), limit=opts["limit"],
                eval_data=None if opts["eval_data"] is None else str(opts["eval_data"]), batch_size=opts["batch_size"],
                corpus=None if opts["corpus"] is None else str(opts["corpus"]), seq_len=opts["seq_len"],
                corpus_split=opts.get("corpus_split", "heldout"),
                ppl_tokens=opts["ppl_tokens"], passkey_trials=opts["passkey_trials"], seed=opts["seed"],
                passkey_depths=opts.get("passkey_depths", 4), passkey_keys=opts.get("passkey_keys", 1),
                rope_scaling=opts.get("rope_scaling"),
                rope_scaling_layers=opts.get("rope_scaling_layers", "all"), sparse_cache=opts.get("sparse_cache"),
                passkey_lengths=[opts["passkey_len"] * m for m in (1, 2, 4)] if opts["passkey"] else [],
                device=opts["device"], dtype=opts["dtype"])
    check_plan(plan)
    for spec in filter(None, (plan.model, plan.teacher)):
        checks.inspect_model(spec)  # a wrong path or remote code: before anything loads
    if plan.teacher and opts["teacher"] is None:
        echo(f"teacher: {plan.teacher} (from the run's recipe.yaml)")
    result = evaluate(plan, progress=echo)
    print_tables(result)
    if output is not None:  # the JSON, and its tables as markdown beside it
        md = Path(output).with_suffix(".md")
        checks.write_atomic(Path(output), json.dumps({"command": command_line, **result}, indent=1))
        checks.write_atomic(md, markdown({"command": command_line, **result}))
        echo(f"wrote {output} and {md}")


# --- printing ------------------------------------------------------------------------------------

def _fmt(v, pct=True):
    if v is None:
        return "–"
    return f"{100 * v:.1f}" if pct else f"{v:.2f}"


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The result as ``(title, columns, rows)`` tables: zero-shot accuracy, perplexity, passkey."""
    from .harness import DEFAULT_TASKS

    sides = list(result["results"])
    res = result["results"]
    names = [f"{s} ({Path(result['models'][s]).name or result['models'][s]})" for s in sides]
    out = []
    if "harness" in result:
        primary = result["harness"]["primary"]
        rows = []
        for task, metric in primary.items():
            rows.append([task, metric, *[_fmt(res[s]["harness"][task][metric]) for s in sides]])
            if task == "lambada":
                rows.append([task, "perplexity", *[_fmt(res[s]["harness"][task].get("perplexity"), False) for s in sides]])
        k = sum(t in DEFAULT_TASKS for t in primary)
        if k:
            rows.append([f"{k}-task average" + (" (without mmlu)" if "mmlu" in primary else ""), "",
                         *[_fmt(res[s]["harness"]["average"]) for s in sides]])
        out.append((f"zero-shot accuracy, % (limit {result['plan']['limit'] or 'none'}; lm-eval "
                    f"{result['harness']['lm_eval']})", ["task", "metric", *names], rows))
    if any("perplexity" in res[s] for s in sides):
        rows = [[d, str(row["tokens"]), *[_fmt(res[s]["perplexity"][d]["ppl"], False) for s in sides]]
                for d, row in res[sides[0]]["perplexity"].items()]
        split = "test" if result["plan"].get("corpus_split") == "test" else "held-out"
        out.append((f"{split} perplexity (rows of {result['plan']['seq_len']} tokens)", ["domain", "tokens", *names], rows))
        first = res[sides[0]]["perplexity"]
        if all("by_context" in first[d] for d in first):  # files written before the spans existed have none
            rows = [[d, span, *[_fmt(res[s]["perplexity"][d]["by_context"][span]["ppl"], False) for s in sides]]
                    for d in first for span in first[d]["by_context"]]
            out.append((f"{split} perplexity by context length (tokens of the row before the predicted one)",
                        ["domain", "context", *names], rows))
    if any("passkey" in res[s] for s in sides):
        rows = [[n, *[_fmt(res[s]["passkey"]["lengths"][n]["acc"]) for s in sides]] for n in res[sides[0]]["passkey"]["lengths"]]
        keys, needles = result["plan"]["passkey_trials"], result["plan"].get("passkey_keys", 1)
        among = f"; {needles} named keys a prompt, one asked for" if needles > 1 else ""
        out.append((f"passkey retrieval, % correct ({keys} key{'s' if keys != 1 else ''} per length and depth{among})",
                    ["length", *names], rows))
        if needles > 1:  # answers that were another needle's key
            rows = [[n, *[_fmt(res[s]["passkey"]["lengths"][n].get("confused")) for s in sides]]
                    for n in res[sides[0]]["passkey"]["lengths"]]
            out.append(("passkey answers that were another name's key, %", ["length", *names], rows))
    return out


def markdown(result: dict) -> str:
    """The tables as GitHub markdown, under the command that produced them."""
    parts = [f"`{result['command']}`\n"] if result.get("command") else []
    for title, columns, rows in tables(result):
        parts.append(f"**{title}**\n")
        parts.append("| " + " | ".join(columns) + " |")
        parts.append("|" + "|".join(" --- " for _ in columns) + "|")
        parts += ["| " + " | ".join(r) + " |" for r in rows]
        parts.append("")
    return "\n".join(parts)


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for title, columns, rows in tables(result):
        t = Table(title=title)
        for c in columns:
            t.add_column(c, justify="left" if c in ("task", "metric", "domain") else "right")
        for r in rows:
            t.add_row(*r)
        console.print(t)
