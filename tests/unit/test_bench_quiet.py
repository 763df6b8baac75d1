"""The benchmarks' wait for a quiet CPU (benchmarks/lib/quiet.py) does not wait on itself."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_shell_that_started_a_benchmark_is_not_another_benchmark():
    # the shell's command line matches the pattern, as `bash -c "pdserve profile ... && python
    # bench.py"` matches "pdserve"; a matching process beside the shell still counts
    probe = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); "
        "from lib.quiet import busy_processes; print(busy_processes('pdserve_quiet_probe'))"
    )
    # (a command after the probe, so that bash waits on it instead of exec-ing it)
    script = f'{sys.executable} -c "{probe}"; rc=$?; : pdserve_quiet_probe; exit $rc'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

    other = subprocess.Popen(["bash", "-c", "exec -a pdserve_quiet_probe sleep 30"])
    try:
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
        assert "pdserve_quiet_probe" in out.stdout and str(other.pid) in out.stdout
    finally:
        other.kill()
        other.wait()
