"""Pieces the benchmark scripts share: measuring on a shared CPU, /proc accounting, a `pdserve
serve` subprocess, the engine benchmark's model, roofline, Hugging Face baseline and step timer,
two checkouts alternated in fresh processes, and each script's report.

The scripts run as `python benchmarks/X.py`, which puts `benchmarks/` first on `sys.path`, so
they import this package as `lib`.

- `paths`: the checkout, the shared models and traces, the random llama-125m's folder;
- `quiet`: keeping out of other processes' way (foreign CPU time, retries; other benchmarks);
- `procstat`: CPU time of processes, threads and the machine, from /proc;
- `machine`: what machine and which pdserve a result came from;
- `server`: `pdserve serve` as a subprocess, its /metrics, requests from `pdserve bench`'s code;
- `tables`: number formatting and plain-text tables;
- `engine_common`, `roofline`, `hf_baseline`, `step_timer`, `engine_report`: engine_bench.py
  (the first also for engine_whatif.py and profile_step.py);
- `serving_latency`, `serving_ceiling`: the two parts of serving_bench.py;
- `disagg_analysis`: disagg_bench.py's figures and report.
"""
