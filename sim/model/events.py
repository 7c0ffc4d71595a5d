"""The discrete-event model of one rollout group generating its requests.

A group decodes up to `max_batch` rows at once; a finished row's slot goes to the next queued
request (after a prefill pass). Events are admissions and completions. Between two events the
batch is fixed, so the schedule's arm is fixed, and the segment's forward passes are summed in
closed form: each pass costs latency(rows, query tokens, KV tokens) evaluated at the segment's
middle context (exact for latency linear in context, as the fitted model is).

Each row emits its arm's mean accept length per pass (a fluid model of acceptance: the number
of passes a row needs is ceil(remaining / accept_len)). Rows with a pre-generated (bubble) draft
verify it whatever the schedule says, at no drafting cost; other rows follow the schedule.

Vocabulary: pass (one forward of the group), segment (passes between two events), emitted
(tokens committed), drafted (draft tokens verified), accepted (draft tokens verification accepts,
before a row's last pass is cut at its end, as the engine counts them). Pure: no randomness, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.config import BubbleSpec
from sim.model.latency import LatencyModel
from sim.model.schedule import Schedule


@dataclass(frozen=True)
class Segment:
    start_s: float
    passes: int
    kind: str  # "prefill", "off", an arm's name; "+bubble" when bubble drafts are verified
    rows: int
    spec_rows: int  # rows drafted by the drafter
    bubble_rows: int  # rows verifying a pre-generated draft
    depth: int  # draft levels per pass (0 when nothing is drafted)
    query_tokens: float  # per pass, summed over rows
    kv_tokens: float  # per pass, summed over rows, at the segment's middle
    forward_s: float  # per pass
    draft_s: float  # per pass
    other_s: float  # per pass
    emitted: float  # tokens committed over the segment
    drafted: float  # draft tokens verified over the segment
    accepted: float  # draft tokens accepted over the segment (a finishing row's uncut)

    @property
    def duration_s(self) -> float:
        return self.passes * (self.forward_s + self.draft_s + self.other_s)

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class GroupRollout:
    segments: tuple[Segment, ...]
    time_s: float
    tokens: float  # response tokens emitted

    @property
    def decode_passes(self) -> int:
        return sum(s.passes for s in self.segments if s.kind != "prefill")


def simulate_group(
    lengths: np.ndarray,  # [n] response lengths of this group's requests, in queue order
    *,
    prompt_len: int,
    max_batch: int,
    latency: LatencyModel,
    schedule: Schedule,
    bubble_mask: np.ndarray | None = None,  # [n] bool: request has a pre-generated draft
    bubble: BubbleSpec | None = None,
) -> GroupRollout:
    lengths = np.asarray(lengths, dtype=float)
    if np.any(lengths < 1):
        raise ValueError("response lengths must be >= 1")
    if bubble_mask is None:
        bubble_mask = np.zeros(len(lengths), dtype=bool)
    if bubble_mask.any() and bubble is None:
        raise ValueError("a bubble mask needs the bubble section (its depth and accept length)")
    segments: list[Segment] = []
    t, queued = 0.0, 0
    remaining = np.empty(0)
    context = np.empty(0)
    bub = np.empty(0, dtype=bool)
    while queued < len(lengths) or len(remaining):
        admit = min(max_batch - len(remaining), len(lengths) - queued)
        if admit > 0:
            seg = _prefill(t, admit, prompt_len, latency)
            segments.append(seg)
            t = seg.end_s
            remaining = np.concatenate([remaining, lengths[queued:queued + admit]])
            context = np.concatenate([context, np.full(admit, float(prompt_len))])
            bub = np.concatenate([bub, bubble_mask[queued:queued + admit]])
            queued += admit
        seg, emitted = _decode_segment(t, remaining, context, bub, latency, schedule, bubble)
        segments.append(seg)
        t = seg.end_s
        remaining = remaining - emitted
        context = context + emitted
        keep = remaining > 1e-9
        remaining, context, bub = remaining[keep], context[keep], bub[keep]
    return GroupRollout(tuple(segments), t, float(lengths.sum()))


def _prefill(t: float, rows: int, prompt_len: int, latency: LatencyModel) -> Segment:
    return Segment(start_s=t, passes=1, kind="prefill", rows=rows, spec_rows=0, bubble_rows=0, depth=0,
                   query_tokens=rows * prompt_len, kv_tokens=0.0, forward_s=latency.prefill_s(rows, prompt_len),
                   draft_s=0.0, other_s=0.0, emitted=0.0, drafted=0.0, accepted=0.0)


def _decode_segment(t, remaining, context, bub, latency, schedule, bubble) -> tuple[Segment, np.ndarray]:
    """The passes until the next row finishes; returns the segment and tokens emitted per row."""
    b = len(remaining)
    arm = schedule.arm_for(b)
    rate = np.ones(b)  # [b] tokens emitted per pass
    verify = np.ones(b)  # [b] tokens computed per pass
    drafting = ~bub if arm is not None else np.zeros(b, dtype=bool)
    if arm is not None:
        rate[drafting], verify[drafting] = arm.accept_len, arm.verify_tokens + 1
    if bub.any():
        rate[bub], verify[bub] = bubble.accept_len, bubble.depth + 1
    passes = int(np.ceil(remaining / rate - 1e-9).min())
    emitted = np.minimum(passes * rate, remaining)
    spec_rows, bubble_rows = int(drafting.sum()), int(bub.sum())
    query = float(verify.sum())
    kv_mid = float(context.sum() + (passes - 1) / 2 * rate.sum())
    depth = arm.depth if spec_rows else 0
    draft_s = depth * latency.draft_level_s(spec_rows * arm.topk) if spec_rows else 0.0
    kind = arm.name if spec_rows else "off"
    if bubble_rows:
        kind = f"{kind}+bubble" if spec_rows else "bubble"
    drafted = passes * (spec_rows * (arm.verify_tokens if spec_rows else 0) + bubble_rows * (bubble.depth if bubble_rows else 0))
    seg = Segment(start_s=t, passes=passes, kind=kind, rows=b, spec_rows=spec_rows, bubble_rows=bubble_rows,
                  depth=depth, query_tokens=query, kv_tokens=kv_mid, forward_s=latency.forward_s(b, query, kv_mid),
                  draft_s=draft_s, other_s=latency.other_s(b, query, schedule.drafts or bubble_rows > 0),
                  emitted=float(emitted.sum()),
                  drafted=float(drafted), accepted=float(passes * (rate - 1.0).sum()))
    return seg, emitted
