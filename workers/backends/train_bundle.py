"""`inductor-cache` in `mode: train`: a training step's cache bundle, forward and backward, with
the compiled kernels (workers/backends/kernels.py).

The module trained is `ep.module()`, compiled in place (`nn.Module.compile`), so its
parameters keep the model's names for `load_state_dict` and optimizers (a `torch.compile(m)`
wrapper prefixes each with `_orig_mod.`).

The ISA pin must hold for the backward too. AOTAutograd compiles a backward lazily, at the
first `.backward()`, outside anything wrapped around the forward call: pinned only there, the
backward's kernels came out with AVX-512 instructions on an AVX2 target. So the lowering runs
both halves pinned. At load, a bundle hit brings both halves in at the first forward call,
which is pinned.
"""
from __future__ import annotations

import contextlib
import json
import logging
import tarfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from workers.backends import cache_keys, cpu_isa, kernels
from workers.backends.base import LoweringError

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

# Inductor's precompiled header is made only for a kernel that is built, at lowering and at load
# (Pin.held), so a consumer whose kernels are all shipped builds none. Artifacts made before were compiled
# with the header turned off, which is part of Inductor's cache keys (they would miss here, and
# a JIT user's keys never matched theirs): this part of the unit's key tells the two apart.
HEADER_COMPONENT = {"precompiled_header": "built with the first kernel"}
FORMAT = "farm-training-bundle"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pin:
    """The Inductor settings a bundle was compiled under (part of Inductor's cache keys), held
    around every call of the compiled module, at lowering and at load."""
    configs: dict[str, Any]  # Inductor config, the CPU ISA's included
    vec_isa: str | None  # the one vector ISA Inductor may see; None: not pinned (a GPU target)
    # AOTAutograd settings (part of its keys): at load, the producer's where this process's
    # defaults differ (cache_keys.settings_to_pin); at lowering, none: the sandbox's own
    autograd: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        import torch

        with contextlib.ExitStack() as stack:
            stack.enter_context(kernels.skipping_unneeded_headers())
            if self.vec_isa is not None:  # by the CPU's flags: a worker probed its build (host_problem) before lowering
                stack.enter_context(cpu_isa.only_vec_isa(self.vec_isa, probe=False))
            stack.enter_context(torch._inductor.config.patch(self.configs))
            if self.autograd:
                from torch._functorch import config as autograd_config

                stack.enter_context(autograd_config.patch(self.autograd))
            yield


def trainable(module: torch.nn.Module, pin: Pin, shipped_keys: dict[str, cache_keys.Parts] | None = None) -> torch.nn.Module:
    """`module`, compiled in place, each call under the pin (Module.__call__ runs
    `_compiled_call_impl` when set: wrapping it is the one way to hold the pin around the
    compiled call while the module keeps its own names).

    `shipped_keys` (a loaded bundle's): a call that compiles a graph the bundle should have held
    says why it missed, in a warning and in the module's `farm_bundle_misses`."""
    import torch

    module.compile()
    compiled_call = module._compiled_call_impl
    module.farm_bundle_misses = []
    aot = torch._dynamo.utils.counters["aot_autograd"]

    def call(*args: Any, **kwargs: Any) -> Any:
        if shipped_keys is None:
            with pin.held():
                return compiled_call(*args, **kwargs)
        missed = aot["autograd_cache_miss"]
        with pin.held(), cache_keys.recording_compiles() as seen:
            out = compiled_call(*args, **kwargs)
        if aot["autograd_cache_miss"] > missed:
            new = [k for k in seen if k not in shipped_keys] or list(seen)  # a key the bundle has may have hit
            for key in new:
                why = cache_keys.why_missed(key, seen[key], shipped_keys)
                module.farm_bundle_misses.append(why)
                log.warning("this process compiled a graph the farm's training bundle should have held: %s", why)
        return out

    module._compiled_call_impl = call
    return module


def _backward_problem() -> str | None:
    import torch

    aot = torch._dynamo.utils.counters["aot_autograd"]
    # a graph is complete once saved (its backward compiled) or found whole in the cache
    total, bypassed = aot["total"], aot["autograd_cache_bypass"]
    saved = aot["autograd_cache_saved"] + aot["autograd_cache_hit"]
    if total == 0:
        return "Dynamo captured no graph for AOTAutograd (did every call fall back to eager?)"
    if bypassed:
        return f"AOTAutograd could not cache {bypassed} of {total} graphs (see the unit log for why), so the bundle would lack them"
    if saved < total:
        return (f"the bundle would lack the backward of {total - saved} of {total} graphs (AOTAutograd saves a graph "
                "once its backward is compiled); refusing to publish a training bundle without its backward")
    return None


def lower(ep: ExportedProgram, pin: Pin, marks: tuple[str, ...], workdir: Path) -> Path:
    import torch
    from torch.compiler._cache import CacheArtifactManager

    from workers.backends.dynamic import mark_dynamic
    from workers.check.inputs import input_sets
    from workers.check.train import random_ops, saved_for_backward, step

    torch._dynamo.reset()  # a long-lived worker: forget what earlier units compiled
    CacheArtifactManager.clear()  # …and what they recorded, so the bundle holds this unit only
    module = trainable(ep.module(), pin)
    torch._dynamo.utils.counters.clear()
    sets = input_sets(ep)
    with kernels.capturing() as loaded, pin.held(), cache_keys.recording() as keys:
        autograd = cache_keys.autograd_values()
        for inputs in sets:
            mark_dynamic(ep, inputs.args, marks)
            step(module)(*inputs.args, **inputs.kwargs)
        shipping, binaries = kernel_facts(loaded, pin)
    problem = _backward_problem()
    if problem:
        raise LoweringError(problem)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[1].artifacts.get("inductor"):
        raise LoweringError("torch.compile recorded no Inductor cache artifacts (did every call fall back to eager?)")
    aot, inductor = torch._dynamo.utils.counters["aot_autograd"], torch._dynamo.utils.counters["inductor"]
    facts = {
        "format": FORMAT,
        "graphs": {"forward": int(aot["total"]), "backward": int(aot["autograd_cache_saved"] + aot["autograd_cache_hit"]),
                   "inductor_entries": len(saved[1].artifacts["inductor"])},
        "saved_for_backward": {**saved_for_backward(module(*sets[0].args, **sets[0].kwargs), list(module.parameters())),
                               "at": sets[0].label},
        **shipping,
        # GPU: Triton kernels the bundle carries compiled (saved now, or read from Inductor's cache)
        "triton_kernels": int(inductor["triton_bundler_save_kernel"] + inductor["triton_bundler_read_and_emit_kernel"]),
        # how verification made random draws comparable (workers/sandbox/steps.py refuses otherwise)
        "randomness": {"ops": random_ops(ep), "verified_with": "fallback_random" if pin.configs.get("fallback_random") else None},
        # each AOTAutograd key's parts: a consumer that misses names the parts it differs in
        "cache_keys": keys,
        "autograd_config": autograd,  # the settings those keys were computed under (pinned at load)
    }
    out = workdir / "training-bundle.tar"
    kernels.pack(out, {"bundle.bin": saved[0]}, binaries, facts)
    return out


def kernel_facts(loaded: list[str], pin: Pin) -> tuple[dict[str, Any], list[str]]:
    """What a consumer checks before it uses the kernels, and the binaries to ship: those loaded,
    and the ISA's probe (installed first at load: see `installed`). Called with the pin held."""
    build = kernels.build_command() if loaded else None  # a GPU step may have no CPU kernel
    probe = kernels.isa_probe(pin.vec_isa) if pin.vec_isa else []
    return {"build_command": build, "isa_probe": kernels.relative(probe[0]) if probe else None}, loaded + probe


def installed(artifact: Path, pin: Pin, host_problem: Callable[[], str | None]) -> kernels.Unpacked:
    """The artifact's parts, with its kernels in Inductor's cache dir. Refuses an artifact this
    process would compile kernels for instead of using them, and a host that cannot run the
    target's ISA. The ISA's probe goes in first: Inductor's check of the host (in both
    refusals) then loads it instead of building it."""
    unpacked = kernels.unpack(artifact, str(artifact))
    probe = unpacked.facts.get("isa_probe")
    if isinstance(probe, str) and probe in unpacked.kernels:
        kernels.install({probe: unpacked.kernels[probe]})
    recorded = unpacked.facts.get("build_command")
    if recorded:  # the bundle ships CPU kernels: this process must find them
        with pin.held():
            problem = kernels.build_problem([str(t) for t in recorded])
        if problem:
            raise LoweringError(problem)
    problem = host_problem()
    if problem:
        raise LoweringError(problem, retryable=True)
    kernels.install(unpacked.kernels)
    return unpacked


def load(artifact: Path, pin: Pin, ep: ExportedProgram, host_problem: Callable[[], str | None]) -> torch.nn.Module:
    """The trainable module, with the bundle loaded and its kernels in place (see `installed`)."""
    import torch

    unpacked = installed(artifact, pin, host_problem)
    if "bundle.bin" not in unpacked.parts or torch.compiler.load_cache_artifacts(unpacked.parts["bundle.bin"]) is None:
        raise LoweringError(f"{artifact} holds no torch.compile cache artifacts")
    recorded = unpacked.facts.get("cache_keys")  # read from the store: only well-formed entries count
    keys = {k: v for k, v in recorded.items() if isinstance(v, dict)} if isinstance(recorded, dict) else {}
    pin = replace(pin, autograd=cache_keys.settings_to_pin(unpacked.facts.get("autograd_config")))
    return trainable(ep.module(), pin, keys)


def shipped(artifact: Path) -> tuple[dict[str, Any], int]:
    """An artifact's facts and how many kernels it ships (our own, just written)."""
    with tarfile.open(artifact, "r:") as tar:
        facts = json.load(tar.extractfile("facts.json"))  # type: ignore[arg-type]
        return facts, sum(1 for m in tar.getmembers() if m.name.startswith("kernels/"))


def describe(artifact: Path, isa: str, configs: dict[str, Any], marks: tuple[str, ...]) -> dict[str, Any]:
    facts, count = shipped(artifact)
    return {
        "format": FORMAT, "mode": "train", "isa": isa, "serving_config": configs, "grad_mode": "enabled",
        "mark_dynamic": list(marks),
        "graphs": facts["graphs"], "saved_for_backward": facts["saved_for_backward"], "kernels": count,
        "build_command": facts["build_command"], "randomness": facts["randomness"],
        "triton_kernels": facts["triton_kernels"],
        "load": "farm.client.warm_start(program, store=URI, target='inductor-cache', mode='train')",
    }
