"""Which Inductor options a job may set on a target (or an autotune candidate).

Pure logic, no torch: the job spec checks every target with it as the job loads, on the client
and again in the service. Inductor's options include programs, flags, files, directories and
libraries (`cpp.cxx`, `aot_inductor.custom_op_libs`, `aot_inductor.output_path`,
`trace.debug_dir`, ...). Set by a job, they would run what the job names inside the sandbox,
or write where the job says: into the node's Inductor cache that later jobs' children build
with (see the README's jail section). A job may set tuning knobs only:

- any public option to a number, a boolean or null (a number names no program or file);
- the few options whose values are words, to a value of their word list below (a string goes
  into g++'s command line or picks an implementation, so it is matched whole);
- nothing that the target itself sets: the ISA (`cpp.march`, `cpp.simdlen`) comes from the
  target's name (`aoti-cpu:avx512`), and the kernels' thread count is decided at run time.

Options that Inductor does not know still fail in the unit, with Inductor's own message.
"""
from __future__ import annotations

import re
from typing import Any

# Options whose value is a word, and the words each may take (matched whole).
WORD_OPTIONS: dict[str, re.Pattern[str]] = {
    "max_autotune_gemm_backends": re.compile(r"[A-Z]+(,[A-Z]+)*"),
    "max_autotune_conv_backends": re.compile(r"[A-Z]+(,[A-Z]+)*"),
    "max_autotune_gemm_search_space": re.compile(r"[A-Z_]+"),
    "max_autotune_flex_search_space": re.compile(r"[A-Z_]+"),
    "aot_inductor.compile_wrapper_opt_level": re.compile(r"O[0-3sgz]?|Ofast"),
    "cpp.descriptive_names": re.compile(r"torch|original_aten|inductor_node"),
    "triton.descriptive_names": re.compile(r"torch|original_aten|inductor_node"),
}
# Set by the target, never by its options (workers/backends/cpu_isa.py).
TARGET_SETS = {"cpp.march": "the target's ISA", "cpp.simdlen": "the target's ISA",
               "cpp.dynamic_threads": "the farm (kernels ask OpenMP for threads at run time)"}


def option_problem(name: str, value: Any) -> str | None:
    """Why a job may not set Inductor option `name` to `value`, or None if it may."""
    if not isinstance(name, str) or not name or any(not part or part.startswith("_") for part in name.split(".")):
        return "is not a public Inductor option (a dotted name whose parts do not start with '_')"
    if name in TARGET_SETS:
        return (f"is set by {TARGET_SETS[name]}, not by options; name the ISA in the target instead "
                "(aoti-cpu:avx2, aoti-cpu:avx512, aoti-cpu:x86-64)")
    if value is None or isinstance(value, (bool, int, float)):
        return None
    if isinstance(value, str) and name in WORD_OPTIONS:
        if WORD_OPTIONS[name].fullmatch(value):
            return None
        return f"must match {WORD_OPTIONS[name].pattern!r}, got {value!r}"
    return (f"may only be a number, a boolean or null (got {type(value).__name__} {value!r}): options that name "
            "programs, flags, files, directories or libraries are the farm's to set (CXX and the like on its "
            f"workers), not a job's; word-valued options a job may set: {', '.join(sorted(WORD_OPTIONS))}")


def options_problems(options: dict[str, Any]) -> list[str]:
    """Every refused option of one target or candidate, as `name: why`."""
    return [f"{name}: {problem}" for name, value in options.items() if (problem := option_problem(name, value))]
