"""Reading prompt data: verl's layout in parquet and JSON lines, other layouts by key, and errors
that name the file, the row and the column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlctl.workload.datafiles import Columns, DataError, read_records
from rlctl.workload.gsm8k_layout import make_rows, write_rows


def test_verl_gsm8k_layout_reads_from_parquet_and_jsonl(tmp_path: Path) -> None:
    rows = make_rows(12, seed=3)
    for name in ("train.parquet", "train.jsonl"):
        records = read_records([write_rows(rows, tmp_path / name)])
        assert len(records) == 12
        first = records[0]
        assert first.row == 0 and first.file.endswith(name)
        assert first.data_source == "openai/gsm8k"
        assert isinstance(first.prompt, list) and first.prompt[0]["role"] == "user" and "####" in first.prompt[0]["content"]
        assert first.ground_truth == rows[0]["reward_model"]["ground_truth"]
        assert first.extra_info["index"] == 0 and first.extra_info["split"] == "train"


def test_generated_rows_are_deterministic_and_correct() -> None:
    assert make_rows(5, 1) == make_rows(5, 1)
    assert make_rows(5, 1, "train") != make_rows(5, 1, "test")
    for row in make_rows(30, 2):
        question = row["extra_info"]["question"]
        a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
        assert int(row["reward_model"]["ground_truth"]) == int(a) + int(b)


def test_other_layouts_map_columns_by_key(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "meta": {"answer": 4}}) + "\n")
    columns = Columns(prompt="question", ground_truth="meta.answer", data_source="", extra_info="")
    [record] = read_records([path], columns)
    assert record.prompt == "2+2?" and record.ground_truth == 4 and record.data_source == "" and record.extra_info == {}


@pytest.mark.parametrize(("row", "column", "expected"), [
    ({"data_source": "x", "reward_model": {"ground_truth": "1"}}, "'prompt'", "no column"),
    ({"prompt": "hi", "data_source": "x"}, "reward_model.ground_truth", "no value"),
    ({"prompt": [{"role": "user"}], "data_source": "x", "reward_model": {"ground_truth": "1"}}, "'prompt'", "chat message"),
    ({"prompt": 7, "data_source": "x", "reward_model": {"ground_truth": "1"}}, "'prompt'", "a string or"),
    ({"prompt": "hi", "reward_model": {"ground_truth": "1"}}, "'data_source'", "expected a string"),
    ({"prompt": "hi", "data_source": "x", "reward_model": {"ground_truth": "1"}, "extra_info": [1]}, "'extra_info'",
     "expected a table"),
])
def test_a_bad_row_names_file_row_and_column(tmp_path: Path, row: dict, column: str, expected: str) -> None:
    good = {"prompt": "fine", "data_source": "x", "reward_model": {"ground_truth": "1"}}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as caught:
        read_records([path])
    message = str(caught.value)
    assert str(path) in message and "row 1" in message and column in message and expected in message


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        read_records([tmp_path / "missing.parquet"])
    with pytest.raises(DataError, match="expected a .parquet"):
        read_records([tmp_path / "data.csv"])
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable parquet"):
        read_records([broken])
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps({"prompt": "a", "data_source": "x", "reward_model": {"ground_truth": "1"}})
                        + "\n{oops\n")
    with pytest.raises(DataError, match="row 1: not valid JSON"):
        read_records([bad_json])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no rows"):
        read_records([empty])


def test_truncation_cuts_an_over_long_prompt_as_verl_does() -> None:
    from rlctl.workload.prompts import truncate_prompt

    tokens = list(range(10))
    assert truncate_prompt(tokens, 4, "left") == [6, 7, 8, 9]
    assert truncate_prompt(tokens, 4, "right") == [0, 1, 2, 3]
    assert truncate_prompt(tokens, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate_prompt(tokens, 20, "error") == tokens
    with pytest.raises(ValueError, match="truncation"):
        truncate_prompt(tokens, 4, "error")


def test_over_long_prompts_are_left_out_cut_or_refused_as_data_says(tmp_path: Path) -> None:
    from rlctl.workload.prompts import tokenize_records
    from tests.hf_models import tiny_model

    records = read_records([write_rows(make_rows(12, seed=3), tmp_path / "train.parquet")])
    model = tiny_model()
    lengths = [len(p.tokens) for p in tokenize_records(records, model, 1 << 30).prompts]
    limit = sorted(lengths)[6]
    longer = sum(1 for n in lengths if n > limit)
    kept = tokenize_records(records, model, limit)
    assert len(kept.prompts) == 12 - longer and kept.too_long == longer and kept.truncated == 0
    cut = tokenize_records(records, model, limit, filter_overlong=False, truncation="left")
    assert len(cut.prompts) == 12 and cut.truncated == longer and max(len(p.tokens) for p in cut.prompts) == limit
    with pytest.raises(DataError, match=r"longer than model.max_prompt_tokens .*data.truncation"):
        tokenize_records(records, model, limit, filter_overlong=False, truncation="error")
