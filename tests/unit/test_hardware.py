"""Hardware profiles: quick CPU measurement, JSON round trip, cache location, GPU datasheets."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.cli import main
from pdserve.perf import hardware
from pdserve.perf.hardware import (
    HardwareProfile,
    cached_hardware_profile,
    datasheet_profile,
    load_hardware_profile,
    measure_cpu_profile,
)

FAST = dict(dtypes=("float32",), seconds=0.05, copy_bytes=4 * 2**20)


def make_profile(**overrides) -> HardwareProfile:
    fields = dict(
        name=hardware.cpu_name(),
        peak_flops={"float32": 1e11, "bfloat16": 2e11},
        mem_bandwidth_bytes_s=2e10,
        copy_bandwidth_bytes_s=3e10,
    )
    return HardwareProfile(**(fields | overrides))


@pytest.fixture
def fast_measure(monkeypatch):
    """Make every measurement quick and count the calls."""
    calls = []
    real = hardware.measure_cpu_profile

    def measure(**kwargs):
        calls.append(kwargs)
        return real(**FAST)

    monkeypatch.setattr(hardware, "measure_cpu_profile", measure)
    return calls


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """The default cache under a temporary home; no environment override."""
    monkeypatch.setattr(hardware, "DEFAULT_PATH", tmp_path / "home" / "hardware.json")
    monkeypatch.delenv(hardware.ENV_VAR, raising=False)
    return tmp_path / "home" / "hardware.json"


def test_quick_measurement_gives_positive_figures():
    profile = measure_cpu_profile(**FAST)
    assert profile.peak_flops_for("float32") > 0
    assert profile.peak_flops_for(torch.float32) == profile.peak_flops["float32"]
    assert profile.mem_bandwidth_bytes_s > 0 and profile.copy_bandwidth_bytes_s > 0
    assert profile.source == "measured"
    assert f"{torch.get_num_threads()} threads" in profile.name


def test_json_round_trip(tmp_path):
    profile = make_profile()
    assert HardwareProfile.from_json(profile.to_json()) == profile
    assert HardwareProfile.load(profile.save(tmp_path / "sub" / "p.json")) == profile


def test_missing_dtype_and_bad_files_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="float16"):
        make_profile().peak_flops_for("float16")
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="bad.json"):
        HardwareProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="mem_bandwidth_bytes_s"):
        make_profile(mem_bandwidth_bytes_s=0)


def test_load_measures_once_then_uses_the_cache(isolated_cache, fast_measure):
    first = load_hardware_profile()
    assert len(fast_measure) == 1 and isolated_cache.is_file()
    assert load_hardware_profile() == first
    assert len(fast_measure) == 1
    load_hardware_profile(force=True)
    assert len(fast_measure) == 2


def test_cached_file_from_another_cpu_is_measured_again(isolated_cache, fast_measure):
    make_profile(name="some other CPU (64 threads)").save(isolated_cache)
    assert cached_hardware_profile() is None
    assert load_hardware_profile().name == hardware.cpu_name()
    assert len(fast_measure) == 1


def test_explicit_path_and_env_are_used_as_they_are(tmp_path, monkeypatch, fast_measure):
    planned = make_profile(name="NVIDIA H100 SXM (planning)")
    path = planned.save(tmp_path / "given.json")
    assert load_hardware_profile(path) == planned
    monkeypatch.setenv(hardware.ENV_VAR, str(path))
    assert load_hardware_profile() == planned
    assert cached_hardware_profile(device="cpu") == planned
    assert not fast_measure


def test_missing_explicit_path_is_measured_into(tmp_path, isolated_cache, fast_measure):
    target = tmp_path / "new.json"
    assert cached_hardware_profile(target) is None
    profile = load_hardware_profile(target)
    assert HardwareProfile.load(target) == profile
    assert not isolated_cache.exists()


@pytest.mark.parametrize(
    ("device_name", "label", "bf16_tflops", "bandwidth_gb_s"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 3350),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756, 2000),
        ("NVIDIA H200", "H200", 989.4, 4800),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 312, 2039),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312, 1555),
        ("NVIDIA L4", "L4", 121, 300),
        ("NVIDIA L40S", "L40S", 362.1, 864),
        ("NVIDIA A10G", "A10G", 125, 600),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2, 1008),
    ],
)
def test_datasheet_lookup(device_name, label, bf16_tflops, bandwidth_gb_s):
    profile = datasheet_profile(device_name)
    assert label in profile.name and profile.source == "datasheet"
    assert profile.peak_flops_for("bfloat16") == pytest.approx(bf16_tflops * 1e12)
    assert profile.mem_bandwidth_bytes_s == pytest.approx(bandwidth_gb_s * 1e9)
    assert profile.peak_flops_for("float32") < profile.peak_flops_for("float16")


def test_unknown_gpu_raises_value_error_listing_known():
    with pytest.raises(ValueError, match="'Voodoo 3'.*H200"):
        datasheet_profile("Voodoo 3")


def test_cli_prints_the_profile(tmp_path, capsys):
    out = tmp_path / "hw.json"
    make_profile().save(out)
    assert main(["profile-hardware", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TFLOP/s" in printed and "GB/s" in printed and str(out) in printed


def test_the_cache_keeps_one_measurement_per_thread_count(isolated_cache, fast_measure):
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = load_hardware_profile()
        torch.set_num_threads(2)
        two = load_hardware_profile()
        assert len(fast_measure) == 2
        assert cached_hardware_profile(threads=1) == one
        assert cached_hardware_profile(threads=2) == two
        assert [p.name for p in hardware.read_cache(isolated_cache)] == [one.name, two.name]
    finally:
        torch.set_num_threads(torch_threads)


def test_a_thread_count_never_measured_is_scaled_from_the_nearest(isolated_cache):
    hardware.write_cache(isolated_cache, make_profile(name=hardware.cpu_name(2)))
    four = cached_hardware_profile(threads=4)
    assert four.name == hardware.cpu_name(4) and "scaled" in four.source
    assert four.peak_flops == {"float32": 2e11, "bfloat16": 4e11}
    assert four.mem_bandwidth_bytes_s == 2e10  # bandwidth is not scaled up


def test_an_old_single_profile_cache_is_still_read(isolated_cache):
    make_profile(name=hardware.cpu_name(3)).save(isolated_cache)
    assert cached_hardware_profile(threads=3).name == hardware.cpu_name(3)


def test_cli_measures_each_thread_count(capsys, fast_measure, isolated_cache):
    assert main(["profile-hardware", "--threads", "1,2", "--seconds", "0.1"]) == 0
    assert len(fast_measure) == 2 and len(hardware.read_cache(isolated_cache)) == 2
    assert main(["profile-hardware", "--threads", "x"]) == 2


def test_the_read_roofline_also_reads_from_huge_pages(monkeypatch):
    """The native kernels stream weights that live on huge pages, so the roofline times a read
    of a huge-page copy too, whether or not the engine is told to use them."""
    from pdserve.kernels import huge_pages, memory

    if not memory.available()[0] or not huge_pages.supported():
        pytest.skip("needs the native kernels and transparent huge pages")
    monkeypatch.setenv(huge_pages.ENV_VAR, "0")
    src = torch.ones(1 << 20)
    reads = hardware._native_reads(src)
    assert len(reads) == 2
    read = {}
    monkeypatch.setattr(memory, "read_sum", lambda x: read.setdefault("ptr", x.data_ptr()))
    reads[1]()
    assert read["ptr"] != src.data_ptr() and read["ptr"] % huge_pages.HUGE_PAGE == 0
