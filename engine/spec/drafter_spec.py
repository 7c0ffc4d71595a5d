"""DrafterSpec: the `engine.spec.drafter` string, parsed once into its ordered parts.

A drafter is one part, or a fallback composition of parts joined by '+' that are asked in order
per row (engine.spec.compose.FallbackDrafter): `pregenerated` (a row's pre-generated response,
pipeline.drafts.bubble), `history` (suffix match over the prompt's responses of earlier steps and its
finished siblings, engine.spec.history), `ngram` (suffix match over the prompt and its sibling
responses), and at most one *learned* drafter, a network at `engine.spec.drafter_path` of one of
engine.spec.eagle's kinds (eagle, eagle3, mtp, eagle3_vllm). The order is fixed: pregenerated,
history, ngram, learned; a pre-generated part needs another part after it for the rows that have
no pre-generated draft. So "eagle", "ngram+eagle3", "history+eagle" and
"pregenerated+history+ngram+eagle" are drafters; "eagle+ngram" is not.

Callers read the parsed record (`SpecConfig.drafter_spec`) instead of testing the string. This
module knows nothing of how the parts are built (engine.spec.factory) or which backend serves
which drafter (engine.backends).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

LEARNED = ("eagle", "eagle3", "mtp", "eagle3_vllm")  # engine.spec.eagle's network kinds
PARTS = ("pregenerated", "history", "ngram", *LEARNED)  # in the order a composition lists them
_RANK = {"pregenerated": 0, "history": 1, "ngram": 2, **{k: 3 for k in LEARNED}}


@dataclass(frozen=True)
class DrafterSpec:
    parts: tuple[str, ...]  # in the order they are asked, each in PARTS

    @classmethod
    def parse(cls, text: str, key: str = "engine.spec.drafter") -> DrafterSpec:
        """'pregenerated+ngram+eagle' -> DrafterSpec(('pregenerated', 'ngram', 'eagle')); ValueError
        naming `key` and the valid parts for an unknown part, a wrong order or a lone pregenerated."""
        parts = tuple(text.split("+"))
        for part in parts:
            if part not in PARTS:
                close = difflib.get_close_matches(part, PARTS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"{key}={text!r}: unknown part {part!r}{hint}; the parts are {', '.join(PARTS)}, joined "
                                 "with '+' in that order, e.g. pregenerated+ngram+eagle")
        ranks = [_RANK[p] for p in parts]
        if any(b <= a for a, b in zip(ranks, ranks[1:])):
            raise ValueError(f"{key}={text!r}: parts go in the order pregenerated, history, ngram, then at most one "
                             f"learned drafter ({', '.join(LEARNED)}), each at most once, e.g. pregenerated+history+eagle")
        if parts == ("pregenerated",):
            raise ValueError(f"{key}={text!r}: pre-generated drafts need a drafter after them for the rows without one, "
                             "e.g. pregenerated+eagle or pregenerated+ngram")
        return cls(parts)

    @staticmethod
    def names() -> tuple[str, ...]:
        """Every valid drafter string: single parts first, then the compositions."""
        heads = [(), ("history",), ("ngram",), ("history", "ngram")]
        tails = [(), *((k,) for k in LEARNED)]
        bodies = [h + t for h in heads for t in tails if h + t]
        specs = bodies + [("pregenerated", *b) for b in bodies]
        return tuple("+".join(s) for s in sorted(specs, key=len))

    @property
    def name(self) -> str:
        return "+".join(self.parts)

    @property
    def learned(self) -> str | None:
        """The learned part's network kind (a drafter at engine.spec.drafter_path), or None."""
        return next((p for p in self.parts if p in LEARNED), None)

    @property
    def pregenerated(self) -> bool:
        """Whether a row's pre-generated response is proposed first (bubble drafts)."""
        return self.parts[0] == "pregenerated"

    @property
    def history(self) -> int | None:
        """The history part's index in the composition (StepRecord.source), or None without one."""
        return self.parts.index("history") if "history" in self.parts else None

    @property
    def ngram(self) -> bool:
        return "ngram" in self.parts

    @property
    def composed(self) -> bool:
        """More than one part (a FallbackDrafter)."""
        return len(self.parts) > 1

    def __str__(self) -> str:
        return self.name
