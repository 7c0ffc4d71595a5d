"""bench.history on tiny random models: every way gives the autoregressive tokens, and the JSON says what it counted."""

from __future__ import annotations

import json

from bench import history


def test_every_way_gives_the_autoregressive_tokens_and_history_ways_report_coverage(char_model_dir, char_drafter_dir,
                                                                                   capsys):
    rc = history.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--prompts", "2", "--n", "2",
                       "--depth", "3", "--new-tokens", "12", "--min-match", "1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["identical"] is True and out["cpu"]
    assert set(out["ways"]) == {"autoregressive", "eagle", "ngram", "history k1", "history+ngram k1", "history+eagle k1"}
    for name, way in out["ways"].items():
        assert way["decode_steps"] >= 1 and way["accept_len"] >= 1
        assert ("history_coverage" in way) == name.startswith("history")
    # a random model's responses to the same prompt at step 1 share prefixes with step 2's: history drafts somewhere
    assert out["ways"]["history k1"]["history_coverage"] > 0


def test_a_missing_model_is_an_error_naming_it(tmp_path, capsys):
    rc = history.main(["--model", str(tmp_path / "nowhere"), "--json"])
    assert rc == 1 and "nowhere" in capsys.readouterr().err


def test_a_subset_of_ways_runs_alone_and_is_compared_with_eagle(char_model_dir, char_drafter_dir, capsys):
    rc = history.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--prompts", "2", "--n", "2",
                       "--depth", "3", "--new-tokens", "12", "--min-match", "1", "--temperature", "0.7",
                       "--ways", "eagle,history k1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["identical"] is True and out["temperature"] == 0.7
    assert set(out["ways"]) == {"autoregressive", "eagle", "history k1"}
    eagle, hist = out["ways"]["eagle"], out["ways"]["history k1"]
    assert eagle["vs_eagle"] == 1.0
    assert abs(hist["vs_eagle"] - hist["accept_len"] / eagle["accept_len"]) < 1e-3
    # history against EAGLE on the very tokens history's row-steps drafted (the same samples and positions)
    assert hist["eagle_on_history_tokens"] >= 1
    assert abs(hist["history_vs_eagle"] - hist["history_accept_len"] / hist["eagle_on_history_tokens"]) < 2e-3


def test_an_unknown_way_is_an_error_listing_the_ways(char_model_dir, char_drafter_dir, capsys):
    rc = history.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--ways", "eagle,bogus"])
    err = capsys.readouterr().err
    assert rc == 1 and "bogus" in err and "history+eagle k12" in err
