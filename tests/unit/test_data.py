"""Unit tests for peftckpt.train.data: tokenizer, loaders, samples, mock task and the resumable sampler."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from peftckpt.train.data import (
    MOCK_NUM_ACTIVE_TOKENS,
    ByteTokenizer,
    GlobalBatchSampler,
    TokenDataset,
    build_datasets,
    check_vocab_size,
    dp_slice,
    load_token_documents,
    mock_documents,
    mock_entropy_floor,
)

EOS = ByteTokenizer.eos_id


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _dataset(num_samples: int, seq_length: int = 4) -> TokenDataset:
    """Sample i is filled with the value i, so a batch's rows identify the samples drawn."""
    samples = np.repeat(np.arange(num_samples, dtype=np.int64)[:, None], seq_length + 1, axis=1)
    return TokenDataset(samples, "test")


def _rows(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].tolist()


# ---------------------------------------------------------------- tokenizer and loading


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld ✓\n\nline"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text
    assert tok.decode([0xFF]) == "\ufffd"
    assert (tok.eos_id, tok.vocab_size) == (256, 257)


def test_load_txt_is_one_document_with_eos(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.txt", "ab\n\ncd")
    assert load_token_documents(path) == [[97, 98, 10, 10, 99, 100, EOS]]


def test_load_jsonl_text_and_input_ids(tmp_path: Path) -> None:
    lines = [json.dumps({"text": "hi"}), "", json.dumps({"input_ids": [5, 300, 7]}), "  "]
    path = _write(tmp_path / "a.jsonl", "\n".join(lines) + "\n")
    assert load_token_documents(path) == [[104, 105, EOS], [5, 300, 7]]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"text": "ok"}\n{"text": "broken"\n', "a.jsonl:2: invalid JSON"),
        ('{"text": "ok"}\n\n{"ids": [1]}\n', 'a.jsonl:3: record has neither a "text" nor an "input_ids" key'),
        ('{"input_ids": [1, 2.5]}\n', 'a.jsonl:1: "input_ids" must be a list of integers'),
        ('{"input_ids": [1, true]}\n', 'a.jsonl:1: "input_ids" must be a list of integers'),
        ('{"input_ids": [1, -3]}\n', 'a.jsonl:1: "input_ids" contains a negative id (-3)'),
        ('{"text": 3}\n', 'a.jsonl:1: "text" must be a string'),
        ("[1, 2]\n", "a.jsonl:1: expected a JSON object"),
        ("\n\n", "a.jsonl: file contains no tokens"),
        ('{"input_ids": []}\n', "a.jsonl: file contains no tokens"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, fragment: str) -> None:
    path = _write(tmp_path / "a.jsonl", content)
    with pytest.raises(ValueError) as info:
        load_token_documents(path)
    assert fragment in str(info.value)
    assert str(path) in str(info.value)


def test_load_errors_unknown_extension_empty_and_missing(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"--data-path .*a\.csv: unknown extension '\.csv'; expected \.txt or \.jsonl"
    ):
        load_token_documents(_write(tmp_path / "a.csv", "x"))
    with pytest.raises(ValueError, match=r"--data-path .*empty\.txt: file contains no tokens"):
        load_token_documents(_write(tmp_path / "empty.txt", ""))
    with pytest.raises(ValueError, match=r"--data-path .*nope\.txt: no such file"):
        load_token_documents(tmp_path / "nope.txt")


def test_check_vocab_size_names_flags() -> None:
    check_vocab_size(256, 257, "--data-path x.txt")
    with pytest.raises(ValueError) as info:
        check_vocab_size(256, 256, "--data-path x.txt")
    message = str(info.value)
    assert "--data-path x.txt contains token id 256 but --vocab-size is 256" in message
    assert "pass --vocab-size 257 or more" in message


def test_build_datasets_refuses_ids_beyond_vocab(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", json.dumps({"input_ids": list(range(40)) + [999]}) + "\n")
    with pytest.raises(
        ValueError, match=r"--data-path .*a\.jsonl contains token id 999 but --vocab-size is 512"
    ):
        build_datasets(path, mock=False, seq_length=8, vocab_size=512, seed=0)


# ---------------------------------------------------------------- samples and split


def test_token_dataset_cuts_non_overlapping_samples() -> None:
    ds = TokenDataset.from_documents([[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10]], seq_length=3, source="t")
    assert len(ds) == 2 and ds.seq_length == 3
    assert ds[0].tolist() == [0, 1, 2, 3]
    assert ds[1].tolist() == [4, 5, 6, 7]  # documents are concatenated; the tail 8, 9, 10 is dropped
    assert ds[0].dtype == torch.long
    assert ds.gather([1, 0]).tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]


def test_too_few_tokens_names_flags(tmp_path: Path) -> None:
    path = _write(tmp_path / "short.txt", "abc")  # 3 bytes + EOS = 4 tokens
    with pytest.raises(ValueError) as info:
        build_datasets(path, mock=False, seq_length=4, vocab_size=257, seed=0)
    message = str(info.value)
    assert f"--data-path {path} has 4 tokens, fewer than one sample of --seq-length 4 + 1 = 5" in message
    train, eval_ds = build_datasets(path, mock=False, seq_length=3, vocab_size=257, seed=0, eval_fraction=0.0)
    assert len(train) == 1 and eval_ds is None


def test_split_holds_out_last_samples_disjoint() -> None:
    stream = np.arange(100 * 9, dtype=np.int64)  # every token unique, so overlap would be visible
    ds = TokenDataset.from_documents([stream], seq_length=8, source="t")
    train, eval_ds = ds.split(0.1)
    assert eval_ds is not None
    assert (len(train), len(eval_ds)) == (90, 10)
    assert eval_ds[0].tolist() == ds[90].tolist() and eval_ds[9].tolist() == ds[99].tolist()
    train_tokens = set(train.gather(range(len(train))).flatten().tolist())
    eval_tokens = set(eval_ds.gather(range(len(eval_ds))).flatten().tolist())
    assert not train_tokens & eval_tokens
    assert len(train_tokens | eval_tokens) == 900
    tiny_eval = ds.split(0.001)[1]
    assert tiny_eval is not None and len(tiny_eval) == 1  # a positive fraction holds out at least one
    with pytest.raises(ValueError, match="leaves none to train on"):
        _dataset(1).split(0.5)
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 1\)"):
        ds.split(1.0)


def test_build_datasets_requires_exactly_one_source(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of --data-path and --mock-data"):
        build_datasets(None, mock=False, seq_length=8, vocab_size=257, seed=0)
    with pytest.raises(ValueError, match="exactly one of --data-path and --mock-data"):
        build_datasets(_write(tmp_path / "a.txt", "x" * 100), mock=True, seq_length=8, vocab_size=257, seed=0)


# ---------------------------------------------------------------- mock task


def test_mock_is_deterministic_and_seed_dependent() -> None:
    torch.manual_seed(0)
    a = mock_documents(512, 5000, seed=3)
    torch.manual_seed(99)  # torch's global RNG must not matter
    assert mock_documents(512, 5000, seed=3) == a
    assert mock_documents(512, 5000, seed=4) != a
    assert len(a) == 1 and len(a[0]) == 5000
    assert 0 <= min(a[0]) and max(a[0]) < 512
    train, eval_ds = build_datasets(None, mock=True, seq_length=64, vocab_size=512, seed=3)
    assert eval_ds is not None
    assert len(train) + len(eval_ds) == 1024


def test_mock_conditional_entropy_is_far_below_uniform() -> None:
    vocab_size = 512
    tokens = np.asarray(mock_documents(vocab_size, 200_000, seed=0)[0])
    assert len(np.unique(tokens)) == MOCK_NUM_ACTIVE_TOKENS
    # Empirical H(next | current) from bigram counts.
    pairs = tokens[:-1] * vocab_size + tokens[1:]
    counts = (
        np.bincount(pairs, minlength=vocab_size * vocab_size).reshape(vocab_size, vocab_size).astype(float)
    )
    row_totals = counts.sum(axis=1, keepdims=True)
    nz = counts > 0
    cond = np.where(nz, counts / np.maximum(row_totals, 1), 1.0)
    entropy = float(-(counts[nz] * np.log(cond[nz])).sum() / counts.sum())
    floor = mock_entropy_floor(vocab_size)
    assert floor == pytest.approx(1.1266, abs=1e-3)
    # Plug-in estimates are biased low by only ~(#bigrams)/(2N) ≈ 0.01 nats at this size.
    assert entropy == pytest.approx(floor, abs=0.05)
    assert entropy < 0.3 * math.log(vocab_size)
    # Uniform noise over the same active tokens would sit at ln(64) = 4.16: a real margin.
    assert entropy < math.log(MOCK_NUM_ACTIVE_TOKENS) - 2.5


def test_mock_small_vocab() -> None:
    tokens = mock_documents(3, 1000, seed=1)[0]
    assert set(tokens) <= {0, 1, 2}
    with pytest.raises(ValueError, match="--vocab-size must be at least 2 for --mock-data"):
        mock_documents(1, 10, seed=0)


# ---------------------------------------------------------------- sampler


def test_sampler_epoch_is_seeded_permutation_and_wraps() -> None:
    ds = _dataset(10)
    sampler = GlobalBatchSampler(ds, global_batch_size=4, seed=7)
    rows = [r for _ in range(5) for r in _rows(sampler.next_global_batch())]  # 20 samples = 2 epochs
    assert sampler.consumed_samples == 20 and sampler.epoch == 2
    epoch0 = np.random.default_rng((7, 0)).permutation(10).tolist()
    epoch1 = np.random.default_rng((7, 1)).permutation(10).tolist()
    assert rows == epoch0 + epoch1  # batch 3 straddles the boundary: 2 from epoch 0, 2 from epoch 1
    assert sorted(rows[:10]) == list(range(10)) and epoch0 != epoch1
    other = GlobalBatchSampler(ds, global_batch_size=4, seed=8)
    assert _rows(other.next_global_batch()) != rows[:4]


def test_sampler_batch_larger_than_dataset() -> None:
    sampler = GlobalBatchSampler(_dataset(3), global_batch_size=8, seed=0)
    batch = sampler.next_global_batch()
    assert batch.shape == (8, 5)
    assert sorted(_rows(batch)[:3]) == [0, 1, 2] and sorted(_rows(batch)[3:6]) == [0, 1, 2]


@pytest.mark.parametrize("num_done", [0, 1, 3, 7])
def test_sampler_resume_matches_uninterrupted(num_done: int) -> None:
    ds = _dataset(13, seq_length=6)
    reference = GlobalBatchSampler(ds, global_batch_size=5, seed=11)
    expected = [reference.next_global_batch() for _ in range(num_done + 6)]

    first = GlobalBatchSampler(ds, global_batch_size=5, seed=11)
    for _ in range(num_done):
        first.next_global_batch()
    saved = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    assert saved == {
        "consumed_samples": 5 * num_done,
        "seed": 11,
        "epoch_len": 13,
        "seq_length": 6,
        "global_batch_size": 5,
    }
    resumed = GlobalBatchSampler(ds, global_batch_size=5, seed=11)
    resumed.load_state_dict(saved)
    for want in expected[num_done:]:
        assert torch.equal(resumed.next_global_batch(), want)


def test_sampler_resume_with_other_batch_size_continues_the_stream() -> None:
    ds = _dataset(9)
    reference = GlobalBatchSampler(ds, global_batch_size=1, seed=2)
    stream = [r for _ in range(20) for r in _rows(reference.next_global_batch())]
    first = GlobalBatchSampler(ds, global_batch_size=4, seed=2)
    first.next_global_batch()
    resumed = GlobalBatchSampler(ds, global_batch_size=6, seed=2)
    resumed.load_state_dict(first.state_dict())
    assert _rows(resumed.next_global_batch()) + _rows(resumed.next_global_batch()) == stream[4:16]


def test_sampler_state_mismatch_lists_every_problem() -> None:
    saved = GlobalBatchSampler(_dataset(10), global_batch_size=2, seed=1, consumed_samples=6).state_dict()
    sampler = GlobalBatchSampler(_dataset(12, seq_length=8), global_batch_size=2, seed=5)
    with pytest.raises(ValueError) as info:
        sampler.load_state_dict(saved)
    message = str(info.value)
    assert "epoch_len: checkpoint has 10, this run has 12 (check --data-path / --mock-data)" in message
    assert "seq_length: checkpoint has 4, this run has 8 (check --seq-length)" in message
    assert "seed: checkpoint has 1, this run has 5 (check --seed)" in message
    assert sampler.consumed_samples == 0  # nothing applied on failure
    with pytest.raises(ValueError, match="no valid 'consumed_samples'"):
        sampler.load_state_dict({"seed": 5})


def test_sampler_argument_errors() -> None:
    with pytest.raises(ValueError, match="--global-batch-size must be positive, got 0"):
        GlobalBatchSampler(_dataset(4), global_batch_size=0, seed=0)
    with pytest.raises(ValueError, match="consumed_samples must be non-negative"):
        GlobalBatchSampler(_dataset(4), global_batch_size=1, seed=0, consumed_samples=-1)


def test_dp_slices_concatenate_to_global_batch() -> None:
    ds = _dataset(50, seq_length=3)
    batch = GlobalBatchSampler(ds, global_batch_size=12, seed=0).next_global_batch()
    for dp_size in (1, 2, 3, 4, 6, 12):
        slices = [dp_slice(batch, rank, dp_size) for rank in range(dp_size)]
        assert all(s.shape == (12 // dp_size, 4) for s in slices)
        assert torch.equal(torch.cat(slices), batch)
    assert torch.equal(dp_slice(batch, 1, 3), batch[4:8])


def test_dp_slice_errors_name_flags() -> None:
    batch = torch.zeros(10, 5, dtype=torch.long)
    with pytest.raises(
        ValueError, match="--global-batch-size 10 is not divisible by the data-parallel size 4"
    ):
        dp_slice(batch, 0, 4)
    with pytest.raises(ValueError, match="data-parallel rank 2 is out of range for data-parallel size 2"):
        dp_slice(batch, 2, 2)
