"""One call at the top of a training script: the farm's compiled training step, or an error that
says what to run. It never compiles in the background: a miss is an error.

    from farm.client import warm_start
    model = warm_start("model.pt2", store="s3://bucket/farm")   # inductor-cache, mode train
    opt = torch.optim.AdamW(model.parameters())
    loss = model(x).sum(); loss.backward(); opt.step()

`farm.client` re-exports it.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage import Store

if TYPE_CHECKING:  # torch is imported by the functions that need it
    from torch.export import ExportedProgram


class WarmStartError(RuntimeError):
    """The farm has nothing this process can start from; the message says what to run."""


def _target(target: str, mode: str, options: dict[str, Any] | None, weights: str) -> Any:
    from pydantic import ValidationError

    from scheduler.spec import TargetSpec
    from workers.unit import Target

    try:
        spec = TargetSpec.model_validate(target if "+" in target else f"{target}+{mode}")
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'target'}: {err['msg']}" for err in e.errors())
        raise WarmStartError(f"target {target!r} with mode {mode!r}: {problems}") from e
    return Target(backend=spec.backend, isa=spec.isa, options=tuple(sorted((options or {}).items())),
                  weights=weights, mode=spec.mode)  # type: ignore[arg-type]


def warm_start(program: str | Path | ExportedProgram, store: str | Store | None = None,
               target: str = "inductor-cache", mode: str = "train", options: dict[str, Any] | None = None,
               weights: str = "values", modules: list[str] = ()) -> Any:
    """The trainable compiled module for `program` (a .pt2 path or an ExportedProgram), from the
    artifact the farm built for it: found by the key the farm computed (the program's content,
    the target, this process's toolchain), checked against its digest and, where the store
    requires it, its signature; then installed (bundle and kernels) and loaded. The module keeps
    the program's parameter names, so `load_state_dict(ckpt)` and optimizers work.

    `target`, `options` and `weights` are the job's (`inductor-cache:avx512`, its Inductor
    options, `values` or `shapes`); `modules` are imported before the program is read (those that
    register its output types, as the job's `modules` were). Raises WarmStartError on a miss, or when this process would
    have to compile (another toolchain, another CPU)."""
    from workers.backends import cuda

    with cuda.asked_in_this_process():  # its GPU is this process's: no child imports torch again to say which
        return _warm_start(program, store, target, mode, options, weights, modules)


def _warm_start(program: str | Path | ExportedProgram, store: str | Store | None, target: str, mode: str,
                options: dict[str, Any] | None, weights: str, modules: list[str]) -> Any:
    from torch.export import ExportedProgram

    from farm.stores import open_store
    from storage import NoSuchStore
    from workers.backends import LoweringError, resolve
    from workers.keys import key_components, key_of
    from workers.sandbox.program import load_program, program_identity

    hint = "to modules=[...] of warm_start, or import it before calling warm_start"
    ep = program if isinstance(program, ExportedProgram) else load_program(Path(program), str(program), list(modules),
                                                                           modules_hint=hint)
    name = "the program" if isinstance(program, ExportedProgram) else str(program)
    t = _target(target, mode, options, weights)
    try:
        backend = resolve(t)
    except LoweringError as e:
        raise WarmStartError(str(e)) from e
    try:
        s = open_store(store, create=False)  # a mistyped path is said, not made an empty store
    except NoSuchStore as e:
        raise WarmStartError(f"cannot start {name} from the farm's {t.label} artifact: {e}; name the store the "
                             f"farm compiled it into (store=, or FARM_STORE)") from e
    identity = program_identity(ep, weights_by_value=t.weights == "values")
    try:
        components = key_components(identity, backend.target_components(t), t.options_dict, backend.toolchain(t))
    except LoweringError as e:  # a GPU target in a process without one
        raise WarmStartError(f"cannot start {name} from the farm's {t.label} artifact: {e}") from e
    key = key_of(components)
    manifest, incomplete = s.complete_manifest(key)  # its signature is checked here where the store requires one
    if incomplete:
        raise WarmStartError(f"the farm's {t.label} artifact for {name} in {s.uri} (key {key[:16]}…) is incomplete: "
                             f"{incomplete}; compile it again: farm compile {name if name != 'the program' else 'PROGRAM.pt2'} "
                             f"-t {t.base_label} --store {s.uri}")
    if manifest is None or manifest.get("status") not in (None, "compiled"):
        tools = components["toolchain"]
        raise WarmStartError(
            f"the farm has no {t.label} artifact for {name} in {s.uri} (key {key[:16]}…, for torch {tools['torch']}, "
            f"Python {tools['python']}{', ' + tools['cxx_version'] if tools.get('cxx_version') else ''}); compile it first: "
            f"farm compile {name if name != 'the program' else 'PROGRAM.pt2'} -t {t.base_label} --store {s.uri}"
            " (a program, target or toolchain that differs from the compiled one's is another key: "
            "`farm explain KEY` diffs two)")
    s.note_use(key, manifest)
    ref = manifest["blobs"]["artifact"]
    with tempfile.TemporaryDirectory(prefix="farm-warm-") as tmp:
        artifact = s.fetch(ref["digest"], Path(tmp) / "artifact")  # checked against the manifest's sha256
        try:
            return backend.load(artifact, t, backend.prepare(ep, t))  # a GPU target's module is on the GPU
        except LoweringError as e:
            raise WarmStartError(f"cannot start {name} from the farm's {t.label} artifact (key {key[:16]}…): {e}") from e
