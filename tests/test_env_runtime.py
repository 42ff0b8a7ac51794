"""`meshrl train` on environments of the user's own, end to end: real Monarch processes, the tiny model,
the env mesh hosting each form (a class in its processes, openenv-core's server in a process it starts,
a meshrl remote server at a URL), SDPO on the environment's error sites with its own hint templates,
trace replay by real HTTP teachers, a killed environment server survived, and `meshrl eval` on the task."""

import json
import os
import signal
import threading
import time

import psutil
import pytest

from meshrl.config.base import load_config
from meshrl.config.sft import SFTRunConfig
from meshrl.controller.sft import sft_main
from meshrl.controller.train import make_run_dir, run_training
from meshrl.metrics.records import read_metrics
from meshrl.testing.fake_openai import FakeOpenAIServer
from tests.conftest import TINY_RUN

pytestmark = pytest.mark.monarch

COMMON = ["trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.checkpoint.export_final=false",
          "trainer.checkpoint.every=0", "trainer.prompts_per_step=2", "trainer.group_size=4", "task.kind=env"]


def _run(cfg, session=None):
    run_dir = make_run_dir(cfg, overwrite=True)
    result = run_training(cfg, run_dir, session=session)
    records = read_metrics(run_dir / "metrics.jsonl")
    return run_dir, result, [r for r in records if r["kind"] == "train"], records


def _teachers(url):
    entries = [f"{{name: t{i}, base_url: '{url}', model: m, timeout_s: 5, max_retries: 1}}" for i in range(2)]
    return "replay.teachers.teachers=[" + ", ".join(entries) + "]"


@pytest.mark.slow  # about a minute: the default suite's budget is kept for the faster checks
@pytest.mark.timeout(900)  # a 3-step run with both channels, then two fine-tuning runs on its files
def test_a_class_environment_trains_on_all_three_channels_and_keeps_its_data(tiny_run_config, tiny_session, tmp_path):
    """`VowelChatEnv` (a meshrl class, no history of its own) in the env mesh's processes: its
    `few_vowels` error sites become SDPO sites with the environment's own hint template, failing
    episodes are replayed turn by turn to two teachers that agree, and their pairs are trained. The
    run keeps its episodes and pairs, and `meshrl sft` trains on each file."""
    with FakeOpenAIServer({"m": "aeiou aeiou"}) as server:
        cfg = tiny_run_config("output.name=env-class", "trainer.steps=3", *COMMON,
                              "task.env.factory=meshrl.testing.envs:VowelChatEnv", "task.env.success_reward=0.9",
                              "task.env.hints={vowels.few: 'Hint: use more vowels, {error_text} is too few.'}",
                              "sdpo.alpha=0.5", "sdpo.teacher=learner", "replay.beta=0.5", "replay.pool.procs=1",
                              "replay.select=all", "replay.teachers.canonicaliser=text", "replay.teachers.agreement_k=2",
                              _teachers(server.base_url))
        run_dir, _, train, _ = _run(cfg, tiny_session)
        contexts = [r.body["messages"] for r in server.chat_requests("m")]
    assert [r["step"] for r in train] == [1, 2, 3]
    last = train[-1]
    assert last["episodes/mean_turns"] == 2.0  # every episode played both of the environment's turns
    assert last["sdpo/error_sites"] > 0 and last["sdpo/hints"] == last["sdpo/error_sites"] - last["sdpo/empty_response"]
    assert last["sdpo/no_hint_template"] == 0  # `vowels.few` exists only in task.env.hints
    assert any(r["loss/sdpo_jsd"] > 0 for r in train)
    assert last["replay/submitted"] > 0 and last["replay/dpo_items"] > 0
    assert any(r["loss/replay_dpo"] > 0 for r in train)
    # the teachers answered each turn the student answered, in the context it saw: its second turn
    # carries its first reply and the environment's "Once more."
    second = [c for c in contexts if any(m["content"] == "Once more." for m in c)]
    assert second and all([m["role"] for m in c][-3:] == ["user", "assistant", "user"] for c in second)

    # the data kept: every episode of every step (token ids as sampled, the environment's own record
    # merged by episode id, its error sites), and every pair the teachers agreed on
    episodes = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert [r["step"] for r in episodes] == [s for s in (1, 2, 3) for _ in range(8)]
    for r in episodes:
        assert r["kind"] == "trajectory" and r["episode_id"] and r["step_count"] == 2  # VowelChatEnv's state
        assert len(r["tokens"]) == len(r["logprobs"]) == len(r["mask"]) and 0 in r["mask"] and 1 in r["mask"]
        assert r["termination"] in ("success", "done") and r["version"] == r["step"] - 1
    assert any(site["error_kind"] == "few_vowels" for r in episodes for site in r["error_sites"])
    pairs = [json.loads(line) for line in (run_dir / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["agreement"] == "2 of 2" and p["chosen_text"] == "aeiou aeiou" for p in pairs)
    assert len([p for p in pairs if p["status"] == "buffered"]) == last["replay/dpo_items"]

    # meshrl sft on the best episodes (token in, token out) and offline DPO on the pairs
    best = sorted(r["reward"] for r in episodes)[-4]
    for name, data in (("sft", [f"sft.trajectories={run_dir / 'trajectories.jsonl'}", f"sft.min_reward={best}"]),
                       ("dpo", [f"sft.pairs={run_dir / 'pairs.jsonl'}"])):
        sft_cfg = load_config(SFTRunConfig, None, [*TINY_RUN, f"output.dir={tmp_path}", f"output.name={name}",
                                                   "trainer.checkpoint.export_final=false", "sft.steps=2", *data])
        assert sft_main(sft_cfg, session=tiny_session) == 0
        assert len([r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]) == 2


def _server_pids(name: str) -> list[int]:
    """Processes of this test's own tree whose command line runs ``name``."""
    me = os.getpid()
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if name in " ".join(p.info["cmdline"] or []) and me in {a.pid for a in p.parents()}:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
def test_an_openenv_server_killed_mid_run_is_restarted_and_the_run_goes_on(tiny_run_config):
    """openenv-core's own server in a process the env mesh starts, episodes over its WebSocket: it is
    SIGKILLed during step 2; the episodes on it fail (counted), the server is started again, the
    step's batch is played again on it, and every step trains on all its episodes."""
    cfg = tiny_run_config("output.name=env-openenv", "trainer.steps=4", *COMMON,
                          "task.env.factory=meshrl.testing.openenv_envs:VowelEnv", "task.env.serve=true",
                          "task.env.step_timeout_s=20")
    killed: list[int] = []

    def killer(run_dir):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and any(r["kind"] == "train" for r in read_metrics(metrics)):
                pids = _server_pids("meshrl.envs.openenv_adapter")
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                    return
            time.sleep(0.05)

    run_dir = make_run_dir(cfg, overwrite=True)
    thread = threading.Thread(target=killer, args=(run_dir,), daemon=True)
    thread.start()
    run_training(cfg, run_dir)
    thread.join(5)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert killed and [r["step"] for r in train] == [1, 2, 3, 4]
    last = train[-1]
    assert last["env/server_restarts"] == 1 and last.get("env/step_errors", 0) + last.get("env/reset_errors", 0) > 0
    # the batch the server died under was played again on its replacement: nothing lost
    assert sum(r.get("episodes/batches_replayed", 0) for r in train) == 1
    assert all(r["reward/mean"] > 0 and r["batch/trajectories"] == 8 for r in train)
    assert not _server_pids("meshrl.envs.openenv_adapter")  # the restarted server stopped with the run


@pytest.mark.slow
def test_a_meshrl_remote_server_at_a_url_and_meshrl_eval_on_it(tiny_run_config, tmp_path, capsys):
    """A meshrl remote environment server the user runs (here: started by the test) at `task.env.url`,
    trained on for two steps; then `meshrl eval` plays the held-out episodes on it."""
    from meshrl.controller.evaluate import eval_main
    from meshrl.envs.remote import spawn_server

    with spawn_server("meshrl.testing.envs:VowelChatEnv") as server:
        env = [f"task.env.url={server.url}", "task.env.protocol=meshrl", "task.env.success_reward=0.8",
               "task.env.heldout.seeds=[0, 4]", "task.env.heldout.kwargs={split: test}"]
        cfg = tiny_run_config("output.name=env-remote", "trainer.steps=2", *COMMON, *env,
                              "trainer.checkpoint.export_final=true")
        run_dir, _, train, _ = _run(cfg)
        assert [r["step"] for r in train] == [1, 2] and all(r["episodes/mean_turns"] == 2.0 for r in train)
        out = tmp_path / "eval.json"
        assert eval_main(str(run_dir / "final_model"), overrides=["trainer.eval.size=4"], out=str(out)) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "held-out env, 4 episodes, greedy: success rate" in line and "mean return" in line
    result = json.loads(out.read_text())
    assert result["eval/n"] == 4 and 0.0 < result["eval/reward_mean"] <= 2.0
    assert [t["id"] for t in result["tasks"]] == [f"seed{i}" for i in range(4)]
