"""Calibration: a measured run's decode passes, rollouts and step timings fitted into a scenario.

Fits, over the run's decode passes after the warm-up step (`sim.calibration.runs`; non-negative least squares
on a small basis where a basis):
- forward_s: the linear basis base_s + query_s * query_tokens + kv_s * kv_tokens + attn_s *
  attention pairs (query tokens = rows x (1 + verify tokens), kv tokens = rows x mean context,
  attention pairs = query tokens x mean context), then a table over query tokens of the median
  forward seconds less the kv and attention terms, every point pooling at least
  `TABLE_MIN_PASSES` passes: a CPU's cost is not linear in the batch (it can stay flat over
  several row counts, then jump);
- draft_s = depth * (draft_base_s + draft_token_s * rows * topk) on speculative passes;
- other_s = other_base_s + other_row_s * rows + other_verify_s * verified draft tokens;
and from the timed steps after the warm-up (`sim.calibration.runs`): the prefill cost per prompt token (each
rank's rollout time less its decode passes, over its rows x prompt length), log-prob and update
costs (per padded token of the slowest rank when the run's config names its mini-batches,
`PhaseSpec.mini_batches`; else device-seconds per token) and the sync time. Directly: the accept
length of each shape (1 + accepted / rows over its passes), the prompt length (the median of each
rank's first mean context in a step) and the response lengths (the run's rollouts.jsonl,
resampled). The result is a complete `Scenario` of the measured setup (`latency.kind: fitted`).
Pure apart from `MeasuredRun` records.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from sim.config import (ArmSpec, BucketSpec, ClusterSpec, LatencySpec, LengthSpec, PhaseSpec, RolloutSpec, Scenario,
                        SpecSpec)
from sim.calibration.runs import DecodeStep, MeasuredRun, parse_shape
from sim.model.parts import padded_tokens

TABLE_MIN_PASSES = 5



def stratified_order(run: MeasuredRun) -> bool:
    """Whether the run's steps took a stratified prompt order: its config's trainer.prompt_order, and
    for `auto` the order its rank 0 log says the run chose (launch.run.problems.prompt_loader)."""
    order = (run.config.get("trainer") or {}).get("prompt_order")
    if order == "auto":
        log = run.folder / "rank0.log"
        return log.is_file() and "prompt order: stratified (" in log.read_text()
    return order == "stratified"

def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: refit without the columns that came out negative."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        if keep.any():
            coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


def r_squared(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> float:
    resid = y - x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0


def forward_table(steps: list[DecodeStep], kv_s: float, attn_s: float = 0.0,
                  min_passes: int = TABLE_MIN_PASSES) -> tuple[list[float], list[float]]:
    """(query tokens, median forward_s - kv_s * kv_tokens): passes pooled in ascending query
    tokens until a pool holds min_passes (a short last pool joins the one before)."""
    by: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        by[s.query_tokens].append(s.forward_s - kv_s * s.kv_tokens - attn_s * s.attn_pairs)
    pools: list[tuple[list[float], list[float]]] = []
    q_pool: list[float] = []
    y_pool: list[float] = []
    for q in sorted(by):
        q_pool += [float(q)] * len(by[q])
        y_pool += by[q]
        if len(y_pool) >= min_passes:
            pools.append((q_pool, y_pool))
            q_pool, y_pool = [], []
    if y_pool:
        if pools:
            pools[-1] = (pools[-1][0] + q_pool, pools[-1][1] + y_pool)
        else:
            pools.append((q_pool, y_pool))
    return [float(np.median(q)) for q, _ in pools], [float(np.median(y)) for _, y in pools]


def fit_latency(steps: list[DecodeStep], drafter: list[bool] | None = None) -> tuple[LatencySpec, dict[str, float]]:
    """`drafter[i]`: pass i ran on an engine with a drafter loaded (None: all did). Passes of both
    kinds tell the drafter's per-pass bookkeeping (other_drafter_s) apart from the rest."""
    if not steps:
        raise ValueError("calibration needs decode passes (decode_steps.jsonl is empty)")
    drafter = [True] * len(steps) if drafter is None else drafter
    x = np.array([[1.0, s.query_tokens, s.kv_tokens, s.attn_pairs] for s in steps])  # [P, 4]
    y = np.array([s.forward_s for s in steps])
    fwd = nnls(x, y)
    xo = np.array([[1.0, s.batch_size, s.query_tokens - s.batch_size, float(d)]
                   for s, d in zip(steps, drafter)])  # [P, 4]
    if len({s.query_tokens // s.batch_size for s in steps}) == 1:
        xo[:, 2] = 0.0  # one verify width throughout: its cost is not told apart from the rows'
    if len(set(drafter)) == 1:
        xo[:, 3] = 0.0  # one kind of engine throughout: the intercept holds the drafter's share
    other = nnls(xo, np.array([s.other_s for s in steps]))
    spec = [(s, parse_shape(s.shape)) for s in steps if s.shape != "off"]
    draft = np.zeros(2)
    if spec:
        xd = np.array([[d, d * s.batch_size * k] for s, (d, k, _) in spec])
        draft = nnls(xd, np.array([s.draft_s for s, _ in spec]))
    tokens, seconds = forward_table(steps, float(fwd[2]), float(fwd[3]))
    fitted = LatencySpec(kind="fitted", base_s=float(fwd[0]), query_s=float(fwd[1]), kv_s=float(fwd[2]), attn_s=float(fwd[3]),
                         table_tokens=tokens, table_s=seconds,
                         draft_base_s=float(draft[0]), draft_token_s=float(draft[1]),
                         other_base_s=float(other[0]), other_row_s=float(other[1]), other_verify_s=float(other[2]),
                         other_drafter_s=float(other[3]))
    return fitted, {"calibrate/forward_r2": r_squared(x, y, fwd), "calibrate/decode_passes": float(len(steps)),
                    "calibrate/table_points": float(len(tokens))}


def fit_arms(steps: list[DecodeStep]) -> list[ArmSpec]:
    """Each shape's accept length: 1 + accepted / rows over its passes (accepted as verification
    counts it, so a finishing row's last pass is not cut short: the event model cuts it itself);
    emitted / rows where the records lack `accepted`."""
    tokens: dict[str, int] = defaultdict(int)
    rows: dict[str, int] = defaultdict(int)
    counted: dict[str, bool] = defaultdict(lambda: True)
    for s in steps:
        if s.shape != "off":
            counted[s.shape] &= s.accepted is not None
    for s in steps:
        if s.shape != "off":
            tokens[s.shape] += s.accepted + s.batch_size if counted[s.shape] else s.emitted
            rows[s.shape] += s.batch_size
    arms = []
    for shape in sorted(tokens):
        depth, topk, verify = parse_shape(shape)
        accept = min(max(tokens[shape] / rows[shape], 1.0), verify + 1.0)
        arms.append(ArmSpec(name=shape, depth=depth, topk=topk, verify_tokens=verify, accept_len=accept))
    return arms


def fit_schedule(steps: list[DecodeStep], arms: list[ArmSpec]) -> SpecSpec:
    """The schedule the run ran: at each batch size, the shape its passes used most ("off"
    included), as buckets of consecutive batch sizes; one shape up to a batch size and off above
    it is the threshold schedule. A tuner's run (a shape per batch-size bucket, chosen by a
    bandit that also explores) gives its settled choice per bucket."""
    by_batch: dict[int, Counter] = defaultdict(Counter)
    for s in steps:
        by_batch[s.batch_size][s.shape] += 1
    if not any(shape != "off" for c in by_batch.values() for shape in c):
        return SpecSpec(arms=arms)
    buckets: list[BucketSpec] = []
    for b in sorted(by_batch):
        shape = by_batch[b].most_common(1)[0][0]
        if buckets and buckets[-1].arm == shape:
            buckets[-1] = BucketSpec(max_batch=b, arm=shape)
        else:
            buckets.append(BucketSpec(max_batch=b, arm=shape))
    while buckets and buckets[-1].arm == "off":  # off above the last bucket anyway
        buckets.pop()
    if not buckets:  # speculation was never the choice at any batch size
        return SpecSpec(arms=arms)
    if len(buckets) == 1:
        return SpecSpec(arms=arms, schedule="threshold", arm=buckets[0].arm, threshold=buckets[0].max_batch)
    return SpecSpec(arms=arms, schedule="buckets", buckets=buckets)


def first_contexts(steps: list[DecodeStep]) -> dict[tuple[int, int], float]:
    """(step, rank) -> the smallest mean context of its passes: the prompt length when it started."""
    first: dict[tuple[int, int], float] = {}
    for s in steps:
        key = (s.step, s.rank)
        first[key] = min(first.get(key, s.context_mean), s.context_mean)
    return first


def prompt_len(steps: list[DecodeStep]) -> int:
    return max(1, int(round(float(np.median(list(first_contexts(steps).values()))))))


def fit_prefill(run: MeasuredRun) -> float | None:
    """Seconds per prompt token admitted: each rank's rollout time less its decode passes (the
    prefill pass, admission and scoring), over its rows x its prompt length; None without
    per-rank rollout times."""
    passes: dict[tuple[int, int], float] = defaultdict(float)
    for s in run.decode_steps:
        passes[(s.step, s.rank)] += s.draft_s + s.forward_s + s.other_s
    prompts = first_contexts(run.decode_steps)
    rows = Counter((r.step, r.rank) for r in run.rollouts)
    gap = tokens = 0.0
    for m in run.timed_steps():
        for rank in range(int(m.get("world_size", 1))):
            key, name = (int(m["step"]), rank), f"timing/rollout/rank{rank}"
            if name in m and key in prompts:
                gap += max(float(m[name]) - passes[key], 0.0)
                tokens += rows[key] * prompts[key]
    return gap / tokens if tokens > 0 else None


def step_cut(cuts: dict[int, dict[int, list[list[int]]]] | None, step: int, ranks) -> list[list[np.ndarray]] | None:
    """A step's [rank][mini-batch] trained lengths from MeasuredRun.trained_mini_batches (None: the
    records name no mini-batches, so padded_tokens cuts each rank's rows evenly)."""
    if cuts is None or step not in cuts:
        return None
    return [[np.asarray(mb, dtype=np.int64) for mb in cuts[step][r]] for r in ranks]


def fit_phases(run: MeasuredRun, prompt: int) -> PhaseSpec:
    """Log-prob and update costs per token (padded, per rank, when config.yaml names the
    trainer's mini-batches; else device-seconds per real token) and the sync time."""
    mini_batches, epochs = run.trainer("mini_batches", 0), run.trainer("ppo_epochs", 1)
    micro = run.setting("actor", "micro_batch_tokens", 0) if mini_batches else 0
    probe = PhaseSpec(mini_batches=mini_batches, ppo_epochs=epochs, micro_batch_tokens=micro)
    by_rank = run.trained_lengths_by_rank()
    cuts = run.trained_mini_batches()
    seconds: dict[str, float] = defaultdict(float)
    tokens: dict[str, float] = defaultdict(float)
    sync = []
    for m in run.timed_steps():
        step = m["step"]
        parts = [np.asarray(v, dtype=np.int64) for _, v in sorted(by_rank.get(step, {}).items())]
        if not parts:
            continue
        if mini_batches:
            real, padded = padded_tokens(probe, parts, prompt, step_cut(cuts, step, sorted(by_rank[step])))
            counts = {"logprob": real, "update": padded * epochs}
        else:  # device-seconds per token: seconds x devices / tokens
            per_device = float(sum(p.sum() + len(p) * prompt for p in parts)) / m.get("world_size", 1)
            counts = {"logprob": per_device, "update": per_device * epochs}
        for key in ("logprob", "update"):
            if f"timing/{key}" in m and counts[key] > 0:
                seconds[key] += m[f"timing/{key}"]
                tokens[key] += counts[key]
        if "timing/sync" in m:
            sync.append(m["timing/sync"])
    per = {k: seconds[k] / tokens[k] for k in tokens}
    generated = sum(r.length for r in run.rollouts)
    trained = sum(sum(sum(v) for v in ranks.values()) for ranks in by_rank.values())
    return PhaseSpec(logprob_s_per_token=per.get("logprob", 0.0), update_s_per_token=per.get("update", 0.0),
                     sync_s=float(np.mean(sync)) if sync else 0.0, mini_batches=mini_batches, ppo_epochs=epochs,
                     micro_batch_tokens=micro, update_share=trained / generated if generated else 1.0,
                     row_deal=bool(mini_batches) and (run.config.get("trainer") or {}).get("train_shares") == "tokens")


def calibrate(run: MeasuredRun, plain: MeasuredRun | None = None) -> tuple[Scenario, dict[str, float]]:
    """The scenario of `run`; with `plain`, a run of the same model and machine without a drafter
    (engine.spec.enabled=false), whose passes join the latency fit so that a drafter-less pass is
    priced as measured (other_drafter_s) and the forward table reaches one token a row."""
    if not run.rollouts:
        raise ValueError(f"{run.folder}: rollouts.jsonl is empty; the length distribution comes from it")
    passes = run.settled_passes()
    flags = [run.has_drafter] * len(passes)
    fit_passes = passes
    if plain is not None:
        if plain.has_drafter:
            raise ValueError(f"--plain {plain.folder} ran with a drafter (engine.spec.enabled is not false in its "
                             "config.yaml): give a run without speculation")
        extra = plain.settled_passes()
        fit_passes, flags = passes + extra, flags + [False] * len(extra)
    latency, metrics = fit_latency(fit_passes, flags)
    prefill = fit_prefill(run)
    if prefill is not None:
        latency.prefill_token_s = prefill
    arms = fit_arms(passes)
    prompt = prompt_len(passes)
    per_step = Counter(r.step for r in run.rollouts)
    requests = int(np.median(list(per_step.values())))
    samples = max(r.sample for r in run.rollouts) + 1
    # With several samples a prompt, whole groups are resampled: how alike a prompt's samples are
    # is what split groups (Techniques.split) act on.
    # A run with a stratified prompt order has every step hold its set's spread; its projection too.
    stratified = samples > 1 and stratified_order(run)
    lengths = LengthSpec(kind="empirical", path=str((run.folder / "rollouts.jsonl").resolve()),
                         max_len=max(r.length for r in run.rollouts), by_prompt=samples > 1, stratified=stratified)
    scn = Scenario(
        name=f"calibrated-{run.name}", steps=len(per_step), latency=latency,
        cluster=ClusterSpec(devices=[run.world], tensor_parallel=1,
                            max_batch=max(s.batch_size for s in run.decode_steps)),
        rollout=RolloutSpec(prompts=max(1, requests // samples), samples_per_prompt=samples, prompt_len=prompt,
                            lengths=lengths),
        spec=fit_schedule(passes, arms), phases=fit_phases(run, prompt))
    metrics.update({f"calibrate/accept_len/{a.name}": a.accept_len for a in arms})
    metrics["calibrate/prompt_len"] = float(prompt)
    metrics["calibrate/timed_steps"] = float(len(run.timed_steps()))
    return scn, metrics
