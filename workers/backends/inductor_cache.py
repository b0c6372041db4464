"""`inductor-cache`: a torch.compile cache bundle, for users who keep torch.compile at serving.

The worker runs `torch.compile` on the program's module the way a server would (inference
under `torch.no_grad`, first at the example size, then at other sizes so automatic dynamic
shapes recompile the dynamic graph) and stores the bytes of
`torch.compiler.save_cache_artifacts()`. A fresh process that calls
`torch.compiler.load_cache_artifacts(bytes)` before compiling the same module, with the same
Inductor config, gets FX graph cache hits instead of compiles.

The ISA is pinned like `aoti-cpu` (`cpp.march`, `cpp.simdlen`): those settings are part of
Inductor's cache key, so the serving process must set the same ones; the manifest records
them under `artifact.serving_config`.

`mode: train` compiles a training step instead (workers/backends/train_bundle.py): forward and
backward, with the compiled kernels shipped beside the bundle.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from workers.backends import cpu_isa, train_bundle
from workers.backends.dynamic import mark_dynamic
from workers.backends.base import LoweringError
from workers.backends.cuda_target import CudaTarget
from workers.unit import Target

if TYPE_CHECKING:  # torch is the sandbox child's; the worker that plans and keys never imports it
    import torch
    from torch.export import ExportedProgram


def _compiled(module: torch.nn.Module, pin: train_bundle.Pin) -> Callable[..., Any]:
    import torch

    compiled = torch.compile(module)

    def run(*args: Any, **kwargs: Any) -> Any:
        with pin.held(), torch.no_grad():
            return compiled(*args, **kwargs)

    return run


class InductorCache(cpu_isa.PinnedCpuTarget):
    name = "inductor-cache"
    weights_in_code = False  # torch.compile takes parameters and buffers as graph inputs
    feeds_remote_caches = True  # its FX graph and AOTAutograd entries go to remote-cache/ too (jit_entries.py)
    modes = ("inference", "train")
    device_configs: dict[str, Any] = {}  # Inductor settings the device adds (the GPU form's below)

    def target_components(self, target: Target) -> dict[str, Any]:
        marks = {"mark_dynamic": list(target.mark_dynamic)} if target.mark_dynamic else {}
        # inference keys stay as they were
        mode = {"mode": target.mode, **train_bundle.HEADER_COMPONENT} if target.mode != "inference" else {}
        return {**self.device_components(target), **marks, **mode}

    def pin(self, target: Target) -> train_bundle.Pin:
        isa_configs, vec_isa = self.isa_pin(target)
        configs = {**target.options_dict, **isa_configs, **self.device_configs}
        return train_bundle.Pin(configs, vec_isa)

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        if target.mode == "train":
            return train_bundle.lower(ep, self.pin(target), target.mark_dynamic, workdir)
        import torch
        from torch.compiler._cache import CacheArtifactManager

        from workers.check.inputs import (
            input_sets,  # sympy: imported where programs are lowered, not where keys are named
        )

        torch._dynamo.reset()  # a long-lived worker: forget what earlier units compiled
        CacheArtifactManager.clear()  # …and what they recorded, so the bundle holds this unit only
        run = _compiled(ep.module(), self.pin(target))
        torch._dynamo.utils.counters.clear()
        for inputs in input_sets(ep):
            mark_dynamic(ep, inputs.args, target.mark_dynamic)
            run(*inputs.args, **inputs.kwargs)
        saved = torch.compiler.save_cache_artifacts()
        if saved is None or not saved[1].artifacts.get("inductor"):
            raise LoweringError("torch.compile recorded no Inductor cache artifacts (did every call fall back to eager?)")
        out = workdir / "inductor-cache.bin"
        out.write_bytes(saved[0])
        return out

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        import torch

        if ep is None:
            raise LoweringError("an inductor-cache bundle is loaded together with the program it was compiled from")
        if target.mode == "train":
            return train_bundle.load(artifact, self.pin(target), ep, lambda: self.load_problem(target))
        problem = self.load_problem(target)
        if problem:
            raise LoweringError(problem, retryable=True)
        info = torch.compiler.load_cache_artifacts(artifact.read_bytes())
        if info is None:
            raise LoweringError(f"{artifact} holds no torch.compile cache artifacts")
        return _compiled(ep.module(), self.pin(target))

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        import torch

        configs = self.pin(target).configs
        if target.mode == "train":
            return train_bundle.describe(artifact, self.isa_label(target), configs, target.mark_dynamic)
        return {
            "format": "torch-compile-cache-artifacts",
            "isa": self.isa_label(target),
            "serving_config": configs,
            "grad_mode": "no_grad",
            "mark_dynamic": list(target.mark_dynamic),
            # Dynamo's count from the lowering just done in this process (describe follows lower)
            "graphs_compiled": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            "load": ("torch.compiler.load_cache_artifacts(open(PATH, 'rb').read()); then, with torch._inductor.config "
                     f"set to {configs} and under torch.no_grad(), torch.compile(model)"),
        }


class InductorCacheCuda(CudaTarget, InductorCache):
    """`inductor-cache:sm_90` (`:cuda`: the worker's own GPU): the same bundles for a GPU, in both
    modes. The program is moved to the GPU, placed, sandboxed and verified like `aoti-cuda`.
    Nothing is pinned on the host CPU; Triton's compiled kernels travel inside the bundle, so a
    GPU consumer compiles none."""

    device_configs = {"bundle_triton_into_fx_graph_cache": True}  # inside the FX graph cache entries
