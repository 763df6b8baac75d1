"""`pdserve profile`, `simulate` and `plan` from the command line, on the real tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.planner.step_model import StepShape, step_model_from_dict


def pdserve(*argv: str, timeout: float = 300) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


WORKLOAD = (
    "--input-len",
    "100",
    "--output-len",
    "20",
    "--num-requests",
    "20",
    "--request-rate",
    "4",
)


@pytest.mark.slow  # the default run is bounded; the planner's logic is unit-tested
def test_an_analytic_profile_simulates_and_plans(stories_path, tmp_path):
    prof = tmp_path / "h100.json"
    text = pdserve("profile", "--model", stories_path, "--analytic", "H100", "--output", str(prof))
    assert "analytic, not measured" in text
    assert json.loads(prof.read_text())["kind"] == "analytic"
    out = tmp_path / "sim.json"
    text = pdserve("simulate", "--profile", str(prof), "--model", stories_path,
                   "--prefill-workers", "1", *WORKLOAD, "--output", str(out))  # fmt: skip
    assert "simulated" in text and "note: analytic profile" in text
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 20 and len(result["requests"]) == 20
    text = pdserve("plan", "--profile", str(prof), "--model", stories_path, "--devices", "2",
                   "--chunk-sizes", "256", *WORKLOAD)  # fmt: skip
    assert "recommended: pdserve serve" in text and "1P+1D" in text


@pytest.mark.slow
def test_a_measured_profile_fits_this_machine(stories_path, tmp_path):
    prof = tmp_path / "stories.json"
    text = pdserve("profile", "--model", stories_path, "--threads", "1", "--repeats", "1",
                   "--output", str(prof))  # fmt: skip
    assert "fit error" in text
    d = json.loads(prof.read_text())
    assert d["kind"] == "measured" and set(d["step_models"]) == {"1"}
    # What a planner needs of it, on a model as small as this one, where noise can move a step's
    # cost between the fit's terms (overhead or per token came out 0 once): every step takes
    # time, and more work takes more
    model = step_model_from_dict(d["step_models"]["1"])
    one, batch = StepShape.of([1], [64], 1), StepShape.of([1] * 32, [512] * 32, 32)
    short, long = StepShape.of([16], [16], 1), StepShape.of([1024], [1024], 1)
    assert 0 < model.predict(one) < model.predict(batch)
    assert 0 < model.predict(short) < model.predict(long)
    assert d["transfers"]["shm"]["bytes_per_s"] > 0
    # what an idle stretch adds to the step after it, at each measured stretch
    wake = d["wake"]["1"]
    assert [g for g, _ in wake] == [0.1, 0.5, 2.0] and all(x >= 0 for _, x in wake)
    assert "s idle +" in d["notes"][0]
    # the serving costs: the factors, a split server's decode factor where there are two CPUs
    serving = d["serving"]
    assert serving["decode_step_factor"] > 0 and serving["prefill_step_factor"] > 0
    # the time outside the engine alone and under the load's streams
    assert serving["frontend_latency_alone_s"] > 0 and serving["latency_streams"] == 6
    # a first token's time outside its prompt step, from the server's step-time histogram
    assert isinstance(serving["first_token_extra_s"], float)
    if len(os.sched_getaffinity(0)) >= 2:
        assert serving["part_cpus"] >= 1 and serving["part_decode_step_factor"] > 0
        assert any(len(s) == 4 for s in serving["part_calibration_steps"])  # paired in time
        # the split's prefill worker: its own prompt steps against the same ones in-process
        assert serving["part_prefill_step_factor"] > 0 and serving["part_prompt_steps"]
        assert any("the calibration's in-process decode steps took x" in n for n in d["notes"])
    # it keeps the steps it measured, and a refit fits them again without measuring
    assert len(d["samples"]["1"]) > 100
    again = tmp_path / "again.json"
    text = pdserve("profile", "--model", stories_path, "--refit", str(prof), "--no-decode-split",
                   "--output", str(again))  # fmt: skip
    assert "steps refitted (no split)" in text
    refitted = json.loads(again.read_text())
    assert refitted["samples"] == d["samples"] and "wide_decode" not in refitted["step_models"]["1"]
    assert refitted["wake"] == d["wake"]
    assert "refitted, 1 thread(s): fit error" in refitted["notes"][-1]
    # anchored to the machine's speed of the moment by a probe of the same engine
    anchored = tmp_path / "anchored.json"
    text = pdserve("profile", "--model", stories_path, "--anchor", str(prof),
                   "--output", str(anchored))  # fmt: skip
    assert "1 thread(s):" in text and "probe steps at x" in text
    a = json.loads(anchored.read_text())
    assert a["step_models"] == d["step_models"] and a["samples"] == d["samples"]
    anchor = a["anchors"]["1"]
    assert anchor["decode"] > 0 and anchor["prefill"] > 0 and anchor["when"]
    assert {len(q) > 1 for q, *_ in anchor["steps"]} == {True, False}  # decode batches, prompts
    # not with another engine than the one measured
    other = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "profile", "--model", stories_path, "--anchor",
         str(prof), "--linear-backend", "torch", "--output", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert other.returncode != 0 and "anchor it with the engine flags" in other.stderr
    # a simulation with it draws step-time noise from the kept steps: the same for a seed
    runs = {}
    for name, flags in (("a", []), ("b", []), ("quiet", ["--no-step-noise"])):
        out = tmp_path / f"sim-{name}.json"
        pdserve("simulate", "--profile", str(prof), "--model", stories_path,
                *WORKLOAD, *flags, "--output", str(out))  # fmt: skip
        result = json.loads(out.read_text())
        assert result["summary"]["completed"] == 20
        runs[name] = [r["token_times"] for r in result["requests"]]
    assert runs["a"] == runs["b"] != runs["quiet"]
    # a speed trace of the same engine, added to an anchored copy: decode probes against the fit
    traced = tmp_path / "traced.json"
    text = pdserve("profile", "--model", stories_path, "--anchor", str(prof),
                   "--speed-trace", "3", "--output", str(traced))  # fmt: skip
    assert "speed trace" in text and "probes over" in text
    t = json.loads(traced.read_text())
    points = t["speed"]["1"]
    assert len(points) >= 3 and all(r > 0 for _, r in points)
    assert [p[0] for p in points] == sorted(p[0] for p in points) and points[-1][0] <= 3.5
    assert any(n.startswith("speed trace, 1 thread(s):") for n in t["notes"])
    # simulated along it: the same for a seed, not the same without it
    runs = {}
    for name, flags in (("a", []), ("b", []), ("off", ["--no-speed-trace"])):
        out = tmp_path / f"traced-{name}.json"
        pdserve("simulate", "--profile", str(traced), "--model", stories_path, "--no-step-noise",
                *WORKLOAD, *flags, "--output", str(out))  # fmt: skip
        result = json.loads(out.read_text())
        assert result["simulation"]["speed_trace"] == (name != "off")
        runs[name] = [r["token_times"] for r in result["requests"]]
    assert runs["a"] == runs["b"] != runs["off"]
