"""``--workers ray``: consensus alignment jobs on a Ray cluster (a local one, started by Ray itself for this
module) give the in-process result bit for bit; each job reads its model from its own folder, and re-applies the
elements of earlier rounds; without Ray the option fails early with an error naming the extra."""
from __future__ import annotations

import sys

import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.consensus import AlignmentPlan, align_to_consensus, float64_state
from symgraph.elements import apply
from symgraph.errors import SymgraphError
from symgraph.workers import Job, LocalWorkers, RayWorkers, check_workers

from cli_runner import run

ray = pytest.importorskip("ray")  # installed with the test extra; skipped only where it cannot be imported


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module (RayWorkers then uses it and leaves it running)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = []
    for seed in range(3):
        zoo.build("bert", seed=seed).save_pretrained(root / f"m{seed}")
        paths.append(root / f"m{seed}")
    return paths


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ray_consensus_equals_the_in_process_run(cluster, folders):
    subjects = [symgraph.load(str(p)) for p in folders]
    assert all(s.weights_from_path for s in subjects)
    local = align_to_consensus(subjects, [1, 1, 1], mode="permutation", progress=False)
    remote = align_to_consensus(subjects, [1, 1, 1], mode="permutation", progress=False, workers="ray")
    assert all(_same(a, b) for a, b in zip(local.states, remote.states))
    assert local.history == remote.history and remote.workers == "ray"
    assert len(remote.job_seconds) == len(local.job_seconds) >= 2
    assert max(local.distances) < max(local.distances_before)  # the jobs did move the models


@pytest.mark.slow
def test_ray_jobs_rebuild_the_current_state_from_the_folder_and_earlier_elements(cluster, folders):
    source, anchor = symgraph.load(str(folders[1])), symgraph.load(str(folders[0]))
    plan = AlignmentPlan.of(source, "full")
    earlier = symgraph.sample_elements(source.report, seed=2)  # as if applied in earlier rounds
    state = apply(float64_state(source.state_dict()), earlier)
    job = Job(1, state, earlier, float64_state(anchor.state_dict()))
    (_, local), = LocalWorkers().run(plan, [job])
    runner = RayWorkers([anchor, source])
    assert runner.sources[1].path == folders[1]  # read from its folder, not shipped
    (_, remote), = runner.run(plan, [job])
    runner.close()
    assert ray.is_initialized()  # a cluster it did not start is left running
    assert _same(apply(state, local), apply(state, remote)) and len(remote) == len(local) > 0


@pytest.mark.slow
def test_cli_merge_with_ray_workers_writes_the_local_merge(cluster, folders, tmp_path):
    for workers in ("local", "ray"):
        res = run("merge", *folders, "-o", tmp_path / workers, "--workers", workers, "--align", "permutation",
                  "--no-fold", "--no-progress")
        assert res.returncode == 0, res.stderr
    local, remote = (symgraph.load(str(tmp_path / w)).state_dict() for w in ("local", "ray"))
    assert _same(local, remote)


def test_ray_workers_without_ray_name_the_extra(monkeypatch, folders, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(SymgraphError, match=r"symgraph\[ray\]"):
        check_workers("ray")
    res = run("merge", *folders[:2], "-o", tmp_path / "out", "--workers", "ray")
    assert res.returncode != 0 and "symgraph[ray]" in res.stderr and not (tmp_path / "out").exists()
    with pytest.raises(SymgraphError, match="Unknown workers"):
        check_workers("dask")


@pytest.mark.slow
def test_ray_merge_of_encoders_with_free_outputs_equals_the_local_one(cluster, tmp_path):
    """Base encoders (hidden-state outputs) merged with --free-outputs: the Ray jobs' elements are those the
    in-process run applies, so the free outputs are undone alike and the merges agree."""
    import transformers

    base = transformers.AutoModel.from_config(zoo.tiny_config("bert")).eval()
    zoo._perturb(base, torch.Generator().manual_seed(3))
    base.save_pretrained(tmp_path / "a")
    twin = symgraph.load(str(tmp_path / "a"), free_outputs=True)
    twin.model.load_state_dict(symgraph.transform(twin, seed=1))
    twin.model.save_pretrained(tmp_path / "b")
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    merges = [symgraph.merge(folders, free_outputs=True, workers=w, progress=False) for w in ("local", "ray")]
    assert _same(merges[0].state, merges[1].state) and max(merges[1].distances) < 1e-6
