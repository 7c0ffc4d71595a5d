"""engine.spec.drafter parsed once into a DrafterSpec: parts in order, properties, and errors that name the key."""

from __future__ import annotations

import pytest

from engine.spec.compose import FallbackDrafter
from engine.spec.config import DRAFTERS, SpecConfig
from engine.spec.drafter_spec import LEARNED, PARTS, DrafterSpec
from engine.spec.eagle import KINDS
from engine.spec.factory import build_drafter


@pytest.mark.parametrize(
    "text,parts,learned,pregenerated,ngram",
    [
        ("eagle", ("eagle",), "eagle", False, False),
        ("ngram", ("ngram",), None, False, True),
        ("ngram+eagle3", ("ngram", "eagle3"), "eagle3", False, True),
        ("pregenerated+mtp", ("pregenerated", "mtp"), "mtp", True, False),
        ("pregenerated+ngram+eagle3_vllm", ("pregenerated", "ngram", "eagle3_vllm"), "eagle3_vllm", True, True),
    ],
)
def test_a_drafter_string_parses_into_its_ordered_parts(text, parts, learned, pregenerated, ngram):
    spec = DrafterSpec.parse(text)
    assert spec.parts == parts and spec.name == str(spec) == text
    assert (spec.learned, spec.pregenerated, spec.ngram, spec.composed) == (learned, pregenerated, ngram, len(parts) > 1)


def test_every_listed_drafter_parses_back_to_itself_and_the_learned_parts_are_the_network_kinds():
    assert set(LEARNED) == set(KINDS)
    for name in ("eagle", "eagle3", "eagle3_vllm", "mtp", "ngram", "ngram+eagle", "pregenerated+ngram+eagle3", "history",
                 "history+eagle", "pregenerated+history+ngram+eagle"):
        assert name in DRAFTERS
    assert len(set(DRAFTERS)) == len(DRAFTERS) == 38
    for name in DRAFTERS:
        assert DrafterSpec.parse(name).name == name


@pytest.mark.parametrize(
    "text,message",
    [
        ("egle", r"engine\.spec\.drafter='egle': unknown part 'egle' \(did you mean 'eagle'\?\); the parts are "
                 + ", ".join(PARTS)),
        ("ngram+foo", r"unknown part 'foo'; the parts are pregenerated"),
        ("", "unknown part ''"),
        ("eagle+ngram", "parts go in the order pregenerated, history, ngram, then at most one learned drafter"),
        ("ngram+history", "parts go in the order"),
        ("ngram+ngram", "each at most once"),
        ("eagle+eagle3", "at most one learned drafter"),
        ("ngram+pregenerated", "parts go in the order"),
        ("pregenerated", "need a drafter after them"),
    ],
)
def test_bad_drafter_strings_raise_naming_the_key_and_the_valid_parts(text, message):
    with pytest.raises(ValueError, match=message):
        DrafterSpec.parse(text)
    with pytest.raises(ValueError, match="engine.spec.drafter"):
        SpecConfig(drafter=text).validate()


def test_the_config_parses_at_validation_and_again_only_when_the_string_changes():
    cfg = SpecConfig(drafter="ngram+eagle", drafter_path="somewhere")
    cfg.validate()
    first = cfg.drafter_spec
    assert first is cfg.drafter_spec and first.learned == "eagle"
    cfg.drafter = "pregenerated+ngram"  # a dotted override after validation
    assert cfg.drafter_spec.parts == ("pregenerated", "ngram")


def test_a_learned_part_needs_a_drafter_path_and_a_model_free_one_does_not():
    with pytest.raises(ValueError, match="engine.spec.drafter=ngram\\+eagle3 needs engine.spec.drafter_path"):
        SpecConfig(enabled=True, drafter="ngram+eagle3").validate()
    SpecConfig(enabled=True, drafter="pregenerated+ngram").validate()


def test_the_factory_builds_the_parts_in_order():
    drafter = build_drafter(SpecConfig(enabled=True, drafter="pregenerated+ngram"), target=None)
    assert isinstance(drafter, FallbackDrafter)
    assert [d.name for d in drafter.drafters] == ["pregenerated", "ngram"]
    assert build_drafter(SpecConfig(enabled=True, drafter="ngram"), target=None).name == "ngram"
