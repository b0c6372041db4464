"""Loading what the farm built, in Python (after `farm fetch KEY model.pt2`); `farm.client` re-exports it."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from torch.export import ExportedProgram


def load_compiled(artifact: str | Path, weights_from: ExportedProgram | str | Path | None = None) -> Callable[..., Any]:
    """Load an `aoti-cpu` package, or an ExecuTorch program (.pte, run by ExecuTorch's runtime;
    it returns its outputs as a list). For a package built with `weights: shapes`, `weights_from`
    (an exported program, or the .pt2 it was saved to) supplies the checkpoint it runs with;
    without it the package runs with the weights it was built with."""
    from workers.backends.aoti_cpu import aoti_load, load_with_weights, program_constants
    from workers.backends.executorch import is_pte, load_pte
    from workers.sandbox.program import load_program

    if is_pte(Path(artifact)):
        return load_pte(Path(artifact))
    if weights_from is None:
        return aoti_load(Path(artifact))
    ep = weights_from if isinstance(weights_from, ExportedProgram) else load_program(Path(weights_from), str(weights_from))
    return load_with_weights(Path(artifact), program_constants(ep))


def load_tuned(key: str, store: str, workdir: str | Path) -> Callable[..., Any]:
    """An autotuned unit from the store: its dynamic winner, plus every static specialization
    autotune kept, each serving the inputs whose dimension has its size (the dynamic artifact
    serves every other size)."""
    from storage import store_from_uri

    s, workdir = store_from_uri(store), Path(workdir)
    manifest = s.get_manifest(key)  # signature checked when FARM_VERIFY_KEY is set
    if manifest is None or "autotune" not in manifest:
        raise ValueError(f"{key} is not an autotuned unit in {s.uri}")
    s.note_use(key, manifest)
    blobs = manifest["blobs"]
    fallback = load_compiled(s.fetch(blobs["artifact"]["digest"], workdir / "dynamic.pt2"))
    names = _input_names(s.fetch(blobs["program"]["digest"], workdir / "program.pt2"), key)
    statics = []
    for sp in manifest["autotune"]["specializations"]:
        if sp["chosen"]:
            name, dim = sp["dim"].rsplit(".", 1)
            artifact = s.fetch(blobs[f"static {sp['dim']}={sp['size']}"]["digest"], workdir / f"{sp['dim']}={sp['size']}.pt2")
            statics.append((names.index(name), int(dim), sp["size"], load_compiled(artifact)))

    def run(*args: Any) -> Any:
        for position, dim, size, model in statics:
            if args[position].shape[dim] == size:
                return model(*args)
        return fallback(*args)

    return run


def _input_names(program: Path, key: str) -> list[str]:
    """The program's input names, read in a sandbox: a program from the store is hostile input."""
    import time

    from workers.sandbox.process import Sandbox, SandboxFailed
    from workers.unit import Target, Unit

    unit = Unit(graph=key, source=f"the program of {key}", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir("names") as tmp:
        try:
            reply = sandbox.call("input_names", tmp, unit.limits, time.monotonic() + 300, unit=unit,
                                 program=str(shutil.copy(program, tmp / "program.pt2")))
        except SandboxFailed as e:
            raise ValueError(f"cannot read the program of {key}: {e}") from e
    return [str(n) for n in reply.get("names") or []]
