"""The corpus of published log formats (tests/fixtures/logformats, sources in its SOURCES.md): each
file follows one real Megatron or MindFormers log variant, with values of its own, and must be read
exactly as expected.json says: steps, every listed series, NaN where a record printed no value."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from crossalign.logs import parse_log

CORPUS = Path(__file__).parent / "fixtures" / "logformats"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())


def test_the_corpus_covers_both_frameworks_and_every_file_names_its_source():
    logs = sorted(p.name for p in CORPUS.glob("*.log"))
    assert logs == sorted(EXPECTED), "every fixture has an expectation and every expectation a fixture"
    assert len(logs) >= 25 and sum(not EXPECTED[n]["format"].startswith("megatron") for n in logs) >= 8
    sources = (CORPUS / "SOURCES.md").read_text()
    assert [n for n in logs if f"`{n}`" not in sources] == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_is_read_exactly(name):
    want = EXPECTED[name]
    df = parse_log(CORPUS / name, core_version=want.get("core_version", "0.15.0"),
                   mtp_loss_scaling_factor=want.get("mtp_loss_scaling_factor"))
    assert df.attrs["format"] == want["format"]
    rows = want["rows"]
    assert df["step"].tolist() == rows["step"]
    for column, values in rows.items():
        if column == "step":
            continue
        assert column in df.columns, f"{name}: no column {column} in {list(df.columns)}"
        got = df[column].tolist()
        for step, g, w in zip(rows["step"], got, values):
            if w is None:
                assert math.isnan(g), f"{name} step {step} {column}: {g}, expected no value"
            else:
                assert g == pytest.approx(w, rel=want.get("tolerance", 1e-6)), f"{name} step {step} {column}"
    unreadable = [u["line"] for u in df.attrs["unreadable"]]
    assert unreadable == want.get("unreadable_lines", [])
    if unreadable:
        assert any(f"line {unreadable[0]}" in note for note in df.attrs["notes"])


def test_a_field_missing_from_the_first_record_is_read_in_later_ones():
    df = parse_log(CORPUS / "megatron_fp16_skipped_records.log", core_version="0.15.0")
    assert np.isnan(df["lm_loss"].iloc[0]) and df["lm_loss"].iloc[1] == pytest.approx(10.69911)
    assert "lm_loss" in df.attrs["logged"] and "grad_norm" in df.attrs["logged"]


def test_unknown_extra_losses_are_kept_and_the_aux_loss_is_chosen_by_name():
    zloss = parse_log(CORPUS / "megatron_mtp_zloss.log", core_version="0.15.0")
    assert zloss.attrs["extra_losses"] == ["z_loss"] and zloss["aux_loss"].isna().all()
    seq = parse_log(CORPUS / "megatron_bridge_seq_aux_mtp2.log", core_version="0.15.0")
    assert "aux_loss" in seq.attrs["logged"] and seq.attrs["extra_losses"] == []
    nsp = parse_log(CORPUS / "megatron_2019_no_colons.log", core_version="0.15.0")
    assert nsp.attrs["extra_losses"] == ["nsp_loss"]


def test_malformed_global_norm_is_named_not_guessed():
    df = parse_log(CORPUS / "mindformers_graph_malformed_norm.log")
    assert any("[1 20931]" in note for note in df.attrs["notes"])


def test_many_unreadable_step_lines_fail_naming_the_first(tmp_path):
    from crossalign.sides.log_common import LogFormatError

    lines = (CORPUS / "megatron_garbled_line.log").read_text().splitlines()
    garbled = [line[:150] + " NCCL INFO ring" if i else line for i, line in enumerate(lines)]
    path = tmp_path / "garbled.log"
    path.write_text("\n".join(garbled) + "\n")
    with pytest.raises(LogFormatError, match=r"garbled.log: 5 lines look like Megatron step records .* line 2 "):
        parse_log(path)


def test_a_step_mark_without_its_record_is_named(tmp_path):
    lines = (CORPUS / "megatron_moe_load_balancing.log").read_text().splitlines()
    lines.insert(2, lines[2][: lines[2].index("/") + 1] + "[default0]: NCCL WARN timeout")
    path = tmp_path / "cut.log"
    path.write_text("\n".join(lines) + "\n")
    df = parse_log(path, core_version="0.15.0")
    assert len(df) == 6 and [u["line"] for u in df.attrs["unreadable"]] == [3]
    assert "no 'M |'" in df.attrs["unreadable"][0]["why"]


def test_a_wrap_inside_the_aux_loss_name_invents_no_column_and_no_missing_loss():
    df = parse_log(CORPUS / "megatron_wrapped_in_word.log", core_version="0.15.0")
    assert df.attrs["extra_losses"] == [] and not df["aux_loss"].isna().any()
    assert df.attrs["notes"] == [] and df.attrs["unreadable"] == []


def test_a_print_glued_after_a_complete_record_leaves_the_record_whole():
    df = parse_log(CORPUS / "megatron_glued_print.log", core_version="0.15.0")
    assert list(df.columns) == ["step", "lm_loss", "aux_loss", "lr", "grad_norm", "step_time_ms"]
    assert [u["line"] for u in df.attrs["unreadable"]] == [4]  # the record cut before its end, not the glued ones
