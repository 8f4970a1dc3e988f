"""What a user sees in MLflow's UI at the address mhf-dist prints, rendered by headless Chromium.

Runs only where a Chromium is installed (`apt-get install chromium`); the README's MLflow section
describes the same check done by hand, with a screenshot.
"""

import shutil
import subprocess

import pytest
import servers

from mhf_dist.compare import compare_runs
from mhf_dist.tracking import browse_hint, end_run, log_dataset, log_steps, start_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")
DIGEST = "ee264e3d4796" + "0" * 52


def rendered(url: str) -> str:
    """The page's DOM after its scripts have run (up to 20 s of virtual time)."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000",
               "--virtual-time-budget=20000", "--dump-dom", url]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def test_the_printed_address_opens_the_runs_table_with_datasets_and_the_sweeps_report(tmp_path):
    server = servers.MlflowServer(
        f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "art"), tmp_path / "log"
    )
    try:
        uri = server.url
        parent = start_run(uri, "mhf-ui", "demo-ui", {}, {"role": "sweep"})
        log_dataset(uri, parent, str(tmp_path / "shards"), DIGEST)
        for group in ("mhf_vocab", "qwen3"):
            tags = {
                "family": group,
                "group": group,
                "seed": 0,
                "param_count": 10,
                "mlflow.parentRunId": parent,
            }
            run = start_run(
                uri, "mhf-ui", f"{group}-seed0", {"train.batch_size": 2, "train.seq_len": 8}, tags
            )
            log_dataset(uri, run, str(tmp_path / "shards"), DIGEST)
            log_steps(
                uri, run, [{"step": 1, "val_nll": 5.0, "loss": 5.0}, {"step": 2, "val_nll": 4.5, "loss": 4.6}]
            )
            end_run(uri, run, "FINISHED")
        compare_runs(uri, "mhf-ui", tmp_path / "compare", sweep_run_id=parent)
        end_run(uri, parent, "FINISHED")

        address = browse_hint(uri, "mhf-ui")
        assert address.startswith(f"{uri}/#/experiments/") and address.endswith(
            "/runs?workflowType=machine_learning"
        )
        runs_page = rendered(address)
        # the Model-training runs table, the sweep's row with its dataset, not MLflow 3's GenAI overview
        assert "demo-ui" in runs_page and "matching runs" in runs_page
        assert "shards" in runs_page and DIGEST[:12] in runs_page
        assert "No data available" not in runs_page and "Detect issues" not in runs_page
        run_page = rendered(address.replace("/runs?", f"/runs/{parent}?"))
        # the parent run's page shows the comparison table as its description
        assert "mhf_vocab" in run_page and "param_residual" in run_page
    finally:
        server.stop()
