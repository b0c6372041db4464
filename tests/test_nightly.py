"""Nightly zoo runs: a team's suite run twice on the test cluster (night 2 changes one entry,
which compiles again, and breaks another), the history read back three ways, the report opened
in a real headless browser, and the Hugging Face entries exported as the zoo promises.

Whether a compile reads as slower must not depend on this machine's speed (two real compiles
differ by 20% from run to run here): between the nights the test writes night 1's figures for the
changed entry into the history, a compile of 0.1 s at a 0.01x speedup, so night 2's real compile
is a compile-time regression by construction and cannot be a speedup regression. The rules
themselves are tested on their own in tests/test_regressions.py."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from storage import store_from_uri
from storage.history import read_history

pytestmark = pytest.mark.slow
SUITE = Path(__file__).parent / "fixtures" / "team_zoo.py"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def two_nights(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("nightly")
    suite, store, report = root / "team_zoo.py", root / "store", root / "report.html"
    runs = []
    for night, date in ((1, "2026-11-21"), (2, "2026-11-22")):
        suite.write_text(SUITE.read_text().replace("NIGHT = 1", f"NIGHT = {night}"))
        runs.append(subprocess.run(
            [sys.executable, "-m", "farm", "zoo", "run", "--suite", str(suite), "--store", str(store),
             "--address", ray_cluster.address, "--report", str(report), "--date", date],
            capture_output=True, text=True, timeout=900))
        if night == 1:
            _record_night_one_as_fast(store / "history" / f"date={date}", "deep")
    return store, report, runs


def _record_night_one_as_fast(partition: Path, model: str) -> None:
    """Rewrite night 1's history file (the test's own local store) with the figures the test controls."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (path,) = partition.glob("*.parquet")
    table = pq.read_table(path)
    rows = table.to_pylist()
    assert any(r["model"] == model and r["compile_s"] for r in rows), rows  # it ran: a real figure to replace
    for r in rows:
        if r["model"] == model:
            r.update(compile_s=0.1, speedup=0.01)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


def test_second_night_reports_the_slower_and_the_broken_entry_and_exits_non_zero(two_nights):
    _, _, (first, second) = two_nights
    assert first.returncode == 0, first.stdout + first.stderr
    assert "no regressions" in first.stdout
    assert second.returncode == 1, second.stdout + second.stderr
    out = " ".join((second.stdout + second.stderr).split())  # regressions go to stderr, with the errors
    assert "2 regression(s)" in out
    assert "broken · aoti-cpu: new failure: passed last run; now fails in export" in out
    assert "a config change broke this model" in out
    assert "deep · aoti-cpu: compile time: 0.1 s ->" in out
    assert "steady" not in out.split("regression(s)")[1]  # unchanged: a hit, not a regression


def test_a_nights_jobs_run_one_after_another_on_the_workers_of_the_first(two_nights):
    """Without a farm service a night's groups are jobs run in turn: the later ones take the
    workers the first left (the same processes), instead of starting their own."""
    from storage.results import read_results

    store, _, _ = two_nights
    store = store_from_uri(str(store))
    for run_id, jobs in _jobs_by_run(read_history(store).to_pylist()).items():
        workers = [{r["worker"] for r in read_results(store, job_id)} for job_id in jobs]
        assert len(workers) == 2 and all(workers) and None not in workers[0], (run_id, workers)
        assert workers[1] <= workers[0], (run_id, workers)


def _jobs_by_run(rows: list[dict]) -> dict[str, list[str]]:
    """Each run's job ids, in the order the run submitted them (`<run id>-<n>-<time>-<hex>`)."""
    jobs: dict[str, set[str]] = {}
    for r in rows:
        if r["job_id"]:
            jobs.setdefault(r["run_id"], set()).add(r["job_id"])
    return {run: sorted(ids, key=lambda j: int(j[len(run) + 1:].split("-", 1)[0])) for run, ids in jobs.items()}


def test_history_is_parquet_by_date_and_reads_back_with_pyarrow_pandas_and_duckdb(two_nights):
    import duckdb
    import pandas as pd
    import pyarrow.dataset as ds

    store, _, _ = two_nights
    folder = store / "history"
    assert sorted(p.name for p in folder.iterdir()) == ["date=2026-11-21", "date=2026-11-22"]
    table = ds.dataset(folder, format="parquet", partitioning="hive").to_table()
    assert table.num_rows == 8
    frame = pd.read_parquet(folder)
    train = frame[frame["mode"] == "train"].sort_values("date")
    assert list(train["model"]) == ["steady", "steady"] and list(train["target"]) == ["inductor-cache:avx2+train"] * 2
    assert list(train["status"]) == ["compiled", "hit"]  # a training step, compiled once
    assert (train["saved_activation_bytes"] > 0).all() and (train["speedup"] > 0).all() and (train["compile_s"] > 0).all()
    frame = frame[frame["mode"] == "inference"]
    night2 = frame[frame["date"].astype(str) == "2026-11-22"].set_index("model")
    assert night2.loc["broken", "status"] == "failed" and night2.loc["broken", "failed_phase"] == "export"
    assert night2.loc["steady", "status"] == "hit" and night2.loc["steady", "hit"]
    assert night2.loc["deep", "status"] == "compiled" and night2.loc["deep", "torch"].startswith("2.")
    assert night2.loc["deep", "speedup"] > 0 and night2.loc["deep", "artifact_bytes"] > 0
    counts = duckdb.sql(f"select date, count(*), count(*) filter (where status = 'failed') "
                        f"from read_parquet('{folder}/*/*.parquet', hive_partitioning=true) "
                        f"group by date order by date").fetchall()
    assert [(str(d), n, f) for d, n, f in counts] == [("2026-11-21", 4, 0), ("2026-11-22", 4, 1)]
    # the store's own reader agrees, with the same columns
    rows = read_history(store_from_uri(str(store))).to_pylist()
    assert len(rows) == 8 and {r["date"] for r in rows} == {"2026-11-21", "2026-11-22"}


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (./dev test installs it)")
def test_report_renders_its_plots_offline_in_a_headless_browser(two_nights, tmp_path):
    from PIL import Image

    store, _, _ = two_nights
    report = tmp_path / "report.html"
    regenerated = subprocess.run([sys.executable, "-m", "farm", "zoo", "report", "--store", str(store),
                                  "--report", str(report)], capture_output=True, text=True, timeout=300)
    assert regenerated.returncode == 0 and "(2 runs)" in regenerated.stdout, regenerated.stdout + regenerated.stderr
    assert "<script src=" not in report.read_text()  # nothing to fetch: plotly.js is inside
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000"]
    dom = subprocess.run([*flags, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert dom.count('class="main-svg"') >= 10, "plotly drew fewer than 5 plots"  # two SVG layers per plot
    for text in ("Pass rate per target", "Compile time per model", "Speedup over eager", "Cache hit rate",
                 "2 regressions in", "compile time", "activations saved for backward", "saved for backward"):
        assert text in dom, text
    shot = tmp_path / "report.png"
    subprocess.run([*flags, "--window-size=1400,1300", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, timeout=120)
    pixels = Image.open(shot).convert("RGB").getdata()
    # what a person sees: plotted lines and bars in plotly's trace colours, and the regressions in red
    traces = sum(1 for p in pixels if abs(p[0] - 99) < 20 and abs(p[1] - 110) < 20 and abs(p[2] - 250) < 20)
    compile_up = sum(1 for p in pixels if p[0] > 220 and 70 < p[1] < 110 and 40 < p[2] < 90)  # #EF553B
    alarm = sum(1 for p in pixels if 150 < p[0] < 200 and p[1] < 30 and p[2] < 60)  # #b00020
    assert traces > 2000 and compile_up > 100 and alarm > 100, (traces, compile_up, alarm)


def test_hugging_face_entries_export_with_dynamic_batch_and_sequence():
    pytest.importorskip("transformers")
    import torch

    from farm.zoo import SUITES, ZOO, export_entry

    assert {"bert", "gpt2", "llama", "t5_encoder", "vit", "mixtral_moe"} <= {n.removeprefix("hf_") for n in SUITES["hf"]}
    for name in SUITES["hf"]:
        entry = ZOO[name]
        assert entry.needs == ("transformers",) and "transformers.modeling_outputs" in entry.modules
        ep = export_entry(entry)
        dims = {str(s) for s in ep.range_constraints}
        text = name != "hf_vit"
        assert len(dims) == (2 if text else 1), (name, ep.range_constraints)  # batch, and sequence for text
        args, kwargs = entry.example()
        torch.testing.assert_close(ep.module()(*args, **kwargs), entry_output(entry, args, kwargs))


def entry_output(entry, args, kwargs):
    import torch

    torch.manual_seed(0)
    model = entry.build().eval()
    with torch.no_grad():
        return model(*args, **kwargs)


def test_a_report_or_an_export_where_nothing_can_be_written_is_said_in_a_line(two_nights, tmp_path):
    from tests.cli import farm

    store, _, _ = two_nights
    (tmp_path / "a-file").write_text("")
    for args, where in ((["zoo", "report", "--store", str(store), "--report", str(tmp_path / "a-file" / "r.html")],
                         tmp_path / "a-file" / "r.html"),
                        (["zoo", "export", str(tmp_path / "a-file" / "zoo")], tmp_path / "a-file" / "zoo")):
        said = farm(*args)
        assert f"cannot write {where}: " in said and "Traceback" not in said, said
