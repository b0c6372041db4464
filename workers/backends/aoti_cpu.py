"""AOTInductor for CPU, pinned to an x86 ISA so the package runs on every host of that ISA.

The package records its ISA (AOTI_CPU_ISA); at load a mismatch is only a warning in torch,
so `load` enforces it.

Weights: with `weights: values` they are packaged and the key hashes their values. With
`weights: shapes` the generated code must not depend on them: constants are kept out of the
.so, and `always_keep_tensor_constants` stops Inductor from inlining small ones (0-d, or
1-d with ≤ 8 elements) as literals. The package still carries the weights it was built with
(`binary_blob`, so `aoti_load_package` loads them by itself), and another checkpoint of the
same architecture is swapped in with `load_constants`.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from workers.backends import cpu_isa
from workers.backends.base import LoweringError
from workers.unit import Target

if TYPE_CHECKING:  # torch is the sandbox child's; the worker that plans and keys never imports it
    import torch
    from torch.export import ExportedProgram

WEIGHTS_OUT_OF_CODE = {
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
}


def compile_and_package(ep: ExportedProgram, workdir: Path, configs: dict[str, Any]) -> Path:
    """`aoti_compile_and_package`, with the generated sources and .so written to this lowering's
    own directory. By default they go to a directory of the shared Inductor cache named by the
    generated code, rewritten in place (under Inductor's lock) by every compile of the same code
    and packaged after that lock is let go: two workers lowering the same code at once packaged
    each other's half-written files (an empty wrapper_metadata.json was seen). Nothing there is
    reused: the .so is rebuilt on every compile, so a private directory costs nothing."""
    import torch
    from torch._inductor.package import package_aoti

    generated = workdir / "aoti-generated"
    generated.mkdir()
    args, kwargs = ep.example_inputs
    with same_path_every_time(generated) as path:
        options = {**configs, "aot_inductor.package": True, "aot_inductor.output_path": str(path)}
        files = torch._inductor.aot_compile(ep.module(check_guards=False), args, kwargs, options=options)
        return Path(package_aoti(str(workdir / "artifact.pt2"), files))


@contextlib.contextmanager
def same_path_every_time(generated: Path) -> Iterator[Path]:
    """Where Inductor is told to write `generated`: in a jail, a link at one path of the child's
    private /tmp (one child at a time has it), so that every lowering names the same dir. The
    kernels' source quotes that dir (a comment naming the wrapper, and the compile commands), and
    with one name the same code is the same source, which the node's compiler cache then serves
    (workers/sandbox/compiler_cache.py). Unjailed, /tmp is shared: the dir itself."""
    tmp = os.environ.get("FARM_JAIL_TMP")
    if not tmp:
        yield generated
        return
    link = Path(tmp) / "aoti-generated"
    link.unlink(missing_ok=True)
    link.symlink_to(generated, target_is_directory=True)
    try:
        yield link
    finally:
        link.unlink(missing_ok=True)


def package_metadata(artifact: Path) -> dict[str, str]:
    import torch

    return dict(torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(str(artifact), "model"))


def program_constants(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """Every weight, buffer and constant of a program by the name AOTInductor gives it."""
    import torch

    return {k: v for k, v in {**ep.state_dict, **ep.constants}.items() if isinstance(v, torch.Tensor)}


def aoti_load(artifact: Path) -> Any:
    """torch's `aoti_load_package`, with Inductor seeing the host's vector ISAs from the host's
    record. The loader asks Inductor for them (get_device_information, on every device), which
    builds a probe per ISA in the process's Inductor cache and loads each in a fresh Python: a
    jailed child's cache is not where its node probed, so a worker's first load built 5 probes
    (4 s here), and every later process still loaded them (0.65 s)."""
    import torch

    with cpu_isa.vec_isas_from_host_record():
        return torch._inductor.aoti_load_package(str(artifact))


def load_with_weights(artifact: Path, constants: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """Load a `weights: shapes` package and swap in another checkpoint's weights."""
    model = aoti_load(artifact)
    needed = model.get_constant_fqns()
    missing = sorted(set(needed) - set(constants))
    if missing:
        raise LoweringError(f"{artifact} needs weights this checkpoint lacks: {', '.join(missing[:5])}")
    model.load_constants({k: constants[k] for k in needed}, check_full_update=True)
    return model


def load_package(artifact: Path, target: Target, ep: ExportedProgram | None) -> Callable[..., Any]:
    """The package's model; under `weights: shapes`, running with ep's weights."""
    if target.weights == "shapes" and ep is not None:
        return load_with_weights(artifact, program_constants(ep))
    return aoti_load(artifact)


def weights_facts(target: Target) -> dict[str, str]:
    """How to load a `weights: shapes` package with another checkpoint (for the manifest)."""
    if target.weights != "shapes":
        return {}
    return {"load_other_weights": "farm.client.load_compiled(PATH, weights_from='checkpoint.pt2')"}


class AotiCpu(cpu_isa.PinnedCpuTarget):
    name = "aoti-cpu"
    weights_in_code = False  # see the module doc: `weights: shapes` keeps them out

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        name, isa = self.isa(target)
        configs = {**target.options_dict, **isa.inductor_configs}
        if target.weights == "shapes":
            configs.update(WEIGHTS_OUT_OF_CODE)
        with cpu_isa.only_vec_isa(isa.vec_isa):
            path = compile_and_package(ep, workdir, configs)
        recorded = package_metadata(path).get("AOTI_CPU_ISA", "")
        if recorded != isa.recorded:
            raise LoweringError(f"asked for {name} but the package records ISA {recorded!r}; not publishing it")
        return path

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        recorded = package_metadata(artifact).get("AOTI_CPU_ISA", "")
        needed = next((i for i in cpu_isa.ISAS.values() if i.recorded == recorded), None)
        if needed is None:
            raise LoweringError(f"{artifact} records an unknown CPU ISA {recorded!r}")
        if needed.vec_isa and needed.vec_isa not in cpu_isa.host_vec_isas():
            raise LoweringError(f"{artifact} needs {recorded}, which this host lacks; fetch the build for a lower ISA", retryable=True)
        return load_package(artifact, target, ep)

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        meta = package_metadata(artifact)
        return {
            "format": "aoti-package",
            "isa": meta.get("AOTI_CPU_ISA"),
            "device": meta.get("AOTI_DEVICE_KEY"),
            "load": "torch._inductor.aoti_load_package(PATH)",
            **weights_facts(target),
        }
