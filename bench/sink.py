"""`python -m bench.sink --model DIR --batch 1,8`: the cost of a feature sink on decode steps.

The same requests are generated twice per batch size, without and with a `FeatureSink` that
copies every committed token's features into a preallocated buffer (what a DataBuffer producer
does); tokens must be identical. Prints wall time per decode step of both and the overhead
(with / without - 1). `--json` ends with `{"overhead": {B: x}, "step_ms": ..., "baseline_step_ms": ...}`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import batch_list, chat_prompts, cpu_model, timed, finish
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.features import CommittedFeatures
from engine.sampling import SamplingParams
from engine.types import Request
from common.text import load_tokenizer, stop_tokens


class BufferSink:
    """Copies features into a preallocated ring of rows (a DataBuffer's producer side, in process)."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, rows: int, width: int) -> None:
        self.buf = torch.empty(rows, width)
        self.pos = 0

    def _put(self, feats: torch.Tensor) -> None:
        n = feats.shape[0]
        if self.pos + n > self.buf.shape[0]:
            self.pos = 0
        self.buf[self.pos : self.pos + n] = feats
        self.pos += n

    def prompt(self, prompt_id, tokens, features, policy_version) -> None:
        self._put(features)

    def tokens(self, entries: CommittedFeatures) -> None:
        self._put(entries.features)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sink", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--batch", type=batch_list, default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        model = load_checkpoint(args.model)
        tok = load_tokenizer(args.model)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    engine = RolloutEngine(model, EngineConfig(max_batch=max(args.batch), max_len=1024))
    sink = BufferSink(1 << 16, model.config.hidden_size)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=stop_tokens(model.config, tok))
    result = {"overhead": {}, "step_ms": {}, "baseline_step_ms": {}, "identical": True}
    print(f"cpu: {cpu_model()}", file=sys.stderr)
    print(f"{'batch':>5} {'no sink ms/step':>16} {'sink ms/step':>13} {'overhead':>9}", file=sys.stderr)
    for b in args.batch:
        reqs = [Request(prompt_id=f"s{i}", prompt=x) for i, x in enumerate(chat_prompts(tok, b))]
        engine.sink = None
        engine.generate(reqs, params)  # warm-up
        ref, t_off = timed(lambda: engine.generate(reqs, params), args.repeat)
        engine.sink = sink
        out, t_on = timed(lambda: engine.generate(reqs, params), args.repeat)
        steps = len(ref.steps)
        result["identical"] &= [r.tokens for r in ref] == [r.tokens for r in out]
        key = str(b)
        result["step_ms"][key] = round(t_on / steps * 1e3, 3)
        result["baseline_step_ms"][key] = round(t_off / steps * 1e3, 3)
        result["overhead"][key] = round(t_on / t_off - 1, 4)
        print(f"{b:>5} {t_off / steps * 1e3:>16.2f} {t_on / steps * 1e3:>13.2f} {t_on / t_off - 1:>9.1%}", file=sys.stderr)
    finish(result, args.json)
    return 0 if result["identical"] else 2


if __name__ == "__main__":
    sys.exit(main())
