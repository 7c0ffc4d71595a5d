"""`python -m launch.export`: an actor checkpoint (torch, DeepSpeed ZeRO-3 on two ranks) becomes a
Hugging Face folder whose weights are the trained ones, which transformers loads and whose greedy
tokens are the engine's on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from launch.export import export, main
from pipeline.actors import ActorConfig, build_actor
from tests.conftest import make_hf_model
from tests.mp.actor_worker import make_batch, pg_loss
from tests.test_actors import run_actor_worker

PROMPTS = [[5, 9, 17, 4], [8, 3, 30], [11, 12, 13, 14, 15]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(2,))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export-model")
    make_hf_model("llama").save_pretrained(path)
    return path


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def engine_greedy(model_dir: Path, weights: dict[str, torch.Tensor]) -> list[list[int]]:
    """The engine's greedy tokens after loading `weights` (as the run's weight sync does)."""
    from engine.types import Request

    engine = RolloutEngine(load_checkpoint(model_dir), EngineConfig(max_batch=4, max_len=64, spec=SpecConfig(enabled=False)))
    engine.load_weights(weights.items(), version=1)
    batch = engine.generate([Request(prompt_id=str(i), prompt=p, n=1) for i, p in enumerate(PROMPTS)], GREEDY)
    return [r.tokens for r in sorted(batch, key=lambda r: int(r.prompt_id))]


def transformers_greedy(folder: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=2,
                             pad_token_id=0)[0, len(p):].tolist()
        out.append(ids)
    return out


def test_a_torch_actor_checkpoint_exports_its_trained_weights_with_the_tokenizer(model_dir, char_model_dir, tmp_path):
    actor = build_actor(ActorConfig(lr=1e-3), model_dir)
    actor.update(make_batch(), pg_loss)
    actor.save(tmp_path / "run" / "checkpoints" / "step-1" / "actor")
    trained = {k: w.clone() for k, w in actor.named_weights()}
    assert main([str(tmp_path / "run" / "checkpoints" / "step-1"), str(tmp_path / "hf"), "--tokenizer",
                 str(char_model_dir)]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer_config.json").is_file()
    got = hf_weights(tmp_path / "hf")
    assert trained.keys() <= got.keys() and all(torch.equal(got[k], trained[k]) for k in trained)


def test_an_export_without_a_tokenizer_to_copy_names_the_flag(model_dir, tmp_path):
    actor = build_actor(ActorConfig(lr=1e-3), model_dir)
    actor.save(tmp_path / "actor")
    with pytest.raises(FileNotFoundError, match="give --tokenizer"):
        export(tmp_path / "actor", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_zero3_checkpoint_of_two_ranks_exports_weights_transformers_loads_and_the_engine_decodes_alike(
        model_dir, char_model_dir, tmp_path):
    run_actor_worker(model_dir, tmp_path, 2, "--backends", "zero3")
    trained = torch.load(tmp_path / "weights-zero3-rank0.pt")  # named_weights at the save: what the engine is sent
    initial = make_hf_model("llama").state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)  # the weights moved
    export(tmp_path / "ckpt-zero3", tmp_path / "hf", tokenizer=str(char_model_dir))
    got = hf_weights(tmp_path / "hf")
    assert all(torch.equal(got[k], trained[k]) for k in trained), "the exported weights are not the trained ones"
    served = engine_greedy(model_dir, trained)
    assert engine_greedy(tmp_path / "hf", got) == served
    assert transformers_greedy(tmp_path / "hf") == served
    assert any(len(t) > 3 for t in served)
