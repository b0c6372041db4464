"""`aot-compile`: torch's precompiled functions (`torch.compile(fullgraph=True)` and
`.aot_compile`), saved with `save_compiled_function`, loaded with
`torch.compiler.load_compiled_function`, in both modes.

The function compiled is the program's module's `forward`, at the example inputs and at each
hot size `autotune.specialize` names: its shapes are static (Dynamo's guards admit only those
sizes), and the manifest says so. As for training bundles, the compiled kernels and the ISA's
probe ship with it (workers/backends/train_bundle.py, `installed`), under the same ISA pin.

Dynamo's package refers to the module's class by name and rebuilds it when loaded, which a
module from `ep.module()` defeats three ways (torch 2.13): its class is made per instance inside
`GraphModule.__new__` (not importable), a GraphModule pickles by regenerating its code (a new
class again, so the type guard fails), and `check_guards` adds an `exec`-made function. So the
module is made `packable`: no guards submodule (the compiled function's own guards check its
inputs), its class registered in this module under a name the artifact records, and pickled as
a plain object of that class.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from workers.backends import cpu_isa, kernels, train_bundle
from workers.backends.base import LoweringError
from workers.backends.cuda_target import CudaTarget
from workers.unit import Target

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

FORMAT = "farm-precompiled-functions"
CLASS_NAME = re.compile(r"Program_[0-9a-f]{32}")


def packable(ep: ExportedProgram, class_name: str) -> torch.nn.Module:
    """`ep.module()` as Dynamo's package can save and load it (see the module doc)."""
    if not CLASS_NAME.fullmatch(class_name):
        raise LoweringError(f"{class_name!r} is not a program class name the farm writes; the artifact is damaged")
    module = ep.module(check_guards=False)
    del module.train, module.eval  # instance methods that only raise; the class's own work on a fixed graph
    cls = type(module)
    cls.__module__, cls.__qualname__, cls.__name__ = __name__, class_name, class_name
    cls.__reduce__ = object.__reduce__  # type: ignore[method-assign]  # not GraphModule's regenerating one
    cls.__reduce_ex__ = object.__reduce_ex__  # type: ignore[method-assign]
    cls.__new__ = staticmethod(lambda c, *args, **kwargs: object.__new__(c))  # type: ignore[method-assign]
    setattr(sys.modules[__name__], class_name, cls)
    return module


@contextlib.contextmanager
def _grad_mode(target: Target) -> Iterator[None]:
    """What the functions are compiled and called under; Dynamo's guards hold them to it. Inference
    runs under no_grad, outside inference mode even where the caller is in it (inference mode is
    a state of its own to the guards)."""
    import torch

    with torch.inference_mode(False), (torch.enable_grad() if target.mode == "train" else torch.no_grad()):
        yield


@contextlib.contextmanager
def _aot_compile_on() -> Iterator[None]:
    """`torch.compile(...).aot_compile` exists only with Dynamo's `enable_aot_compile` set: on by
    default in torch 2.13, off in 2.11 (the GPU hosts' torch), where the attribute is missing."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(enable_aot_compile=True) if hasattr(dynamo_config, "enable_aot_compile") else contextlib.nullcontext():
        yield


def _ordinary(args: Any) -> Any:
    """Inference tensors (made under torch.inference_mode) as ordinary ones, which the guards expect."""
    import torch
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t, args)


def serving(module: torch.nn.Module, functions: list[Any], pin: train_bundle.Pin, target: Target,
            built: list[str], threads: int | None) -> torch.nn.Module:
    """`module`, each call served by the first precompiled function whose guards admit it.
    `threads`: torch's thread count the functions were compiled under (Dynamo guards on it)."""
    import torch

    def call(*args: Any, **kwargs: Any) -> Any:
        with pin.held(), _grad_mode(target):
            args, kwargs = _ordinary((args, kwargs))
            for fn in functions:
                if fn.guard_check(module, *args, **kwargs):
                    return fn(module, *args, **kwargs)
        if threads is not None and torch.get_num_threads() != threads:
            raise ValueError(f"this {target.label} artifact was compiled with torch.get_num_threads() == {threads} and Dynamo's "
                             f"guards hold a precompiled function to it; this process has {torch.get_num_threads()}: call "
                             f"torch.set_num_threads({threads}) before the first step, or use inductor-cache, whose "
                             "kernels take the thread count at run time")
        shapes = [tuple(a.shape) for a in args if hasattr(a, "shape")]
        raise ValueError(f"this {target.label} artifact has static shapes, built for {', '.join(built)}; inputs of "
                         f"shapes {shapes} match none (compile it with autotune.specialize naming this size)")

    module._compiled_call_impl = call  # as workers/backends/train_bundle.py `trainable`: the module keeps its names
    return module


class AotCompile(cpu_isa.PinnedCpuTarget):
    name = "aot-compile"
    weights_in_code = False  # parameters are the compiled graph's inputs
    modes = ("inference", "train")
    static_shapes = True

    def target_components(self, target: Target) -> dict[str, Any]:
        sizes = {"sizes": [f"{w}={n}" for w, n in target.sizes]} if target.sizes else {}
        return {**self.device_components(target), "mode": target.mode, **sizes, **train_bundle.HEADER_COMPONENT}

    def pin(self, target: Target) -> train_bundle.Pin:
        isa_configs, vec_isa = self.isa_pin(target)
        return train_bundle.Pin({**target.options_dict, **isa_configs}, vec_isa)

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        import torch

        from workers.check.inputs import static_sets
        from workers.check.train import saved_for_backward, step

        torch._dynamo.reset()
        pin, class_name = self.pin(target), f"Program_{uuid.uuid4().hex}"
        module = packable(ep, class_name)
        sets = static_sets(ep, target.sizes)
        parts: dict[str, bytes] = {}
        functions = []
        with kernels.capturing() as loaded, pin.held(), _grad_mode(target), _aot_compile_on():
            for i, s in enumerate(sets):
                fn = torch.compile(type(module).forward, fullgraph=True).aot_compile(((module, *s.args), s.kwargs))
                functions.append(fn)
                path = workdir / f"fn-{i}.bin"
                fn.save_compiled_function(str(path))
                parts[path.name] = path.read_bytes()
            served = serving(module, functions, pin, target, [s.label for s in sets], torch.get_num_threads())
            for s in sets:  # run once: the kernels load (and a training step's backward compiles) now
                (step(served) if target.mode == "train" else served)(*s.args, **s.kwargs)
            shipping, binaries = train_bundle.kernel_facts(loaded, pin)
        facts = {"format": FORMAT, "module_class": class_name, "shapes": "static", "sizes": [s.label for s in sets],
                 "torch_threads": torch.get_num_threads(), **shipping}
        if target.mode == "train":
            with pin.held(), torch.enable_grad():
                out = served(*sets[0].args, **sets[0].kwargs)
            facts["saved_for_backward"] = {**saved_for_backward(out, list(module.parameters())), "at": sets[0].label}
        out_path = workdir / "precompiled.tar"
        kernels.pack(out_path, parts, binaries, facts)
        return out_path

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        import torch

        if ep is None:
            raise LoweringError("a precompiled function is loaded together with the program it was compiled from")
        pin = self.pin(target)
        unpacked = train_bundle.installed(artifact, pin, lambda: self.load_problem(target))
        module = packable(ep, str(unpacked.facts.get("module_class")))
        names = sorted(unpacked.parts, key=lambda n: int(n[3:-4]) if n.startswith("fn-") else -1)
        try:
            with pin.held(), _aot_compile_on():
                functions = [torch.compiler.load_compiled_function(io.BytesIO(unpacked.parts[n])) for n in names]
        except (RuntimeError, ValueError, EOFError, AttributeError) as e:
            raise LoweringError(f"{artifact}: torch could not load its precompiled functions ({type(e).__name__}: {e})") from e
        threads = unpacked.facts.get("torch_threads")
        return serving(module, functions, pin, target, [str(s) for s in unpacked.facts.get("sizes") or []],
                       threads if isinstance(threads, int) else None)

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        facts, count = train_bundle.shipped(artifact)
        return {
            "format": FORMAT, "mode": target.mode, "isa": self.isa_label(target), "serving_config": self.pin(target).configs,
            "shapes": "static", "sizes": facts["sizes"], "kernels": count, "build_command": facts["build_command"],
            # Dynamo's guards hold the functions to the thread count they were compiled under
            "torch_threads": facts["torch_threads"],
            **({"saved_for_backward": facts["saved_for_backward"]} if "saved_for_backward" in facts else {}),
            "load": f"farm.client.warm_start(program, store=URI, target='aot-compile', mode='{target.mode}')",
        }


class AotCompileCuda(CudaTarget, AotCompile):
    """`aot-compile:sm_90` (`:cuda`: the worker's own GPU): the program moved to the GPU, placed,
    sandboxed and verified like `aoti-cuda`; nothing pinned on the host CPU."""
    static_shapes = AotCompile.static_shapes  # not CudaTarget's: the functions are static on any device
