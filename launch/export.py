"""`python -m launch.export CHECKPOINT OUT [--dtype auto|bfloat16|float16|float32] [--tokenizer PATH]`:
a run checkpoint as a Hugging Face folder (config.json, *.safetensors, tokenizer) that transformers
loads and vLLM serves.

CHECKPOINT is a run checkpoint (`runs/<run>/checkpoints/step-N`) or its `actor/` folder. What the
actor folder holds decides how its weights are read:
- the torch backend (one process or DDP) and DeepSpeed ZeRO-1 / 2: the model as a Hugging Face
  folder already (every rank holds the whole model; rank 0 saved it): loaded and saved again;
- DeepSpeed ZeRO-3: each rank's partition of the float32 master weights in its optimizer state
  (`zero_rank{r}.pt`), joined into whole tensors the way DeepSpeed's zero_to_fp32 reads them
  (pipeline.actors.zero_reshard) from the parameter shapes saved beside them
  (`zero3_param_shapes.pt`), then cast to the model's dtype:
  the weights the engine serves after the same step (ZeRO-3 casts its masters so).
The tokenizer comes from `--tokenizer`, else the run's model folder (`model.path` in the run's
config.yaml, two folders above the checkpoint). `--dtype auto` keeps the model config's
`torch_dtype`. The output is written atomically: OUT appears only when whole.

Megatron checkpoints (pipeline/actors/megatron_actor.py) are not read here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

from common.atomic import atomic_folder

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def actor_folder(checkpoint: str | Path) -> Path:
    """The actor folder of a run checkpoint (or `checkpoint` itself if it is one); FileNotFoundError if neither."""
    path = Path(checkpoint)
    for folder in (path / "actor", path):
        if (folder / "config.json").is_file() or any(folder.glob("zero_rank*.pt")):
            return folder
    raise FileNotFoundError(f"{path} is neither a run checkpoint (runs/<run>/checkpoints/step-N, with actor/) nor an "
                            "actor checkpoint folder (config.json with model weights, or zero_rank*.pt)")


def zero3_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The whole float32 weights of a ZeRO-3 actor checkpoint, by parameter name (pipeline.actors.zero_reshard)."""
    from pipeline.actors.zero_files import ZERO3_SHAPES, saved_states, saved_world_and_stage
    from pipeline.actors.zero_reshard import FLATS, zero3_whole

    shapes_file = folder / ZERO3_SHAPES
    if not shapes_file.is_file():
        raise FileNotFoundError(f"{folder} holds ZeRO-3 partitions but no {ZERO3_SHAPES} (the parameter shapes that join "
                                "them): export a checkpoint that the deepspeed actor saved with it")
    world, _ = saved_world_and_stage(folder)
    shapes = {n: torch.Size(s) for group in torch.load(shapes_file)["param_shapes"] for n, s in group.items()}
    whole = zero3_whole([s[FLATS] for s in saved_states(folder, world)], [s.numel() for s in shapes.values()])
    return {n: w.view(s) for (n, s), w in zip(shapes.items(), whole)}


def tokenizer_source(checkpoint: Path, given: str | None) -> Path:
    """Where the tokenizer is: `given`, else the run's model.path from its config.yaml."""
    if given:
        return Path(given)
    run_config = checkpoint.resolve().parent.parent / "config.yaml"
    if run_config.is_file():
        model = (yaml.safe_load(run_config.read_text()) or {}).get("model", {}).get("path")
        if model:
            return Path(model)
    raise FileNotFoundError(f"no tokenizer for {checkpoint}: the run's config.yaml ({run_config}) names no model.path; "
                            "give --tokenizer <the model's Hugging Face folder>")


def export(checkpoint: str | Path, out: str | Path, *, dtype: str = "auto", tokenizer: str | None = None) -> Path:
    """Writes the checkpoint's model as a Hugging Face folder at `out`; returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    checkpoint = Path(checkpoint)
    folder = actor_folder(checkpoint)
    config = AutoConfig.from_pretrained(folder)
    torch_dtype = DTYPES[dtype] if dtype != "auto" else (config.dtype or torch.float32)
    if isinstance(torch_dtype, str):
        torch_dtype = DTYPES[torch_dtype]
    if any(folder.glob("zero_rank*.pt")) and not any(folder.glob("model*.safetensors")):
        weights = zero3_state_dict(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.load_state_dict({k: v.to(torch_dtype) for k, v in weights.items()}, strict=False, assign=True)
        model.tie_weights()  # a tied LM head is not among the partitions: it is the embedding
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"{folder}: the ZeRO-3 partitions hold no weights for {', '.join(missing[:5])}")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    tok = AutoTokenizer.from_pretrained(tokenizer_source(checkpoint, tokenizer))
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="runs/<run>/checkpoints/step-N (or its actor/ folder)")
    p.add_argument("out", help="the Hugging Face folder to write")
    p.add_argument("--dtype", default="auto", help="auto (the model config's), bfloat16, float16 or float32")
    p.add_argument("--tokenizer", default=None, help="the tokenizer's folder (default: the run's model.path)")
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, dtype=args.dtype, tokenizer=args.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} (transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}); vLLM: vllm serve {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
