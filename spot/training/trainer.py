"""Online ("spot") training of the EAGLE drafter: preemptible micro-steps and atomic checkpoints.

A *micro-step* is one AdamW step (spot.training.step.DrafterTrainer, shared with warm-start:
the EAGLE loss, clipping) on the response pairs of a few rows packed into windows whose masks
keep rows apart (spot.training.pairs.PackedPairs), run `chunk_windows` windows at a time with their
gradients accumulated: the step of the whole batch, with one chunk's activations held. `train`
runs micro-steps until a preempt flag, a step count or the rows run out; it checks the flag
before every micro-step and inside it, after each chunk's forward and backward, so it stops
within about half a chunk's time of the flag. A micro-step the flag cuts short is dropped
whole (a preempted job then resumes to an uninterrupted run's weights), or, with `keep_cut`
(an idle window's end, spot.coordinator), taken on the chunks done, a smaller batch: the work
done in the window counts, and windows shorter than a whole micro-step still train. The
chunks run in an order keyed by (seed, micro-step), so a cut step is not biased to the rows
packing put first.
The learning rate warms up and then stays constant (optim.lr_at with progress 0): online
training has no end for a cosine to aim at.

The model is the caller's own copy: the engine's drafter is never trained in place; it reloads
`named_weights()` through `engine.load_drafter_weights`. Randomness (which rows a micro-step
takes when given more than `rows_per_step`) is keyed by (seed, micro-step index), so a
checkpoint needs no RNG state beyond the seed and the micro-step count.

A *checkpoint* is a folder `ckpt-<micro_steps>` written whole by common.atomic.atomic_folder:
`drafter.safetensors` (the trainable weights only: not the target's shared embedding and LM
head, not the draft vocabulary, which `trainer.json` identifies by a digest), `optimizer.pt`
(AdamW's state) and `trainer.json` (micro_steps, settings, what model it fits, and the size and
SHA-256 of each file). A folder whose files do not match that manifest is incomplete:
`latest_checkpoint` skips it and `resume` refuses it with a ValueError naming it;
`prune_checkpoints` removes all but the newest few complete ones.

The target's embedding and LM head are read through the model (EagleModel.refresh_head): after
the target's weights change the caller calls `model.refresh_head()` before the next micro-step.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import load, save

from common.atomic import atomic_folder
from engine.spec.eagle import EagleModel, copy_named_weights
from spot.training.step import DrafterOptim, DrafterTrainer, Reduce
from spot.training.pairs import PackedPairs
from spot.training.records import HiddenStateRows

WEIGHTS, OPTIMIZER, META = "drafter.safetensors", "optimizer.pt", "trainer.json"
FORMAT = 1
CKPT = re.compile(r"ckpt-(\d+)")


class SpotTrainer:
    """Trains a copy of the drafter online from rows; preemptible between micro-steps; atomic checkpoints."""

    def __init__(self, model: EagleModel, optim: DrafterOptim, *, window: int = 256, rows_per_step: int = 8,
                 seed: int = 0, chunk_windows: int | None = 1) -> None:
        if window < 1 or rows_per_step < 1 or (chunk_windows is not None and chunk_windows < 1):
            raise ValueError(f"window, rows_per_step and chunk_windows must be >= 1, got {window}, {rows_per_step} "
                             f"and {chunk_windows}")
        self.model, self.optim = model, optim
        self.window, self.rows_per_step, self.seed = window, rows_per_step, seed
        self.chunk_windows = chunk_windows  # windows per forward/backward; None: the whole micro-step at once
        self.step_fn = DrafterTrainer(model, optim)
        self.micro_steps = 0

    # -- training --------------------------------------------------------------------------
    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.micro_steps)

    def choose_rows(self, rows: list[HiddenStateRows]) -> list[HiddenStateRows]:
        """The rows with a response pair; at most rows_per_step of them, keyed by (seed, micro-step)."""
        rows = [r for r in rows if r.response_len > 0]
        if len(rows) <= self.rows_per_step:
            return rows
        keep = torch.randperm(len(rows), generator=self._generator())[: self.rows_per_step].sort().values
        return [rows[i] for i in keep.tolist()]

    def micro_step(self, rows: list[HiddenStateRows], abort: Callable[[], bool] | None = None,
                   keep_cut: bool = False, reduce: Reduce | None = None) -> dict[str, float] | None:
        """One AdamW step on the rows' response pairs, chunk by chunk; None when `abort` said stop
        inside it (nothing changed, nothing counted), except with `keep_cut`: then the step is
        taken on the chunks done (`spot/cut` 1, `spot/pairs` fewer than `spot/rows_pairs`) and
        None only when no chunk was done. `reduce`: the gradients' combination across processes
        before the optimiser step (spot.pool.elastic's members; DrafterTrainer.step)."""
        rows = self.choose_rows(rows)
        if not rows:
            raise ValueError("micro_step: no row has a response token to learn from")
        packed = PackedPairs(rows, self.window)
        lr = self.optim.lr_at(self.micro_steps, 0.0)
        order = torch.randperm(len(packed), generator=self._generator())  # [B] windows, in the order they run
        done = self.step_fn.step(packed, order, lr, abort, chunk=self.chunk_windows, keep_cut=keep_cut, reduce=reduce)
        if done is None:
            return None
        loss, metrics = done
        self.micro_steps += 1
        return {
            "spot/drafter_loss": loss, "spot/top1": metrics["spot/top1_draft_vocab"],
            "spot/feature_loss": metrics["spot/feature_loss"], "spot/ce_loss": metrics["spot/ce_loss"],
            "spot/pairs": metrics["spot/step_pairs"], "spot/rows_pairs": float(packed.num_pairs),
            "spot/rows": float(len(rows)), "spot/lr": lr, "spot/cut": metrics["spot/cut"],
            "spot/dropped_s": metrics["spot/dropped_s"],
        }

    def zero_micro_step(self, reduce: Reduce) -> None:
        """A micro-step without rows of its own: the other processes' combined gradients (`reduce`,
        given zeros from here) are stepped as theirs are, so the replicas stay identical and the
        micro-step count (the learning rate's schedule, the rows' keys) advances with them."""
        self.step_fn.reduced_step(self.optim.lr_at(self.micro_steps, 0.0), reduce)
        self.micro_steps += 1

    def train(self, next_rows: Callable[[int], list[HiddenStateRows]], should_stop: Callable[[], bool],
              max_micro_steps: int | None = None, keep_cut: bool = False) -> dict[str, float]:
        """Micro-steps until should_stop(), max_micro_steps, or next_rows(i) == [].

        should_stop is checked before each micro-step and inside it (after each chunk's forward
        and backward, `micro_step`): the micro-step in flight when it turns true is cut short
        (`spot/aborted` 1): dropped whole, or with `keep_cut` taken on its chunks done. next_rows
        gets the trainer's total micro-step index, so a resumed run sees the same rows. Returns
        the count, mean loss and top-1 of this call's micro-steps taken (loss and top-1 only when
        it took one), its wall time, and how much of that went to work dropped when
        should_stop() turned true (`spot/dropped_s`: a chunk, or a micro-step none of whose
        chunks was done).
        """
        t0 = time.perf_counter()
        losses, top1, aborted, dropped_s = [], [], 0, 0.0
        while max_micro_steps is None or len(losses) < max_micro_steps:
            if should_stop():
                break
            rows = next_rows(self.micro_steps)
            if not rows:
                break
            t = time.perf_counter()
            m = self.micro_step(rows, should_stop, keep_cut)
            if m is None:
                aborted, dropped_s = aborted + 1, time.perf_counter() - t
                break
            losses.append(m["spot/drafter_loss"])
            top1.append(m["spot/top1"])
            if m["spot/cut"]:
                aborted, dropped_s = aborted + 1, m["spot/dropped_s"]
                break
        out = {"spot/micro_steps": float(len(losses)), "spot/aborted": float(aborted), "spot/train_s": time.perf_counter() - t0,
               "spot/dropped_s": dropped_s}  # the dropped micro-step's time, within train_s
        if losses:
            out |= {"spot/drafter_loss": sum(losses) / len(losses), "spot/top1": sum(top1) / len(top1)}
        return out

    # -- weights ---------------------------------------------------------------------------
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Copies of the trainable weights, named as EagleDrafter.load_weights wants them."""
        return [(n, p.detach().clone()) for n, p in self.model.named_parameters()]

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replaces every trainable weight in place (e.g. after an average across ranks); the optimiser state stays."""
        copy_named_weights(self.model, named)

    # -- checkpoints -----------------------------------------------------------------------
    def model_signature(self) -> dict:
        """What a checkpoint must agree on to be loaded into this model."""
        c = self.model.config
        vocab = self.model.draft_vocab.detach().cpu().contiguous()
        return {"kind": c.kind, "hidden_size": c.hidden_size, "feature_size": c.feature_size,
                "vocab_size": c.vocab_size, "draft_vocab_sha256": hashlib.sha256(vocab.numpy().tobytes()).hexdigest()}

    def save(self, path: Path) -> None:
        """Writes the checkpoint folder `path` whole (see the module docstring), replacing one there."""
        weights = {n: t.cpu().contiguous() for n, t in self.named_weights()}
        opt = io.BytesIO()
        torch.save(self.step_fn.opt.state_dict(), opt)
        blobs = {WEIGHTS: save(weights, metadata={"format": "pt"}), OPTIMIZER: opt.getvalue()}
        meta = {
            "format": FORMAT, "micro_steps": self.micro_steps, "seed": self.seed, "window": self.window,
            "rows_per_step": self.rows_per_step, "model": self.model_signature(),
            "files": {name: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for name, b in blobs.items()},
        }
        with atomic_folder(path) as tmp:
            for name, b in blobs.items():
                (tmp / name).write_bytes(b)
            (tmp / META).write_text(json.dumps(meta, indent=1))

    @classmethod
    def resume(cls, path: Path, model: EagleModel, optim: DrafterOptim, **kw) -> SpotTrainer:
        """A trainer in the state `save` wrote to `path`; settings not in kw come from the checkpoint."""
        path = Path(path)
        meta = read_meta(path)
        blobs = {}
        for name, want in meta["files"].items():
            b = (path / name).read_bytes()
            if hashlib.sha256(b).hexdigest() != want["sha256"]:
                raise ValueError(f"checkpoint {path}: {name} is corrupt (its SHA-256 differs from {META}'s); "
                                 f"resume from an earlier checkpoint or delete {path}")
            blobs[name] = b
        settings = {k: meta[k] for k in ("window", "rows_per_step", "seed")} | kw
        trainer = cls(model, optim, **settings)
        if meta["model"] != trainer.model_signature():
            raise ValueError(f"checkpoint {path} was written for a drafter {meta['model']}, this one is {trainer.model_signature()}")
        try:
            trainer.load_weights(load(blobs[WEIGHTS]).items())
            trainer.step_fn.opt.load_state_dict(torch.load(io.BytesIO(blobs[OPTIMIZER]), map_location="cpu"))
        except (ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"checkpoint {path} does not load into this drafter: {e}") from e
        trainer.micro_steps = meta["micro_steps"]
        return trainer


def checkpoint_path(folder: Path, micro_steps: int) -> Path:
    return Path(folder) / f"ckpt-{micro_steps}"


def read_meta(path: Path) -> dict:
    """trainer.json of a complete checkpoint folder (files present with the sizes it names), else ValueError."""
    try:
        meta = json.loads((path / META).read_text())
        files = meta["files"]
        if meta["format"] != FORMAT or set(files) != {WEIGHTS, OPTIMIZER}:
            raise ValueError(f"format {meta['format']} with files {sorted(files)}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {path} is incomplete or not a spot checkpoint ({META}: {e}); "
                         f"resume from an earlier one or delete it") from e
    for name, want in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != want["bytes"]:
            raise ValueError(f"checkpoint {path} is incomplete: {name} is missing or not {want['bytes']} bytes; "
                             f"resume from an earlier one or delete it")
    return meta


def complete(path: Path, micro_steps: int) -> bool:
    try:
        return read_meta(path)["micro_steps"] == micro_steps
    except ValueError:
        return False


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(n, folder/ckpt-<n>) for every checkpoint-named folder, complete or not, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(((int(m[1]), p) for p in folder.iterdir() if (m := CKPT.fullmatch(p.name)) and p.is_dir()),
                  reverse=True)


def latest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint `folder/ckpt-<n>` of highest n, or None; incomplete ones are skipped."""
    return next((p for n, p in checkpoints(folder) if complete(p, n)), None)


def prune_checkpoints(folder: Path, keep: int = 2) -> list[Path]:
    """Removes every checkpoint older than the newest `keep` complete ones; -> the removed folders."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}: the newest complete checkpoint is what a restart resumes from")
    found = checkpoints(folder)
    kept = [n for n, p in found if complete(p, n)][:keep]
    if len(kept) < keep:
        return []
    removed = [p for n, p in found if n < kept[-1]]
    for p in removed:
        shutil.rmtree(p)
    return removed
