"""``scripts/ab.sh run`` with rounds, ``scripts/ab.sh test`` and ``scripts/ab_table.py``, the A/B tools of the
kernel timings: the rounds interleave the variants, each tree's tests run on its own package, and the
table's medians, ranges and speedups are those of the JSONs."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from conftest import load_script

SCRIPTS = Path(__file__).parents[1] / "scripts"


def bench_json(path: Path, rows: list[tuple]) -> None:
    """A bench_kernels.py JSON with rows (shape, B, T, fwd ms, f+b ms) of the linear operator."""
    path.write_text(json.dumps({"device": "test", "rows": [
        {"op": "linear", "shape": s, "B": B, "T": T, "q_heads": 16, "kv_heads": 16, "ours_fwd_ms": f, "ours_fwdbwd_ms": fb}
        for s, B, T, f, fb in rows]}))


def test_rounds_interleave_the_trees(tmp_path):
    """AB_ROUNDS=2 runs tree a, tree b, tree a, tree b, each writing <tree>.r<k>.<script>.json."""
    shutil.copytree(SCRIPTS, tmp_path / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    log = tmp_path / "order.log"
    for tree in ("a", "b"):
        (tmp_path / "ab" / tree / "scripts").mkdir(parents=True)
        (tmp_path / "ab" / tree / "scripts" / "probe.py").write_text(
            "import sys\n"
            f"open({str(log)!r}, 'a').write({tree!r} + '\\n')\n"
            "open(sys.argv[sys.argv.index('--output') + 1], 'w').write('{}')\n")
    out = tmp_path / "out"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "AB_ROUNDS": "2"}
    subprocess.run(["bash", str(tmp_path / "scripts" / "ab.sh"), "run", "30", str(out), "probe.py"], env=env,
                   check=True, capture_output=True)
    assert log.read_text().split() == ["a", "b", "a", "b"]
    assert sorted(p.name for p in out.iterdir()) == ["a.r1.probe.json", "a.r2.probe.json", "b.r1.probe.json",
                                                     "b.r2.probe.json"]
    bad = subprocess.run(["bash", str(tmp_path / "scripts" / "ab.sh"), "run", "30", str(out), "probe.py"],
                         env={**env, "AB_ROUNDS": "two"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "AB_ROUNDS" in bad.stderr


def test_each_tree_runs_its_own_tests_on_its_own_package(tmp_path):
    """``ab.sh test`` imports each tree's linearize/ in its tests (a tree whose test fails says so in its line),
    AB_TREES keeps the trees named, and a tree without tests/ is refused with exit 2."""
    shutil.copytree(SCRIPTS, tmp_path / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    for tree, value in (("a", 1), ("b", 2)):
        (tmp_path / "ab" / tree / "linearize").mkdir(parents=True)
        (tmp_path / "ab" / tree / "linearize" / "__init__.py").write_text(f"VALUE = {value}\n")
        (tmp_path / "ab" / tree / "tests").mkdir()
        (tmp_path / "ab" / tree / "tests" / "test_probe.py").write_text(
            "import linearize\n\ndef test_value():\n    assert linearize.VALUE == 1\n")
    out = tmp_path / "out"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    ab = ["bash", str(tmp_path / "scripts" / "ab.sh"), "test", str(out), "-q"]
    run = subprocess.run(ab, env=env, capture_output=True, text=True, cwd=tmp_path)
    lines = run.stdout.splitlines()
    assert lines[0].startswith("== a: 1 passed") and lines[1].startswith("== b: 1 failed"), run.stdout
    assert "ab/a/linearize/__init__.py" in (out / "a.log").read_text().splitlines()[0]
    (out / "a.log").unlink()
    run = subprocess.run(ab, env={**env, "AB_TREES": "b"}, capture_output=True, text=True, cwd=tmp_path)
    assert run.stdout.startswith("== b: 1 failed") and not (out / "a.log").exists()
    shutil.rmtree(tmp_path / "ab" / "a" / "tests")
    bad = subprocess.run(ab, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "no tests/" in bad.stderr


def test_table_medians_ranges_and_speedups(tmp_path):
    """Three rounds of main and of a variant, plus a flag run named as the kernels step names it: each row's
    median, min and max are those of its rounds, and the speedup is main's median over the variant's."""
    ab_table = load_script("ab_table")
    main_fwd, var_fwd = [0.40, 0.44, 0.38], [0.30, 0.36, 0.31]
    for k in range(3):
        bench_json(tmp_path / f"main.r{k + 1}.bench_kernels.json", [("std", 2, 8192, main_fwd[k], 1.5 + k / 10)])
        bench_json(tmp_path / f"bv128.r{k + 1}.bench_kernels.json",
                   [("std", 2, 8192, var_fwd[k], 1.4), ("std", 8, 2048, 0.3, 1.2)])
    bench_json(tmp_path / "linear_segment_8.json", [("std", 2, 8192, 0.5, 2.0)])
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a bench JSON: left out
    runs = ab_table.load(tmp_path)
    assert sorted(runs) == ["bv128", "linear_segment_8", "main"]
    rows = {r["variant"]: r for r in ab_table.table(runs, "main")}
    assert set(rows) == {"main", "bv128", "linear_segment_8"}  # 8×2048: the base has none, so no row
    v = rows["bv128"]
    assert (v["fwd_ms"], v["fwd_min_ms"], v["fwd_max_ms"], v["fwd_rounds"]) == (0.31, 0.30, 0.36, 3)
    assert v["fwd_speedup_vs_base"] == statistics.median(main_fwd) / statistics.median(var_fwd)
    assert rows["main"]["fwdbwd_ms"] == 1.6 and rows["main"]["fwd_speedup_vs_base"] == 1.0
    assert rows["linear_segment_8"]["fwd_speedup_vs_base"] == 0.40 / 0.5
    text = ab_table.markdown(ab_table.table(runs, "main"), "main")
    assert "| 0.310 (0.300–0.360) |" in text and "| 1.29× |" in text


def test_table_refuses_an_empty_folder(tmp_path):
    """A folder with no bench JSON: one line on stderr, exit 2."""
    r = subprocess.run([sys.executable, str(SCRIPTS / "ab_table.py"), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: no bench_kernels.py JSON")
