"""Which CPU code paths this machine can take, for the tests that need one (the golden comparisons).

The suite itself runs with the CPU's own kernels; a test that must reproduce a recording made on another kind of CPU
sets the libraries' ISA settings for a process of its own (they are read once, at the first use of each library).
What each setting does, from torch 2.13's source:

* ``ATEN_CPU_CAPABILITY=avx2``: ATen's own vectorised kernels (norms, softmax, elementwise) in 8-float lanes; on an
  AVX-512 CPU the default is 16 lanes, whose reductions round differently.
* ``ONEDNN_MAX_CPU_ISA``: the oneDNN kernels (bf16 and int8 matmuls).  It also decides whether torch's bf16 CPU
  attention packs its blocks for AMX (``cpublas::could_pack`` asks oneDNN's effective ISA); the packing routine exists
  only in ATen's AVX-512 build of the kernel, so ``ATEN_CPU_CAPABILITY=avx2`` on an AMX CPU with oneDNN uncapped
  raises "pack_vnni2 is only supported when avx512 is supported".
* ``MKL_CBWR=AVX2``: MKL's fp32 GEMMs take their AVX2 code branch.  That branch is reproducible among CPUs of one
  vendor only: on an Intel CPU (Xeon, AVX-512 + AMX) its fp32 GEMMs differ from the recording's by 6e-8, under every
  ``MKL_CBWR`` / ``MKL_ENABLE_INSTRUCTIONS`` value (measured).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

#: The capability the golden tensors were recorded with (``provenance.cpu_capability`` of every golden file).
GOLDEN_CAPABILITY = "AVX2"
#: The CPU vendor of the recording machine (an AMD EPYC): MKL's fp32 GEMM branches are reproducible within a vendor.
GOLDEN_CPU_VENDOR = "AuthenticAMD"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_vendor() -> str:
    """``vendor_id`` of ``/proc/cpuinfo`` ("GenuineIntel", "AuthenticAMD"; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith("vendor_id")), "")
    return line.partition(":")[2].strip()


def has_avx2() -> bool:
    return torch.cpu._is_avx2_supported() or "avx2" in cpu_flags()


def has_amx() -> bool:
    """AMX tiles (bf16/int8): where oneDNN, uncapped, packs bf16 attention blocks."""
    return torch.cpu._is_amx_tile_supported() or bool({"amx_tile", "amx_bf16"} & cpu_flags())


def golden_env(onednn_isa: str | None) -> dict[str, str]:
    """The ISA settings of a process that reproduces the golden recording (``onednn_isa``: the oneDNN cap, or None
    for the CPU's best)."""
    env = {"ATEN_CPU_CAPABILITY": GOLDEN_CAPABILITY.lower(), "MKL_CBWR": GOLDEN_CAPABILITY}
    if onednn_isa:
        env["ONEDNN_MAX_CPU_ISA"] = onednn_isa
    return env


def golden_refusal(onednn_isa: str | None, bf16_attention: bool, mkl_gemms: bool = False) -> str | None:
    """Why the golden recording's code path cannot run here (None when it can); ``mkl_gemms``: the case's GEMMs are
    MKL's fp32 ones."""
    if not has_avx2():
        return (f"the golden tensors were recorded with ATen's {GOLDEN_CAPABILITY} kernels and this CPU has no AVX2 "
                f"(capability {torch.backends.cpu.get_cpu_capability()})")
    if bf16_attention and onednn_isa is None and has_amx():
        return ("ATEN_CPU_CAPABILITY=avx2 crashes torch's bf16 CPU attention on this AMX CPU (its AMX packing exists "
                "only in the AVX-512 build), and this recording's int8 GEMMs need oneDNN uncapped (a cap below AMX, "
                "which would avoid the crash, is not the path it was recorded with)")
    if mkl_gemms and cpu_vendor() != GOLDEN_CPU_VENDOR:
        return (f"MKL's fp32 GEMMs round differently on this {cpu_vendor() or 'unknown'} CPU than on the "
                f"{GOLDEN_CPU_VENDOR} CPU the recording was made on (MKL_CBWR reproduces a branch within one vendor); "
                "the real-ComfyUI parity tests compare with ComfyUI's own fp32 blocks on this CPU instead")
    return None
