"""The result schema (validation, JSON round trip, summary rules) and the compare report (table values
computed by hand, target logic in both metric directions, missing references, files and PNGs)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import matplotlib.image
import pytest

from gradpress.testbed import report as R
from gradpress.testbed.results import Eval, Run, Step, load_runs, save_runs, warmup_steps

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(compressor: str, values: list[float], *, step_s: float, bytes_sent: int,
             metric: str = "accuracy", samples: int = 64, steps: int = 10) -> Run:
    """``steps`` steps; the first (warm-up) takes 1 s, the others ``step_s``; an evaluation after every
    ``steps // len(values)`` steps: with 10 steps and 5 values, after steps 2, 4, 6, 8, 10."""
    walls = [1.0 + i * step_s for i in range(steps)]
    step_list = tuple(Step(i + 1, i // 5, walls[i], 0.6 * step_s, 0.1 * step_s, 0.3 * step_s, bytes_sent,
                           samples) for i in range(steps))
    every = steps // len(values)
    higher = metric != "perplexity"
    evals = tuple(Eval(k * every // 5, k * every, walls[k * every - 1], k * every * bytes_sent, metric, v,
                       higher, loss=1.0) for k, v in enumerate(values, start=1))
    return Run(compressor, "mlp", "fashion-mnist", 2, "100mbit", 0, step_list, evals, info={"batch": 32})


@pytest.fixture
def accuracy_runs() -> list[Run]:
    return [
        make_run("torch-allreduce", [0.5, 0.7, 0.8, 0.85, 0.84], step_s=0.2, bytes_sent=4000),
        make_run("topk:ratio=0.01", [0.4, 0.6, 0.75, 0.8, 0.82], step_s=0.1, bytes_sent=40),
        make_run("qsgd", [0.3, 0.5, 0.6, 0.7, 0.75], step_s=0.125, bytes_sent=1_500_000),  # never reaches
        make_run("noop", [0.3, 0.4, 0.5, 0.6, 0.65], step_s=0.05, bytes_sent=0),
    ]


# -------------------------------------------------------------------------------------------------
# Schema
# -------------------------------------------------------------------------------------------------
def test_warmup_rule():
    assert [warmup_steps(n) for n in (1, 2, 9, 10, 11, 100, 1000)] == [0, 1, 1, 1, 2, 10, 100]
    with pytest.raises(ValueError):
        warmup_steps(0)


def test_summary_by_hand(accuracy_runs):
    ref, topk, qsgd, _ = accuracy_runs
    # 10 steps, the first left out: 9 steps × 64 samples over 9 × 0.2 s
    assert ref.samples_per_s == pytest.approx(320.0)
    assert topk.samples_per_s == pytest.approx(640.0)
    assert ref.mean_step_s == pytest.approx(0.2) and ref.mean_comm_s == pytest.approx(0.06)
    assert ref.bytes_per_step == 4000 and ref.name == "torch-allreduce" and topk.name == "topk"
    assert ref.final_quality == 0.84 and ref.best_quality == 0.85
    assert ref.time_to_target(0.81) == pytest.approx(1.0 + 7 * 0.2)  # 0.85 after step 8
    assert ref.bytes_to_target(0.81) == 8 * 4000
    assert qsgd.time_to_target(0.81) is None and qsgd.bytes_to_target(0.81) is None


def test_warmup_step_does_not_count_toward_throughput():
    run = make_run("none", [0.5], step_s=0.1, bytes_sent=8, steps=10)
    slow_first = (replace(run.steps[0], wall_s=30.0, compute_s=29.0),)
    slow_start = replace(run, evals=(), steps=slow_first + tuple(replace(s, wall_s=s.wall_s + 29.0)
                                                                  for s in run.steps[1:]))
    assert slow_start.samples_per_s == pytest.approx(run.samples_per_s) == pytest.approx(640.0)
    assert slow_start.mean_compute_s == pytest.approx(0.06)


def test_lower_is_better_quality():
    run = make_run("none", [300.0, 200.0, 150.0, 140.0, 145.0], step_s=0.1, bytes_sent=8, metric="perplexity")
    assert run.best_quality == 140.0 and run.final_quality == 145.0 and not run.higher_is_better
    assert run.time_to_target(150.0) == pytest.approx(1.0 + 5 * 0.1)  # reaches ≤ 150 after step 6
    assert run.time_to_target(140.0) == pytest.approx(1.0 + 7 * 0.1)  # equal counts as reached
    assert run.time_to_target(139.9) is None


def test_diverged_run_round_trips_and_is_never_best():
    run = make_run("none", [math.nan, math.inf], step_s=0.1, bytes_sent=8, metric="perplexity")
    again = Run.from_json(run.to_json())
    assert math.isnan(again.evals[0].value) and again.evals[1].value == math.inf
    assert again.best_quality is None and again.time_to_target(1e9) is None


def test_json_round_trip(tmp_path, accuracy_runs):
    run = accuracy_runs[1]
    assert Run.from_json(run.to_json()) == run
    assert load_runs(run.save(tmp_path / "one.json")) == [run]
    assert load_runs(save_runs(accuracy_runs, tmp_path / "all.json")) == accuracy_runs
    obj = json.loads(run.to_json())
    assert obj["schema"] == 1 and obj["bandwidth"] == "100mbit" and len(obj["steps"]) == 10
    assert set(obj["steps"][0]) == {"step", "epoch", "wall_s", "compute_s", "compress_s", "comm_s",
                                    "bytes_sent", "samples", "intra_node_bytes", "link_bytes"}
    assert set(obj["evals"][0]) == {"epoch", "step", "wall_s", "bytes_total", "metric", "value",
                                    "higher_is_better", "loss"}


@pytest.mark.parametrize("edit, message", [
    (lambda o: o.update(schema=2), "schema"),
    (lambda o: o.update(colour="red"), "unknown keys"),
    (lambda o: o.pop("seed"), "missing keys"),
    (lambda o: o.update(workers=0), "workers"),
    (lambda o: o.update(workers=2.0), "workers"),
    (lambda o: o.update(bandwidth="fast"), "bandwidth"),
    (lambda o: o.update(steps=[]), "at least one step"),
    (lambda o: o["steps"][3].update(wall_s=0.5), "must increase"),
    (lambda o: o["steps"][3].update(step=1), "must increase"),
    (lambda o: o["steps"][0].update(bytes_sent=-1), "bytes_sent"),
    (lambda o: o["steps"][0].update(comm_s=math.inf), "comm_s"),
    (lambda o: o["steps"][0].update(samples=0), "samples"),
    (lambda o: o["steps"][0].pop("samples"), r"steps\[0\].*missing"),
    (lambda o: o["evals"][0].update(metric="f1"), "unknown metric"),
    (lambda o: o["evals"][0].update(higher_is_better=False), "higher_is_better"),
    (lambda o: o["evals"][1].update(metric="hit_rate@10"), "differs"),
    (lambda o: o["evals"][1].update(bytes_total=0), "must not decrease"),
    (lambda o: o["evals"][-1].update(step=11), "after the last step"),
])
def test_bad_runs_are_rejected(tmp_path, accuracy_runs, edit, message):
    obj = accuracy_runs[0].to_dict()
    edit(obj)
    with pytest.raises(ValueError, match=message):
        Run.from_dict(obj)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([obj]))
    with pytest.raises(ValueError, match="bad.json: run 0"):
        load_runs(path)


# -------------------------------------------------------------------------------------------------
# Report
# -------------------------------------------------------------------------------------------------
def table_row(markdown: str, label: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| `{label}` |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_table_values_by_hand(tmp_path, accuracy_runs):
    goal, rows = R.summarize(accuracy_runs, tolerance=0.04)
    assert goal.value == pytest.approx(0.81) and goal.reference == "torch-allreduce"
    ref, topk, qsgd, noop = rows
    assert ref.time_to_target == pytest.approx(2.4) and topk.time_to_target == pytest.approx(1.9)
    assert qsgd.time_to_target is None and qsgd.speedup_time_to_target is None
    assert topk.speedup_samples_per_s == pytest.approx(2.0)
    assert topk.speedup_time_to_target == pytest.approx(2.4 / 1.9)
    assert qsgd.speedup_samples_per_s == pytest.approx(1.6)
    assert ref.speedup_samples_per_s == 1.0 and ref.speedup_time_to_target == 1.0
    assert noop.samples_per_s == pytest.approx(1280.0)

    markdown = R.write_report(accuracy_runs, tmp_path, tolerance=0.04).read_text()
    assert "accuracy ≥ 0.8100 = `torch-allreduce`'s best 0.8500 − tolerance 0.04" in markdown
    assert table_row(markdown, "topk:ratio=0.01") == [
        "`topk:ratio=0.01`", "0.8200", "0.8200", "640.0", "40 B", "1.9 s", "2.00×", "1.26×"]
    assert table_row(markdown, "torch-allreduce") == [
        "`torch-allreduce`", "0.8400", "0.8500", "320.0", "4.00 kB", "2.4 s", "1.00×", "1.00×"]
    assert table_row(markdown, "qsgd")[3:] == ["512.0", "1.50 MB", "not reached", "1.60×", "n/a"]
    # where the time goes: step 125 ms = 75 compute + 12.5 compress + 37.5 communication
    times = [row for row in markdown.split("## Where the time goes")[1].splitlines() if "`qsgd`" in row][0]
    assert [c.strip() for c in times.strip("|").split("|")] == [
        "`qsgd`", "125.0", "75.0", "12.5", "37.5", "30 %"]


def test_time_table_states_costs_in_copies_of_the_gradient_where_runs_timed_one(tmp_path, accuracy_runs):
    """With ``info["copy_s"]`` (2 ms here) the table adds the copy, the compression in copies and the
    step's excess over ``noop``'s in copies; the verdict says the same for the best run."""
    timed = [replace(run, info={**run.info, "copy_s": 0.002}) for run in accuracy_runs]
    markdown = R.write_report(timed, tmp_path, tolerance=0.04).read_text()
    times = markdown.split("## Where the time goes")[1]
    header = [line for line in times.splitlines() if line.startswith("| compressor")][0]
    assert header.split("|")[-4:-1] == [" copy ", " compress (copies) ", " step over `noop` (copies) "]
    # qsgd: step 125 ms, compress 12.5 ms; noop's step 50 ms
    qsgd = [row for row in times.splitlines() if "`qsgd`" in row][0]
    assert [c.strip() for c in qsgd.strip("|").split("|")][-3:] == ["2.00", "6.2", "37.5"]
    _, rows = R.summarize(timed, tolerance=0.04)
    assert R.payoff(rows)[-1].endswith("(2.00 ms each, timed in the run): 25.0 over `noop`'s step, compression 5.0.")
    plain = R.write_report(accuracy_runs, tmp_path, tolerance=0.04).read_text()
    assert "compress (copies)" not in plain  # runs from before copies were timed keep the old table


def test_payoff_verdict_names_the_best_run_and_where_its_time_goes(accuracy_runs):
    goal, rows = R.summarize(accuracy_runs, tolerance=0.04)
    lines = R.payoff(rows)
    # topk: 2.00× torch-allreduce (goal 3×), 0.50× noop (goal 0.8×), first to the target
    assert lines[0].startswith("Best gradpress run: `topk:ratio=0.01` (2.00× `torch-allreduce`'s samples/s, 0.50×")
    assert "- **not met**: ≥ 3× `torch-allreduce`'s samples/s" in lines
    assert "- **not met**: ≥ 0.8× `noop`'s samples/s" in lines
    assert "- met: first to the target (`torch-allreduce`)" in lines
    # step 100 ms against noop's 50: compress 10, communication 30, compute 60 (noop's 30)
    assert lines[-1] == ("Where the time goes: its step takes 100.0 ms against `noop`'s 50.0 ms (50.0 ms more): "
                         "compression 10.0 ms, communication 30.0 ms, compute 60.0 ms (`noop`: 30.0 ms).")
    fast = accuracy_runs + [make_run("natural", [0.6, 0.82, 0.83, 0.84, 0.84], step_s=0.05, bytes_sent=10)]
    _, rows = R.summarize(fast, tolerance=0.04)
    lines = R.payoff(rows)
    assert lines[0].startswith("Best gradpress run: `natural` (4.00×") and not any("not met" in x for x in lines)
    assert R.payoff(rows[1:]) == ["Needs `torch-allreduce`, `noop` and a gradpress compressor among the runs."]


def test_files_written_and_pngs_valid(tmp_path, accuracy_runs):
    path = R.write_report(accuracy_runs, tmp_path / "out")
    assert path == tmp_path / "out" / "report.md"
    markdown = path.read_text()
    for name in R.PLOTS:
        png = tmp_path / "out" / name
        assert png.read_bytes()[:8] == PNG_MAGIC and f"]({name})" in markdown
        height, width, channels = matplotlib.image.imread(png).shape
        assert height > 100 and width > 100 and channels in (3, 4)
    assert load_runs(tmp_path / "out" / "results.json") == accuracy_runs


def test_default_tolerance_and_none_as_the_uncompressed_reference(accuracy_runs):
    runs = [make_run("none", [0.5, 0.9], step_s=0.1, bytes_sent=4000)] + accuracy_runs[1:]
    goal, rows = R.summarize(runs)
    assert goal.reference == "none" and goal.value == pytest.approx(0.9 - R.DEFAULT_TOLERANCE["accuracy"])
    assert all(row.speedup_samples_per_s is None and row.speedup_time_to_target is None for row in rows)
    # torch-allreduce is preferred over none when both ran
    goal, _ = R.summarize([runs[0], *accuracy_runs])
    assert goal.reference == "torch-allreduce"


def test_perplexity_target_is_best_plus_tolerance(tmp_path):
    runs = [make_run("none", [300.0, 200.0, 150.0, 140.0, 145.0], step_s=0.2, bytes_sent=4000,
                     metric="perplexity"),
            make_run("fp16", [310.0, 220.0, 160.0, 144.0, 139.0], step_s=0.1, bytes_sent=2000,
                     metric="perplexity"),
            make_run("sign", [400.0, 390.0, 380.0, 370.0, 360.0], step_s=0.1, bytes_sent=100,
                     metric="perplexity")]
    goal, rows = R.summarize(runs, tolerance=5.0)
    assert goal.value == 145.0 and not goal.higher_is_better
    assert [r.time_to_target for r in rows] == pytest.approx([2.4, 1.7, None])  # both after step 8
    markdown = R.write_report(runs, tmp_path, tolerance=5.0).read_text()
    assert "perplexity ≤ 145.00 = `none`'s best 140.00 + tolerance 5" in markdown
    assert table_row(markdown, "fp16") == [
        "`fp16`", "139.00", "139.00", "640.0", "2.00 kB", "1.7 s", "n/a", "n/a"]
    assert table_row(markdown, "sign")[5] == "not reached"


def test_missing_references_read_na(tmp_path, accuracy_runs):
    runs = accuracy_runs[1:3]  # topk and qsgd only: no target, no baseline, no noop line
    goal, rows = R.summarize(runs)
    assert goal is None and all(r.time_to_target is None for r in rows)
    markdown = R.write_report(runs, tmp_path).read_text()
    assert "No target quality" in markdown
    assert table_row(markdown, "qsgd")[5:] == ["n/a", "n/a", "n/a"]
    # a given target still works without references
    goal, rows = R.summarize(runs, target=0.7)
    assert goal.reference is None  # topk: 0.75 after step 6; qsgd: 0.7 after step 8
    assert [r.time_to_target for r in rows] == pytest.approx([1.0 + 5 * 0.1, 1.0 + 7 * 0.125])


def test_runs_without_evaluations_and_duplicates(tmp_path, accuracy_runs):
    bare = Run("topk:ratio=0.01", "mlp", "fashion-mnist", 4, None, 0, accuracy_runs[1].steps)
    runs = [*accuracy_runs, bare]
    assert R.labels(runs)[1] == "topk:ratio=0.01 [workers=2, bandwidth=100mbit]"
    assert R.labels(runs)[-1] == "topk:ratio=0.01 [workers=4, bandwidth=None]"
    assert R.labels([accuracy_runs[0]] * 2) == ["torch-allreduce #1", "torch-allreduce #2"]
    markdown = R.write_report(runs, tmp_path, tolerance=0.04).read_text()
    row = table_row(markdown, "topk:ratio=0.01 [workers=4, bandwidth=None]")
    assert row[1:3] == ["n/a", "n/a"] and row[5] == "n/a" and row[3] == "640.0"
    assert "2, 4 workers, link: 100mbit, loopback" in markdown


def test_mixed_metrics_are_refused(accuracy_runs):
    lm = make_run("none", [200.0], step_s=0.1, bytes_sent=8, metric="perplexity")
    with pytest.raises(ValueError, match="different quality metrics"):
        R.summarize([*accuracy_runs, lm])
    with pytest.raises(ValueError, match="tolerance"):
        R.summarize(accuracy_runs, tolerance=-0.1)
    with pytest.raises(ValueError, match="at least one run"):
        R.summarize([])


def test_runs_of_several_nodes_name_their_hierarchy_and_traffic(tmp_path, accuracy_runs):
    """A run of 2 nodes × 2 workers records its nodes, and per step the bytes sent inside a node and over
    node 0's link; the report names the two-level runs ``SPEC@node`` (its flat twin keeps the spec) and
    shows the traffic columns; a record without these fields (an earlier version's) reads as one node."""
    def on_nodes(run: Run, hierarchy: str | None, intra: int, link: int) -> Run:
        steps = tuple(replace(s, intra_node_bytes=intra, link_bytes=link) for s in run.steps)
        options = {"hierarchy": hierarchy} if hierarchy else {}
        return replace(run, workers=4, nodes=2, steps=steps, info={**run.info, "options": options})

    ref, topk = accuracy_runs[0], accuracy_runs[1]
    runs = [on_nodes(ref, None, 0, 30_000), on_nodes(topk, None, 0, 800),
            on_nodes(replace(topk, compressor="topk:ratio=0.01"), "node", 8000, 400),
            on_nodes(replace(ref, compressor="torch-allreduce"), "node", 0, 30_000)]  # PyTorch's hook: flat
    assert [run.label for run in runs] == ["torch-allreduce", "topk:ratio=0.01", "topk:ratio=0.01@node",
                                           "torch-allreduce"]
    assert runs[2].workers_per_node == 2 and runs[2].hierarchy == "node" and runs[3].hierarchy is None
    assert Run.from_json(runs[2].to_json()) == runs[2]
    old = runs[2].to_dict()
    del old["nodes"]
    for step in old["steps"]:
        del step["intra_node_bytes"], step["link_bytes"]
    assert Run.from_dict({**old, "workers": 4}).nodes == 1 and Run.from_dict(old).link_bytes_per_step is None
    with pytest.raises(ValueError, match="multiple of Run.nodes"):
        replace(runs[2], workers=3)
    markdown = R.write_report(runs[:3], tmp_path, tolerance=0.04).read_text()
    assert "2 nodes × 2 workers, link: 100mbit" in markdown
    assert table_row(markdown, "topk:ratio=0.01@node")[4:7] == ["40 B", "8.00 kB", "400 B"]
    assert table_row(markdown, "topk:ratio=0.01")[4:7] == ["40 B", "0 B", "800 B"]
    assert "intra-node bytes/step" in markdown and "link bytes/step" in markdown
    assert "`@node`: the two-level exchange" in markdown and "node 0 over its emulated link" in markdown
    assert "link bytes/step" not in R.write_report(accuracy_runs, tmp_path, tolerance=0.04).read_text()
    # one level over the emulated network: the link column, and no word of nodes or of `@node`
    one_level = [replace(run, steps=tuple(replace(s, link_bytes=900) for s in run.steps))
                 for run in accuracy_runs]
    markdown = R.write_report(one_level, tmp_path, tolerance=0.04).read_text()
    assert "link bytes/step: what left rank 0's namespace" in markdown
    assert "@node" not in markdown and "intra-node" not in markdown and "between nodes" not in markdown
