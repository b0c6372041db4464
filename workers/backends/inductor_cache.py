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
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch.export import ExportedProgram

from workers.backends import cpu_isa
from workers.backends.base import LoweringError
from workers.inputs import input_sets
from workers.unit import Target


def _compiled(module: torch.nn.Module, configs: dict[str, Any], vec_isa: str) -> Callable[..., Any]:
    compiled = torch.compile(module)

    def run(*args: Any, **kwargs: Any) -> Any:
        with cpu_isa.only_vec_isa(vec_isa), torch._inductor.config.patch(configs), torch.no_grad():
            return compiled(*args, **kwargs)

    return run


class InductorCache(cpu_isa.PinnedCpuTarget):
    name = "inductor-cache"
    weights_in_code = False  # torch.compile takes parameters and buffers as graph inputs

    def _configs(self, target: Target) -> dict[str, Any]:
        return {**target.options_dict, **self.isa(target)[1].inductor_configs}

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        from torch.compiler._cache import CacheArtifactManager

        torch._dynamo.reset()  # a long-lived worker: forget what earlier units compiled
        CacheArtifactManager.clear()  # …and what they recorded, so the bundle holds this unit only
        run = _compiled(ep.module(), self._configs(target), self.isa(target)[1].vec_isa)
        for inputs in input_sets(ep):
            run(*inputs.args, **inputs.kwargs)
        saved = torch.compiler.save_cache_artifacts()
        if saved is None or not saved[1].artifacts.get("inductor"):
            raise LoweringError("torch.compile recorded no Inductor cache artifacts (did every call fall back to eager?)")
        out = workdir / "inductor-cache.bin"
        out.write_bytes(saved[0])
        return out

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        if ep is None:
            raise LoweringError("an inductor-cache bundle is loaded together with the program it was compiled from")
        problem = self.host_problem(target)
        if problem:
            raise LoweringError(problem, retryable=True)
        info = torch.compiler.load_cache_artifacts(artifact.read_bytes())
        if info is None:
            raise LoweringError(f"{artifact} holds no torch.compile cache artifacts")
        return _compiled(ep.module(), self._configs(target), self.isa(target)[1].vec_isa)

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        configs = self._configs(target)
        return {
            "format": "torch-compile-cache-artifacts",
            "isa": self.isa(target)[0],
            "serving_config": configs,
            "grad_mode": "no_grad",
            "load": ("torch.compiler.load_cache_artifacts(open(PATH, 'rb').read()); then, with torch._inductor.config "
                     f"set to {configs} and under torch.no_grad(), torch.compile(model)"),
        }
