"""Placement checks (control/placement.py, pure) and what the CLI says about them; the Ray backend without Ray
installed. No cluster and no engine: the Ray ones are in test_ray_backend.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from llmdeploy.control.placement import NodeResources, plan_placement, replica_resources
from llmdeploy.spec.models import DeploymentSpec
from tests.control.conftest import LLMDEPLOY, base_spec, write_spec


def spec(**parallel) -> DeploymentSpec:
    return DeploymentSpec(parallel=parallel)


def node(cpus: float, gpus: float = 0) -> NodeResources:
    return NodeResources("10.0.0.1", cpus, gpus)


def test_a_replica_reserves_a_cpu_per_rank_and_a_gpu_per_rank_on_cuda():
    assert replica_resources(spec(tensor_parallel=2), gpu=False) == (2.0, 0.0)
    assert replica_resources(spec(tensor_parallel=4), gpu=True) == (4.0, 4.0)


def test_local_cpu_oversubscription_is_a_warning_at_replicas():
    p = plan_placement(spec(replicas=3, tensor_parallel=2), [node(4)], False, "this machine")
    assert [(i.loc, i.severity) for i in p.issues] == [(("parallel", "replicas"), "warning")]
    assert "3 replicas x 2 ranks = 6 engine processes on 4 CPUs" in p.issues[0].message
    assert plan_placement(spec(replicas=2, tensor_parallel=2), [node(4)], False, "x").issues == ()


def test_local_cuda_needs_a_gpu_per_rank_and_replicas_share_them():
    p = plan_placement(spec(replicas=4, tensor_parallel=2), [node(8, 1)], True, "this machine")
    assert [(i.loc, i.severity) for i in p.issues] == [(("parallel", "tensor_parallel"), "error")]
    assert "2 ranks need 2 GPUs (one per rank); this machine has 1" in p.issues[0].message
    assert plan_placement(spec(replicas=4, tensor_parallel=2), [node(8, 2)], True, "x").issues == ()


def test_ray_counts_replicas_per_node_because_ranks_stay_together():
    ray = {"backend": "ray", "ray_address": "10.0.0.1:6379"}
    two_nodes = [node(8, 2), node(8, 2)]  # 4 GPUs, but a 4-rank replica needs 4 on one node
    p = plan_placement(spec(replicas=1, tensor_parallel=4, **ray), two_nodes, True, "cluster")
    assert p.fits == 0 and p.errors[0].loc == ("parallel", "tensor_parallel")
    assert "needs 4 CPU and 4 GPU on one node" in p.errors[0].message
    p = plan_placement(spec(replicas=3, tensor_parallel=2, **ray), two_nodes, True, "cluster")
    assert p.fits == 2 and p.errors[0].message.startswith("only 2 of 3 replicas")
    p = plan_placement(spec(replicas=2, tensor_parallel=2, **ray), two_nodes, True, "cluster")
    assert p.fits == 2 and [i.severity for i in p.issues] == ["warning"]  # no room for a canary
    assert "a canary revision starts 2 more replicas" in p.issues[0].message
    p = plan_placement(spec(replicas={"min": 1, "max": 6}, **ray), [node(4)], False, "cluster")
    assert p.fits == 4 and "autoscaling stops at 4 replicas" in p.issues[0].message
    assert plan_placement(spec(replicas=2, **ray), [node(4)], False, "cluster").issues == ()


def test_an_unreachable_cluster_is_shown_unchecked():
    p = plan_placement(
        spec(backend="ray"), None, False, "cluster", note="not checked: no Ray cluster answers"
    )
    assert p.fits is None and p.issues == () and p.note.startswith("not checked")


def test_validate_puts_placement_problems_at_the_key(tmp_path, tiny_llama):
    f = write_spec(
        tmp_path / "big.yaml",
        base_spec("big", tiny_llama, engine={"device": "cpu"}, parallel={"replicas": 4096}),
    )
    r = subprocess.run([LLMDEPLOY, "validate", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "parallel.replicas" in x)
    at = f.read_text().splitlines().index("  replicas: 4096") + 1
    assert line.startswith(f"{f}:{at}:3: warning: parallel.replicas: 4096 replicas x 1 ranks")


def test_without_ray_validate_warns_and_apply_says_how_to_install_it(tmp_path, tiny_llama):
    hide = tmp_path / "noray"
    hide.mkdir()
    # as if Ray were not installed: find_spec("ray") is None and `import ray` fails
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    env = {
        "PYTHONPATH": str(hide),
        "LLMDEPLOY_HOME": str(tmp_path / "home"),
        "PATH": str(Path(sys.executable).parent),
    }
    f = write_spec(tmp_path / "r.yaml", base_spec("r", tiny_llama, parallel={"backend": "ray"}))
    r = subprocess.run([LLMDEPLOY, "validate", str(f)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "warning: parallel.backend: backend ray needs Ray" in r.stderr, r.stderr
    r = subprocess.run([LLMDEPLOY, "apply", str(f)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    assert "pip install 'llmdeploy[ray]'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "home" / "r" / "state.db").exists()  # refused before anything started
