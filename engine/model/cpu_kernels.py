"""The engine's C++ CPU kernels (engine/model/csrc/), built into one extension on first use.

Ops: ``torch.ops.specplan_attn.paged_attention_cpu`` (engine/model/attention_cpu.py),
``torch.ops.specplan_linear.packed_linear`` (engine/model/linear.py),
``torch.ops.specplan_linear.quant_linear`` (engine/model/linear.py's QuantLinear), the fused per-layer ops
``torch.ops.specplan_ops.*`` (engine/model/layer_ops.py) and ``specplan_ops.decoder_layers``, which
chains them over a model's decoder layers (engine/model/transformer.py). The extension compiles once
(about 20-40 s on 2 cores) and is cached by torch.utils.cpp_extension under
``$SPECPLAN_CACHE/torch_extensions`` when SPECPLAN_CACHE is set, else torch's default extensions
directory (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), one build per Python
environment; later processes only load the cached library. Without a compiler, or with
``SPECPLAN_CPU_KERNELS=0``, ``load`` returns False (one warning) and the engine falls back to torch
ops everywhere.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_attention.cpp", "packed_linear.cpp", "quant_linear.cpp", "fused_ops.cpp",
                         "decoder_layers.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("kernels.h", "team.h", "vec_math.h")]
# Python code that shapes a CPU step's speed beside the kernels (the KV cache's storage order, the
# layer loop): part of build_id, so a profile timed on other code is measured again.
_STEP_SOURCES = [Path(__file__).parent / "transformer.py", Path(__file__).parents[1] / "model_runner.py"]
_lock = threading.Lock()
_loaded: dict[str, bool] = {}  # "ok" once load() has run


def _cpuinfo(field: str) -> str:
    """The first ``field : value`` of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


# How the quantised products ask for the weights they are about to stream (quant_linear.cpp,
# ``kPrefetchBytes`` ahead): "t0" into every cache level, "nta" non-temporal. On AMD Zen a
# non-temporal line is not kept in L2 or the L3 behind it, so the ~96 MB a Q4_1 step streams no
# longer flushes the KV cache from them: SD off at B = 1 ran 1.034x the tokens/s of t0 (16 paired
# rounds, null control 1.003x; 0.99-1.09x over three runs), B = 4 to 32 within the noise (Zen 4
# EPYC, 2026-11-30, reports/weight-prefetch-zen4-s37). On an Intel Xeon it made B = 1 2.5x slower
# (2026-11-29), so other CPUs keep t0. SPECPLAN_WEIGHT_PREFETCH=t0|nta|t1|t2 overrides the choice
# (t1 / t2: into L2 and outward), SPECPLAN_WEIGHT_PREFETCH_BYTES the distance ahead (default 4096), for
# scripts/weight_prefetch_ab.py; neither t1 / t2 nor 8 or 16 KB ahead beat the default beyond the
# noise on the Zen 4 VM (2026-12-01, reports/README.md).
WEIGHT_PREFETCH_HINTS = {"t0": "_MM_HINT_T0", "nta": "_MM_HINT_NTA", "t1": "_MM_HINT_T1", "t2": "_MM_HINT_T2"}


def weight_prefetch() -> str:
    """The weight prefetch hint the kernels are built with here: "nta" on AMD, else "t0"."""
    forced = os.environ.get("SPECPLAN_WEIGHT_PREFETCH")
    if forced:
        if forced not in WEIGHT_PREFETCH_HINTS:
            raise ValueError(f"SPECPLAN_WEIGHT_PREFETCH must be one of {', '.join(WEIGHT_PREFETCH_HINTS)}, "
                             f"got {forced!r}")
        return forced
    return "nta" if _cpuinfo("vendor_id") == "AuthenticAMD" else "t0"


def build_config() -> tuple[str, list[str]]:
    """(extension name, compiler flags) for this CPU: the widest vector ISA it has and the weight
    prefetch hint (``weight_prefetch``), named in the extension (no -march=native, so a cache
    shared between machines never hands one CPU another's instructions)."""
    # -fopenmp: at::parallel_for is header code that only runs threads when _OPENMP is defined;
    # the extension then shares torch's already-loaded libgomp (same soname), i.e. its thread pool.
    # -ffp-contract=fast: a*b+c becomes one FMA (ISO C++ mode would otherwise forbid it).
    # -Wno-psabi: GCC notes that wide vector arguments change ABI without AVX (internal only).
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]
    # -mf16c: the quantised kernels read fp16 block scales (every AVX2 CPU has F16C);
    # avx512vnni: their int8 dot products in one instruction (vpdpbusd) instead of two or three.
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    avx512 = ["-mavx512f", "-mavx512vl", *avx2]
    isa_flags = {"avx512vnni": [*avx512, "-mavx512bw", "-mavx512vnni"], "avx512": avx512, "avx2": avx2, "generic": []}
    cpu = _cpu_flags()
    if {"avx512f", "avx512vl", "avx512bw", "avx512_vnni", "avx2", "fma", "f16c"} <= cpu:
        isa = "avx512vnni"
    elif {"avx512f", "avx512vl", "avx2", "fma", "f16c"} <= cpu:
        isa = "avx512"
    elif {"avx2", "fma", "f16c"} <= cpu:
        isa = "avx2"
    else:
        isa = "generic"
    # SPECPLAN_CPU_ISA=avx512|avx2|generic builds a narrower variant (to test the fallbacks on a wide CPU).
    forced = os.environ.get("SPECPLAN_CPU_ISA")
    if forced:
        order = list(isa_flags)
        if forced not in isa_flags:
            raise ValueError(f"SPECPLAN_CPU_ISA must be one of {', '.join(order)}, got {forced!r}")
        isa = order[max(order.index(forced), order.index(isa))]  # never wider than this CPU
    # The hint is part of the name, so each build is cached apart (the ISA stays last).
    hint = weight_prefetch()
    flags = flags + [f"-DSPECPLAN_WEIGHT_HINT={WEIGHT_PREFETCH_HINTS[hint]}"]
    ahead = os.environ.get("SPECPLAN_WEIGHT_PREFETCH_BYTES")
    tag = ""
    if ahead:
        if not ahead.isdigit() or int(ahead) % 64:
            raise ValueError(f"SPECPLAN_WEIGHT_PREFETCH_BYTES must be a whole number of 64-byte lines, got {ahead!r}")
        flags.append(f"-DSPECPLAN_PREFETCH_BYTES={int(ahead)}")
        tag = f"pf{int(ahead)}_"
    return f"specplan_cpu_kernels_{tag}{'' if hint == 't0' else hint + '_'}{isa}", flags + isa_flags[isa]


def _ops_registered() -> bool:
    try:
        torch.ops.specplan_attn.paged_attention_cpu  # noqa: B018 -- raises if not registered
        torch.ops.specplan_linear.packed_linear  # noqa: B018
        torch.ops.specplan_linear.quant_linear  # noqa: B018
        torch.ops.specplan_ops.silu_mul  # noqa: B018
        torch.ops.specplan_ops.argmax_rows  # noqa: B018
        torch.ops.specplan_ops.decoder_layers  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _compile() -> None:
    if _ops_registered():  # already loaded in this process
        return
    from torch.utils import cpp_extension

    for source in _SOURCES:
        if not source.is_file():
            raise FileNotFoundError(f"kernel source missing: {source}")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    name, cflags = build_config()
    root = (Path(os.environ["SPECPLAN_CACHE"]) / "torch_extensions" if os.environ.get("SPECPLAN_CACHE")
            else Path(cpp_extension.get_default_build_root()))
    # One build per Python environment: two (specplan's own and vLLM's, as the README sets them up)
    # compile against torches in different places, and sharing one directory made each rebuild it
    # (~40 s) whenever the other had run since.
    build_dir = root / f"{name}-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading CPU kernels %s (compiles on first use)", name)
    cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], extra_cflags=cflags,
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
                       verbose=False)
    if not _ops_registered():
        raise RuntimeError(f"extension {name} loaded but its ops are not registered")


def build_id() -> str:
    """What runs a CPU step here: the kernel build and a hash of its sources and of the Python code
    around them ("torch" without the kernels). Profiles record it, so timings measured with other
    code are not reused silently."""
    if not load():
        return "torch"
    files = sorted(_SOURCES + _HEADERS + _STEP_SOURCES)
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:8]
    return f"{build_config()[0].removeprefix('specplan_cpu_kernels_')}-{digest}"


def load() -> bool:
    """Whether the kernels are usable here (compiling them on first use). On failure: one warning,
    False, and callers use torch ops."""
    with _lock:
        if "ok" not in _loaded:
            if os.environ.get("SPECPLAN_CPU_KERNELS", "1") == "0":
                _loaded["ok"] = False
            else:
                try:
                    _compile()
                    _loaded["ok"] = True
                except Exception as e:  # noqa: BLE001 -- any failure means "use torch ops"
                    first = (str(e).strip().splitlines() or [""])[0]
                    warnings.warn(f"specplan: CPU kernels unavailable ({type(e).__name__}: {first}); "
                                  "using torch ops", RuntimeWarning, stacklevel=2)
                    _loaded["ok"] = False
        return _loaded["ok"]
