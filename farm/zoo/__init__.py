"""The model zoo: a registry of entries (farm/zoo/entry.py) grouped into suites.

- `smoke`: small plain-PyTorch models (farm/zoo/smoke.py), no extra packages;
- `hf`: Hugging Face `transformers` models from small configs (farm/zoo/hf.py), needs the `hf` extra;
- `nightly`: both.

Every entry exports with a dynamic batch dimension, and a dynamic sequence one where it applies."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import io
import time
from pathlib import Path

import torch
import yaml

from farm.zoo import hf, smoke
from farm.zoo.entry import ZooModel

ZOO: dict[str, ZooModel] = {m.name: m for m in (*smoke.ENTRIES, *hf.ENTRIES)}
SUITES: dict[str, tuple[str, ...]] = {
    "smoke": tuple(m.name for m in smoke.ENTRIES),
    "hf": tuple(m.name for m in hf.ENTRIES),
    "nightly": tuple(ZOO),
}


def suite(name: str) -> list[ZooModel]:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; the zoo has {', '.join(SUITES)}")
    return [ZOO[n] for n in SUITES[name]]


def load_suite(ref: str) -> list[ZooModel]:
    """A built-in suite by name, or a team's own: `path/to/zoo.py` or `package.module:NAME`, a
    list of ZooModel entries (NAME defaults to SUITE). The file is the team's code and runs."""
    if ref in SUITES:
        return suite(ref)
    module_name, _, attr = ref.partition(":")
    try:
        if ref.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"farm_user_zoo_{Path(ref).stem}", ref)
            if spec is None or not Path(ref).is_file():
                raise FileNotFoundError(ref)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            attr = "SUITE"
        else:
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise ValueError(f"suite {ref!r}: not a built-in suite ({', '.join(SUITES)}) and it cannot be loaded: {e}") from e
    found = getattr(module, attr or "SUITE", None)
    if not isinstance(found, (list, tuple)) or not found or not all(isinstance(m, ZooModel) for m in found):
        raise ValueError(f"suite {ref!r}: {attr or 'SUITE'} must be a non-empty list of farm.zoo.ZooModel entries")
    names = [m.name for m in found]
    if len(set(names)) != len(names):
        raise ValueError(f"suite {ref!r}: entry names must be unique, got {names}")
    return list(found)


def export_bytes(suite_ref: str, name: str) -> tuple[bytes, float, dict[str, str]]:
    """Run on a worker: export one entry of a suite; the .pt2 archive's bytes, the seconds it
    took, and the versions of the optional packages it was built with (this worker's)."""
    entry = next(e for e in load_suite(suite_ref) if e.name == name)
    start = time.perf_counter()
    ep = export_entry(entry)
    seconds = time.perf_counter() - start
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue(), seconds, {n: importlib.metadata.version(n) for n in entry.needs}


def entries(names: list[str]) -> list[ZooModel]:
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise ValueError(f"unknown zoo models {unknown}; the zoo has {', '.join(ZOO)}")
    return [ZOO[n] for n in names]


def export_entry(entry: ZooModel) -> torch.export.ExportedProgram:
    missing = entry.missing()
    if missing:
        raise ModuleNotFoundError(f"zoo entry {entry.name} needs {', '.join(missing)}: pip install -e '.[hf]'")
    torch.manual_seed(0)
    model = entry.build().eval()
    args, kwargs = entry.example()
    return torch.export.export(model, args, kwargs, dynamic_shapes=entry.dynamic())


def export_model(name: str) -> torch.export.ExportedProgram:
    return export_entry(entries([name])[0])


def save_program(ep: torch.export.ExportedProgram, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.pt2")
    torch.export.save(ep, str(tmp))
    tmp.replace(path)  # never leave half a .pt2 where a job may pick it up
    return path


def export_zoo(dest: Path, names: list[str] | None = None) -> list[Path]:
    """Write each model's .pt2 (the smoke suite unless named) and a job.yaml that compiles them all for aoti-cpu."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    chosen = entries(names) if names else suite("smoke")
    paths = [save_program(export_entry(e), dest / f"{e.name}.pt2") for e in chosen]
    modules = sorted({m for e in chosen for m in e.modules})
    job = {"name": "zoo", "graphs": [p.name for p in paths], "targets": ["aoti-cpu"], **({"modules": modules} if modules else {})}
    (dest / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return paths


__all__ = ["SUITES", "ZOO", "ZooModel", "entries", "export_bytes", "export_entry", "export_model", "export_zoo",
           "load_suite", "suite"]
