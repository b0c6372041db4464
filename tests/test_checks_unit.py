"""Fast unit tests of the pure parts: input sizes, numerics comparison, job spec."""
from __future__ import annotations

import pytest
import torch

from farm.zoo import export_model
from scheduler.spec import SpecError, load_job, parse_job
from workers.check.inputs import input_sets
from workers.check.verify import verify


def test_input_sets_cover_other_sizes_inside_each_range():
    ep = export_model("gpt")  # batch in [1, 64], seq in [2, 64], example (2, 16)
    sets = input_sets(ep, extra_sizes=2)
    shapes = [tuple(s.args[0].shape) for s in sets]
    assert shapes[0] == (2, 16)
    assert any(b != 2 for b, _ in shapes) and any(t != 16 for _, t in shapes)
    for b, t in shapes:
        assert 1 <= b <= 64 and 2 <= t <= 64
    for s in sets[1:]:
        ids = s.args[0]
        assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 128  # valid token ids
        ep.module()(*s.args)  # eager accepts every generated size


def test_input_sets_of_a_program_moved_to_another_device_are_on_that_device():
    """A GPU target's program is moved before lowering (`move_to_device_pass`): the sizes it is
    compiled and checked at are made on its device, with the values they have on the CPU."""
    from torch.export.passes import move_to_device_pass

    ep = export_model("mlp")
    moved = input_sets(move_to_device_pass(ep, "meta"))
    assert len(moved) > 1 and all(s.args[0].device.type == "meta" for s in moved)
    assert [s.args[0].shape for s in moved] == [s.args[0].shape for s in input_sets(ep)]


def test_verify_catches_a_wrong_artifact_and_a_rejected_size():
    ep = export_model("mlp")
    eager = ep.module()
    sets = input_sets(ep)
    off_by_a_bit = lambda x: eager(x) + 1e-2  # noqa: E731
    report = verify(eager, off_by_a_bit, sets, atol=1e-4, rtol=1e-4)
    assert not report.ok and report.max_abs_err == pytest.approx(1e-2, rel=1e-3)
    assert "exceeds atol" in report.problems[0]

    def only_example_size(x):
        if x.shape[0] != sets[0].args[0].shape[0]:
            raise RuntimeError("shape specialized")
        return eager(x)

    report = verify(eager, only_example_size, sets, atol=1e-4, rtol=1e-4)
    assert not report.ok and "raised RuntimeError" in report.problems[0]
    assert verify(eager, eager, sets, 0.0, 0.0).ok


def test_spec_accepts_strings_and_mappings(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("graphs: [models/a.pt2, {path: 's3://b/k.pt2', name: k}]\ntargets: ['aoti-cpu:avx512']\n")
    job = load_job(job_file)
    assert job.resolve(job.graphs[0]) == str(tmp_path / "models" / "a.pt2")
    assert job.resolve(job.graphs[1]) == "s3://b/k.pt2" and job.graphs[1].label == "k"
    assert job.targets[0].backend == "aoti-cpu" and job.targets[0].isa == "avx512"
    # a path with no file name (a directory, mistaken for a graph) is named by itself in its error
    assert [g.label for g in parse_job({"graphs": [".", "models/", "a.pt2"], "targets": ["aoti-cpu"]}).graphs] == \
        [".", "models", "a"]


@pytest.mark.parametrize("data, field", [
    ({"targets": ["aoti-cpu"]}, "graphs"),
    ({"graphs": ["a.pt2"], "targets": []}, "targets"),
    ({"graphs": ["a.pt2"], "targets": ["aoti-cpu"], "benchmark": {"repeat": 0}}, "benchmark.repeat"),
    ({"graphs": ["a.pt2"], "targets": ["aoti-cpu"], "name": "a/b"}, "name"),
    ({"graphs": ["a.pt2"], "targets": [{"backend": "aoti-cpu", "bogus": 1}]}, "targets.0.bogus"),
])
def test_spec_errors_name_the_field(data, field):
    with pytest.raises(SpecError, match=rf"job.yaml: the job spec is invalid:\n  {field}"):
        parse_job(data, "job.yaml")


def test_missing_and_malformed_job_files(tmp_path):
    with pytest.raises(SpecError, match="no such job file"):
        load_job(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("graphs: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job(tmp_path / "bad.yaml")
