"""README's gray-release walkthrough runs as written on the embedded SmolLM2 (only the port is swapped for a free one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.control.conftest import Cli
from tests.helpers.procs import free_port

README = Path(__file__).resolve().parents[2] / "README.md"


def walkthrough_text() -> str:
    text = README.read_text()
    return text.split("## Gray release", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow
@pytest.mark.full  # 1.5-3 min; each step is also a test of tests/control/test_gray_release.py
@pytest.mark.timeout(900)
def test_gray_release_walkthrough_runs_as_written(tmp_path):
    pytest.importorskip("gguf")
    blocks = re.findall(r"```bash\n(.*?)```", walkthrough_text(), flags=re.S)
    assert len(blocks) >= 5
    script = "set -euo pipefail\n" + "\n".join(blocks).replace("127.0.0.1:8000", f"127.0.0.1:{free_port()}")
    cli = Cli(tmp_path / "home")
    try:
        r = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=cli.env, capture_output=True, text=True, timeout=840
        )
    finally:
        cli.cleanup("demo")
    out = r.stdout
    assert r.returncode == 0, f"{out}\n{r.stderr}"
    assert "Paris" in out and "demo: unchanged" in out
    assert "+ engine.kv_cache_gb: 0.5    (new-revision)" in out
    assert "candidate revision 2: 10%" in out
    counts = dict(
        (rev, int(n))
        for n, rev in re.findall(r"^\s+(\d+) x-llmdeploy-revision: (\d)", out, flags=re.M | re.I)
    )
    assert counts.get("1", 0) > counts.get("2", 0) and sum(counts.values()) == 40, counts
    assert "revision 2 promoted to 100%" in out and "rolling back to revision 1 as new revision 3" in out
    assert "rollback to 1" in out and "demo: stopped" in out
