"""Run checkpoints: everything a resumed run needs to continue exactly as if it had not stopped.

`runs/<run>/checkpoints/step-N/` holds `actor/` (the actor backend's own folder: weights,
optimizer, per-rank RNG state), `drafter/` when the engine has a model drafter, and `state.json`
(the RL step, the data loader's position, the engine's weights version, and any component
state such as a tuner's). Writing is collective and atomic: the actor folder first, then rank 0
writes `state.json` last, so a folder without it is an incomplete checkpoint and is refused.

A write that fails (a full disk, an I/O fault: common.atomic.WriteError) stops the run with an
error naming the folder, the free space and the previous complete checkpoint, which no write
touched: the run resumes from it with `trainer.resume=auto` once there is room.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic import WriteError, atomic_file, atomic_folder, storage_error, write_error

STATE = "state.json"


@dataclass(kw_only=True)
class RunState:
    step: int  # RL steps completed
    loader: dict
    engine_version: int
    components: dict = field(default_factory=dict)  # name -> JSON state (e.g. the tuner)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The run folder's complete checkpoint (with state.json) of the highest step, or None."""
    found = []
    for folder in (Path(run_dir) / "checkpoints").glob("step-*"):
        step = folder.name.removeprefix("step-")
        if step.isdigit() and (folder / STATE).is_file():
            found.append((int(step), folder))
    return max(found)[1] if found else None


def save_run(folder: Path, state: RunState, actor, drafter_net=None, *, main: bool, extras=None) -> None:
    """Collective: every rank calls it (the actor's save is collective). `extras`: name -> a
    function writing that subfolder atomically (rank 0, before state.json; e.g. the spot trainer's)."""
    folder = Path(folder)
    try:
        if main:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STATE).unlink(missing_ok=True)  # incomplete until state.json is written again
        actor.save(folder / "actor")
        if main:
            if drafter_net is not None:
                with atomic_folder(folder / "drafter") as tmp:
                    drafter_net.save(tmp)
            for name, write in (extras or {}).items():
                write(folder / name)
            with atomic_file(folder / STATE) as f:
                json.dump({"step": state.step, "loader": state.loader, "engine_version": state.engine_version,
                           "components": state.components}, f, indent=2)
    except WriteError as e:
        raise CheckpointWriteError(e.errno, _stopped(folder, e)) from e
    except Exception as e:  # a rank's own file in the actor's shared folder (not written through common.atomic)
        if (os_error := storage_error(e)) is None:
            raise
        raise CheckpointWriteError(os_error.errno, _stopped(folder, write_error(folder, os_error))) from e


class CheckpointWriteError(WriteError):
    """A run checkpoint could not be written; the message names the resume point left intact."""


def _stopped(folder: Path, e: WriteError) -> str:
    run_dir = folder.parent.parent
    previous = latest_checkpoint(run_dir)
    resume = (f"the previous checkpoint {previous} is intact: free space, then resume with run.dir={run_dir} "
              "trainer.resume=auto" if previous else "no earlier checkpoint exists: free space and start again")
    return f"checkpoint {folder} could not be written, the run stops: {e.strerror}; {resume}"


def load_run(folder: str | Path) -> RunState:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist (trainer.resume should name runs/<run>/checkpoints/step-N)")
    path = folder / STATE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint folder {folder} has no {STATE}: it is incomplete (the run stopped while writing it)")
    try:
        data = json.loads(path.read_text())
        return RunState(step=int(data["step"]), loader=dict(data["loader"]), engine_version=int(data["engine_version"]),
                        components=dict(data.get("components", {})))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path} is malformed ({type(e).__name__}: {e})") from None
