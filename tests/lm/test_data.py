"""Datasets in every supported form, stable ids, prompt masking, batching."""

import json
import logging

import numpy as np
import pytest

from assay.core.config import DataConfig
from assay.core.errors import AssayError
from assay.lm.data import collate, load_examples, load_table, token_batches, tokenize
from tests.helpers import SAMPLE_TEXTS


def _write_formats(tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"text": SAMPLE_TEXTS})
    paths = {
        "jsonl": tmp_path / "d.jsonl",
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
    }
    table.to_json(paths["jsonl"])
    paths["json"].write_text(json.dumps([{"text": t} for t in SAMPLE_TEXTS]))
    table.to_parquet(paths["parquet"])
    table.to_csv(paths["csv"], index=False)
    paths["txt"] = tmp_path / "d.txt"
    paths["txt"].write_text("\n\n".join(t.replace("\n", " ") for t in SAMPLE_TEXTS))
    paths["folder"] = tmp_path / "saved"
    datasets.DatasetDict({"train": table, "eval": table.select([0, 1])}).save_to_disk(paths["folder"])
    return paths


def test_every_format_loads_the_same_rows(tmp_path):
    for kind, path in _write_formats(tmp_path).items():
        table = load_table(DataConfig(dataset=str(path)))
        assert len(table) == len(SAMPLE_TEXTS), kind
        assert table["__assay_id__"] == list(range(len(SAMPLE_TEXTS))), kind
    folder = tmp_path / "saved"
    assert len(load_table(DataConfig(dataset=str(folder), split="eval"))) == 2


def test_ids_stay_stable_through_filter_and_max_samples(texts_jsonl):
    cfg = DataConfig(dataset=str(texts_jsonl), filter_column="group", filter_value="g1", max_samples=2)
    table = load_table(cfg)
    assert list(table["__assay_id__"]) == [1, 3]


def test_missing_file_unknown_column_and_empty_dataset(tmp_path, texts_jsonl):
    with pytest.raises(AssayError, match="not found"):
        load_table(DataConfig(dataset=str(tmp_path / "missing.jsonl")))
    with pytest.raises(AssayError, match=r"no column 'body'; available: text, prompt, completion, group"):
        load_table(DataConfig(dataset=str(texts_jsonl), text_column="body"))
    with pytest.raises(AssayError, match="no row whose 'group' is 'nope'; its values: 'g0', 'g1'$"):
        load_table(DataConfig(dataset=str(texts_jsonl), filter_column="group", filter_value="nope"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(AssayError):
        load_table(DataConfig(dataset=str(tmp_path / "empty.jsonl")))
    with pytest.raises(AssayError, match="unsupported file type"):
        (tmp_path / "x.xml").write_text("<a/>")
        load_table(DataConfig(dataset=str(tmp_path / "x.xml")))


def test_config_validation():
    with pytest.raises(AssayError, match="--prompt_column"):
        DataConfig(completion_column="c")
    with pytest.raises(AssayError, match="--completion_column"):
        DataConfig(prompt_column="p")  # alone it would tokenize the text column but show prompts
    with pytest.raises(AssayError, match="--max_samples"):
        DataConfig(max_samples=0)


def test_prompt_completion_masks_the_prompt(texts_jsonl, tiny_tokenizer):
    cfg = DataConfig(dataset=str(texts_jsonl), prompt_column="prompt", completion_column="completion")
    table, ex = load_examples(cfg, tiny_tokenizer)
    for i, row in enumerate(table):
        prompt_len = len(tiny_tokenizer(row["prompt"])["input_ids"])
        assert ex.loss_start[i] == prompt_len
    batch = collate(ex, np.arange(len(ex)), tiny_tokenizer.pad_token_id)
    for i in range(len(ex)):
        labelled = (batch["labels"][i] != -100).nonzero().flatten()
        n = int(ex.lengths[i])
        assert labelled.tolist() == list(range(int(ex.loss_start[i]), n))


def test_text_mode_labels_every_token_but_the_first(texts_jsonl, tiny_tokenizer):
    _, ex = load_examples(DataConfig(dataset=str(texts_jsonl)), tiny_tokenizer)
    assert (ex.loss_start == 1).all()
    assert ex.tokens_of(0)[-1] == tiny_tokenizer.eos_token_id  # documents end with eos


def test_truncation_and_tokenize_cache(texts_jsonl, tiny_tokenizer):
    cfg = DataConfig(dataset=str(texts_jsonl), max_length=5)
    table = load_table(cfg)
    ex = tokenize(table, cfg, tiny_tokenizer)
    assert ex.lengths.max() == 5
    again = tokenize(table, cfg, tiny_tokenizer)  # from the cache
    np.testing.assert_array_equal(ex.tokens, again.tokens)
    np.testing.assert_array_equal(ex.ids, again.ids)
    full = tokenize(table, DataConfig(dataset=str(texts_jsonl), max_length=10**6), tiny_tokenizer)
    longer = full.lengths > 5
    assert ex.cut == again.cut == (int(longer.sum()), int((full.lengths[longer] - 5).sum())) and ex.cut[0] > 0
    assert full.cut == (0, 0)


def test_a_cut_dataset_is_said_so(texts_jsonl, tiny_tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="assay")
    load_examples(DataConfig(dataset=str(texts_jsonl), max_length=10**6), tiny_tokenizer)
    assert "--max_length" not in caplog.text
    _, ex = load_examples(DataConfig(dataset=str(texts_jsonl), max_length=5), tiny_tokenizer)
    assert f"{ex.cut[0]} of {len(ex)} examples are longer than --max_length 5" in caplog.text


def test_token_batches_respect_the_budget_and_cover_everything(texts_jsonl, tiny_tokenizer):
    _, ex = load_examples(DataConfig(dataset=str(texts_jsonl)), tiny_tokenizer)
    for budget in (64, 128, 10_000):
        batches = token_batches(ex, budget)
        assert sorted(np.concatenate(batches).tolist()) == list(range(len(ex)))
        for b in batches:
            padded = collate(ex, b, 0)["input_ids"]
            assert padded.numel() <= budget or len(b) == 1
    sub = ex.subset([2, 0])
    assert sub.ids.tolist() == [2, 0]
    np.testing.assert_array_equal(sub.tokens_of(0), ex.tokens_of(2))
    assert ex.positions_of([2, 0]).tolist() == [2, 0]


def test_seeded_sample_keeps_source_ids_in_order(texts_jsonl):
    first = load_table(DataConfig(dataset=str(texts_jsonl), max_samples=3))
    assert list(first["__assay_id__"]) == [0, 1, 2]
    drawn = load_table(DataConfig(dataset=str(texts_jsonl), max_samples=3, sample_seed=1))
    again = load_table(DataConfig(dataset=str(texts_jsonl), max_samples=3, sample_seed=1))
    ids = list(drawn["__assay_id__"])
    assert ids == list(again["__assay_id__"]) == sorted(ids) and len(set(ids)) == 3
    assert [SAMPLE_TEXTS[i] for i in ids] == list(drawn["text"])
    other = [
        list(load_table(DataConfig(dataset=str(texts_jsonl), max_samples=3, sample_seed=s))["__assay_id__"])
        for s in range(2, 8)
    ]
    assert any(o != [0, 1, 2] for o in other)


@pytest.mark.parametrize("corpus", ["abc-tunes", "shakespeare"])
def test_jsonl_reads_as_datasets_reads_it(corpus):
    """JSON-lines files are read without `datasets`, row for row as `datasets` reads them."""
    import datasets

    from assay.core.paths import cache_dir
    from assay.lm import corpora

    for split in ("train", "eval"):
        path = corpora.prepare(corpus, cache_dir()) / f"{split}.jsonl"
        ours = load_table(DataConfig(dataset=corpus, split=split))
        theirs = datasets.load_dataset("json", data_files=str(path), split="train")
        assert len(ours) == len(theirs) > 0
        for column in theirs.column_names:
            assert ours[column] == theirs[column], (split, column)


def test_jsonl_rows_missing_keys_blank_lines_and_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a\u2028b", "group": "x"}\n\n{"text": "c"}\r\n')
    table = load_table(DataConfig(dataset=str(path)))
    assert table["text"] == ["a\u2028b", "c"] and table["group"] == ["x", None]
    assert table[1] == {"text": "c", "group": None, "__assay_id__": 1}
    path.write_text('{"text": "a"}\n{"text": "b\n')
    with pytest.raises(AssayError, match="line 2 is not JSON"):
        load_table(DataConfig(dataset=str(path)))
    path.write_text('{"text": "a"}\n["b"]\n')
    with pytest.raises(AssayError, match="line 2 is not a JSON object"):
        load_table(DataConfig(dataset=str(path)))
    path.write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(AssayError, match="line 1 is not UTF-8"):
        load_table(DataConfig(dataset=str(path)))


def test_tokenize_cache_follows_the_rows(tmp_path, tiny_tokenizer):
    """The cache key is the rows' content: an edited file is tokenized again."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one two"}\n')
    _, first = load_examples(DataConfig(dataset=str(path)), tiny_tokenizer)
    path.write_text('{"text": "three four five six"}\n')
    _, second = load_examples(DataConfig(dataset=str(path)), tiny_tokenizer)
    assert first.lengths[0] != second.lengths[0]
