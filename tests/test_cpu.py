"""mmcpu.cpu: which CPU a figure came from (the machines of one kind differ), read from /proc/cpuinfo, and how much
of it a process gets (affinity, cgroup quota)."""

from __future__ import annotations

import os

import pytest

from mmcpu import cpu

# First blocks of the three CPUs seen on machines of this kind (flags cut to what matters plus some noise).
INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: something else entirely
"""
AMD_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2 fma avx_vnni
"""
AMD_AVX512 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model name\t: AMD EPYC
flags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16 avx512_vp2intersect
"""


@pytest.mark.parametrize(
    ("text", "isa", "flags"),
    [
        (INTEL, "amx", ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")),
        (AMD_AVX2, "avx2", ("avx2", "fma")),
        (AMD_AVX512, "avx512_bf16", ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16")),
        ("", "baseline", ()),
    ],
)
def test_isa_class_and_flags_from_cpuinfo(text, isa, flags):
    info = cpu.parse_cpuinfo(text, cpus=2)
    assert (info.isa, info.flags) == (isa, flags)
    assert info.as_dict()["isa"] == isa and info.as_dict()["flags"] == list(flags)


def test_first_processor_block_only():
    info = cpu.parse_cpuinfo(INTEL, cpus=2)
    assert info.model == "Intel(R) Xeon(R) Platinum 8488C" and info.family == "6" and info.vendor == "GenuineIntel"
    assert "Platinum 8488C" in info.line() and "isa amx" in info.line() and "2 CPUs" in info.line()


def test_this_machine(tmp_path):
    info = cpu.current()
    assert info.cpus == len(os.sched_getaffinity(0))
    assert info.model != "unknown" and info.flags, "every x86_64 machine of this kind has at least AVX2"
    assert cpu.current(tmp_path / "missing").model == "unknown"  # no cpuinfo (not Linux): no crash


def test_loaded_vllm_c_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    so = "/venv/lib/python3.11/site-packages/vllm/_C_AVX512.abi3.so"
    maps.write_text(
        f"7f00-7f10 r-xp 00000000 08:01 1 {so}\n7f10-7f20 r--p 00000000 08:01 1 {so}\n"
        "7f20-7f30 r-xp 00000000 08:01 2 /usr/lib/libc.so.6\n"
        "7f30-7f40 r-xp 00000000 08:01 3 /venv/lib/python3.11/site-packages/torch/lib/_C.so\n"
    )
    assert cpu.loaded_vllm_c(maps) == ["_C_AVX512.abi3.so"]
    assert cpu.loaded_vllm_c(tmp_path / "none") == []


# --- how much of it: the cgroup's quota and this process's affinity ---------------------------------------------
@pytest.mark.parametrize(
    "files, expected",
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_cpu_quota(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu.cgroup_cpu_quota(tmp_path) == expected


def test_this_process_cpus_are_read():
    cpus = cpu.Cpus.current()
    assert set(cpus.allowed) == os.sched_getaffinity(0) and 1 <= cpus.count <= len(cpus.allowed)
