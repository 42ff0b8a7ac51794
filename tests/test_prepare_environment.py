"""The supervision knobs are the config's: `prepare_environment` puts `meshes.supervision_poll_s` and
`launch.host_loss_timeout_s` over whatever the environment held, sets the host-loss timeout through
Monarch's runtime configuration in a process that imported Monarch already, and logs a knob that
process keeps at another value (a setting is kept to the millisecond, 7.0004 s as 7 s, and that
is no other value). Each case runs in a fresh interpreter, so that what this test
process imported decides nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, logging, os, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("meshrl").addHandler(Keep())
if sys.argv[1] == "after":
    import monarch.config
from meshrl.config.launch import LaunchConfig
from meshrl.config.meshes import MeshesConfig
from meshrl.meshes.local import prepare_environment
prepare_environment(MeshesConfig(supervision_poll_s=0.25), LaunchConfig(host_loss_timeout_s=7.0004))
from monarch.config import get_global_config
print(json.dumps({"poll": os.environ["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"],
                  "idle": os.environ["HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE"],
                  "monarch_idle": get_global_config()["get_proc_state_max_idle"], "warnings": records}))
"""


def _probe(when: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HYPERACTOR_MESH_")}
    done = subprocess.run([sys.executable, "-c", PROBE, when], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_before_monarch_the_config_overrides_the_environment():
    out = _probe("before", HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY="3s",
                 HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE="9s")
    assert (out["poll"], out["idle"], out["monarch_idle"]) == ("250ms", "7000ms", "7s")
    assert out["warnings"] == []


def test_after_monarch_the_host_timeout_is_configured_and_the_poll_period_is_logged():
    out = _probe("after")
    assert (out["poll"], out["idle"], out["monarch_idle"]) == ("250ms", "7000ms", "7s")
    [warning] = out["warnings"]  # the poll period has no runtime setting: children get it, this process not
    assert warning.startswith("meshes.supervision_poll_s = 0.25 s reaches only the processes started from now on")


@pytest.mark.parametrize("poll", ["250ms", "3s"])
def test_a_value_monarch_read_at_import_is_kept_and_logged(poll):
    out = _probe("after", HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=poll,
                 HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE="9s")
    assert (out["idle"], out["monarch_idle"]) == ("7000ms", "9s")  # children get 7 s; this process keeps 9 s
    kept = ["launch.host_loss_timeout_s"] if poll == "250ms" else ["meshes.supervision_poll_s",
                                                                    "launch.host_loss_timeout_s"]
    assert [w.split(" = ")[0] for w in out["warnings"]] == kept
