"""The run directory's data files, appended after every step so that a crash loses no finished step:

- `trajectories.jsonl`: every trajectory the step sampled for training (single-turn and
  multi-turn, every task kind), one record each (meshrl.training.records.trajectory_record), with
  the environment's own episode record merged into its line where the rollout strategy keeps one
  (`episode_records`, matched by episode id);
- each loss term's `records_file` (the replay term's teacher preference pairs, `pairs.jsonl`).

Records carry their step; a run resumed or restored to a checkpoint drops those of later steps
before redoing them (`truncate_after`), as it does for `metrics.jsonl`. Episode records of episodes
that trained nothing (evaluation episodes, episodes whose prompt did not fit) are written when the
run ends, as records of kind `episode`.
"""

from __future__ import annotations

from pathlib import Path

from meshrl.training.records import append_records, trajectory_record, truncate_records

TRAJECTORIES = "trajectories.jsonl"


class RunRecords:
    """Writes ``loop``'s (a `GRPOLoop`) trajectories and its terms' records into ``run_dir``."""

    def __init__(self, run_dir: Path, loop):
        self.run_dir, self.loop = Path(run_dir), loop
        self.episodes: dict[str, dict] = {}
        """Environment episode records not yet written, by episode id."""

    def files(self) -> list[Path]:
        names = [TRAJECTORIES] + [term.records_file for term in self.loop.terms if term.records_file]
        return [self.run_dir / name for name in dict.fromkeys(names)]

    def truncate_after(self, step: int) -> None:
        """Drop every record of the steps after ``step`` (they are about to be redone)."""
        for path in self.files():
            truncate_records(path, step)

    def write_step(self, step: int, trained: list) -> None:
        """Append step ``step``'s records: every trajectory it sampled (``trained``: those it
        trained on, or a generation job exported) and what each term made."""
        self._take_episodes()
        chosen = {id(t) for t in trained}
        append_records(self.run_dir / TRAJECTORIES,
                       [trajectory_record(t, step, id(t) in chosen, self.episodes.pop(t.id, None))
                        for t in self.loop.sampled])
        for term in self.loop.terms:
            if term.records_file:
                append_records(self.run_dir / term.records_file, term.take_records())

    def _take_episodes(self) -> None:
        records = self.loop.strategy.episode_records
        n = len(records)  # the producer thread may append more meanwhile: those stay for next time
        for record in records[:n]:
            self.episodes[str(record.get("episode_id"))] = record
        del records[:n]

    def close(self, step: int) -> None:
        """The run ends after step ``step``: write the episode records no trajectory took."""
        self._take_episodes()
        append_records(self.run_dir / TRAJECTORIES,
                       [{**record, "kind": "episode", "step": step} for record in self.episodes.values()])
        self.episodes = {}
