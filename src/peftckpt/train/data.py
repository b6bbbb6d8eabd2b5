"""Training data: byte tokenizer, document loading, fixed-length samples and a resumable batch order.

The trainer's checkpoints must resume *exactly*, data position included. Everything here is therefore a
pure function of its arguments: the mock task is drawn from a seeded ``numpy`` generator (never torch's
global RNG), the sample order of epoch ``e`` is the permutation drawn from ``numpy.random.default_rng((seed,
e))``, and the only mutable position is :attr:`GlobalBatchSampler.consumed_samples`, which
:meth:`GlobalBatchSampler.state_dict` saves as a plain int (Megatron's ``consumed_train_samples``).

Supported files (``--data-path``):

- ``.txt``: the whole file is one document, UTF-8 byte-tokenised, with EOS appended. Blank lines are
  content, not separators, so a file's text is reproduced byte for byte.
- ``.jsonl``: one document per non-blank line, either ``{"text": "..."}`` (byte-tokenised, EOS appended)
  or ``{"input_ids": [...]}`` (pre-tokenised, used as is, nothing appended).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..json_text import parse_json

__all__ = [
    "ByteTokenizer",
    "GlobalBatchSampler",
    "MOCK_NOISE_PROB",
    "MOCK_NUM_ACTIVE_TOKENS",
    "MOCK_SUCCESSOR_PROBS",
    "TokenDataset",
    "build_datasets",
    "check_vocab_size",
    "dp_slice",
    "load_token_documents",
    "mock_documents",
    "mock_entropy_floor",
]

#: Probabilities of the two fixed successors of every token in the mock Markov chain.
MOCK_SUCCESSOR_PROBS: tuple[float, float] = (0.75, 0.15)
#: Probability that the next mock token is drawn uniformly from the active tokens instead (keeps the
#: chain ergodic, so it never collapses into a short cycle).
MOCK_NOISE_PROB: float = 1.0 - sum(MOCK_SUCCESSOR_PROBS)
#: The mock task uses at most this many distinct token ids, so even a tiny model quickly learns which
#: ids occur at all (the first, easy part of the loss drop) before it learns the successor table.
MOCK_NUM_ACTIVE_TOKENS: int = 64

#: Key of the saved position in :meth:`GlobalBatchSampler.state_dict`.
_CONSUMED = "consumed_samples"


class ByteTokenizer:
    """Byte-level tokenizer needing no download: ids 0..255 are UTF-8 bytes, 256 is EOS."""

    eos_id: int = 256
    #: The smallest model vocabulary that can hold byte-tokenised text.
    vocab_size: int = 257

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids (no EOS appended)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids``; EOS and other ids above 255 are dropped, bad UTF-8 is replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _parse_jsonl_line(line: str, path: Path, line_no: int, tokenizer: ByteTokenizer) -> list[int]:
    """Tokenise one ``.jsonl`` record; raise ``ValueError`` naming ``path:line_no`` if it is malformed."""
    where = f"{path}:{line_no}"
    try:
        record = parse_json(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(
            f'{where}: expected a JSON object with a "text" or "input_ids" key, got {type(record).__name__}'
        )
    if "input_ids" in record:
        ids = record["input_ids"]
        # bool is a subclass of int in Python; true/false in a token list is a data bug, not an id.
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f'{where}: "input_ids" must be a list of integers')
        if any(i < 0 for i in ids):
            raise ValueError(f'{where}: "input_ids" contains a negative id ({min(ids)})')
        return list(ids)
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f'{where}: "text" must be a string, got {type(text).__name__}')
        return tokenizer.encode(text) + [tokenizer.eos_id]
    keys = ", ".join(sorted(record)) or "none"
    raise ValueError(f'{where}: record has neither a "text" nor an "input_ids" key (keys: {keys})')


def load_token_documents(path: Path) -> list[list[int]]:
    """Read ``path`` (``.txt`` or ``.jsonl``) into token-id documents.

    Raises:
        ValueError: a missing file, an unknown extension, an empty file (no tokens), or a malformed
            ``.jsonl`` line; the message names the file and, for ``.jsonl``, the line number.
    """
    path = Path(path)
    tokenizer = ByteTokenizer()
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise ValueError(f"--data-path {path}: unknown extension {path.suffix!r}; expected .txt or .jsonl")
    if not path.is_file():
        raise ValueError(f"--data-path {path}: no such file")
    text = path.read_text(encoding="utf-8", errors="replace")
    documents: list[list[int]] = []
    if suffix == ".txt":
        if text:
            documents.append(tokenizer.encode(text) + [tokenizer.eos_id])
    else:
        for line_no, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                documents.append(_parse_jsonl_line(line, path, line_no, tokenizer))
    if not any(documents):
        raise ValueError(f"--data-path {path}: file contains no tokens")
    return documents


def check_vocab_size(max_token_id: int, vocab_size: int, source: str) -> None:
    """Raise ``ValueError`` if a token id from ``source`` does not fit a model vocabulary of ``vocab_size``."""
    if max_token_id >= vocab_size:
        raise ValueError(
            f"{source} contains token id {max_token_id} but --vocab-size is {vocab_size}; "
            f"pass --vocab-size {max_token_id + 1} or more (byte-tokenised text needs at least "
            f"{ByteTokenizer.vocab_size}), or a --data-path tokenised for this vocabulary"
        )


def _mock_chain(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the mock chain's ``(active_ids, successors)``; ``successors[k]`` are indices into active_ids."""
    if vocab_size < 2:
        raise ValueError(f"--vocab-size must be at least 2 for --mock-data, got {vocab_size}")
    rng = np.random.default_rng((seed, 0x6D6F636B))  # a stream of its own, apart from the sampler's
    num_active = min(vocab_size, MOCK_NUM_ACTIVE_TOKENS)
    active_ids = rng.choice(vocab_size, size=num_active, replace=False)
    # Two distinct successors per token, neither the token itself (no trivial "repeat" rule): the two
    # smallest of a random row with the diagonal excluded.
    keys = rng.random((num_active, num_active))
    np.fill_diagonal(keys, np.inf)
    successors = np.argsort(keys, axis=1)[:, :2]
    return active_ids, successors


def mock_entropy_floor(vocab_size: int) -> float:
    """Return the mock task's conditional entropy per token in nats: the best achievable mean loss.

    With ``V = min(vocab_size, MOCK_NUM_ACTIVE_TOKENS)`` active tokens, successor probabilities
    ``(p1, p2) = MOCK_SUCCESSOR_PROBS`` and uniform noise ``q = MOCK_NOISE_PROB``, the next token is the
    first successor with probability ``p1 + q/V``, the second with ``p2 + q/V`` and any other active token
    with ``q/V``. For ``V = 64`` this is about 1.13 nats, against ``ln(vocab_size)`` (5.55 for 257) for
    a model that has learned nothing and ``ln(64)`` = 4.16 for one that knows only which ids occur.
    """
    num_active = min(vocab_size, MOCK_NUM_ACTIVE_TOKENS)
    noise = MOCK_NOISE_PROB / num_active
    probs = [p + noise for p in MOCK_SUCCESSOR_PROBS] + [noise] * (num_active - 2)
    return -sum(p * math.log(p) for p in probs)


def mock_documents(vocab_size: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Return one document of ``num_tokens`` ids drawn from a fixed, seeded low-entropy Markov chain.

    Each of ``min(vocab_size, MOCK_NUM_ACTIVE_TOKENS)`` active ids has two fixed successors taken with
    probabilities :data:`MOCK_SUCCESSOR_PROBS`; otherwise (:data:`MOCK_NOISE_PROB`) the next id is uniform
    over the active ids. The optimal loss is :func:`mock_entropy_floor`, far below ``ln(vocab_size)``.
    Deterministic in ``(vocab_size, num_tokens, seed)`` and independent of torch's RNG.
    """
    if num_tokens < 1:
        raise ValueError(f"mock_num_tokens must be positive, got {num_tokens}")
    active_ids, successors = _mock_chain(vocab_size, seed)
    num_active = len(active_ids)
    rng = np.random.default_rng((seed, 0x64617461))
    # Draw every random choice up front; only the cheap table walk is sequential.
    u = rng.random(num_tokens)
    choice = np.where(u < MOCK_SUCCESSOR_PROBS[0], 0, np.where(u < 1.0 - MOCK_NOISE_PROB, 1, -1)).tolist()
    noise = rng.integers(0, num_active, size=num_tokens).tolist()
    succ = successors.tolist()
    states = [0] * num_tokens
    state = int(noise[0])
    for t in range(num_tokens):
        states[t] = state
        c = choice[t]
        state = succ[state][c] if c >= 0 else noise[t]
    return [active_ids[np.asarray(states)].tolist()]


class TokenDataset:
    """Non-overlapping samples of ``seq_length + 1`` tokens (input ``s[:-1]``, target ``s[1:]``)."""

    def __init__(self, samples: np.ndarray, source: str) -> None:
        """Wrap ``samples``, an int64 array ``[num_samples, seq_length + 1]``; ``source`` names the data."""
        if samples.ndim != 2 or samples.shape[1] < 2:
            raise ValueError(f"{source}: samples must have shape [num_samples, seq_length + 1]")
        self._samples = np.ascontiguousarray(samples, dtype=np.int64)
        self.source = source

    @classmethod
    def from_documents(cls, documents: Sequence[Sequence[int]], seq_length: int, source: str) -> TokenDataset:
        """Concatenate ``documents`` into one stream and cut it into samples; a ragged tail is dropped.

        Raises:
            ValueError: ``seq_length`` is not positive, or the stream is shorter than one sample.
        """
        if seq_length < 1:
            raise ValueError(f"--seq-length must be positive, got {seq_length}")
        stream = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents] or [np.zeros(0, np.int64)])
        sample_len = seq_length + 1
        num_samples = len(stream) // sample_len
        if num_samples == 0:
            raise ValueError(
                f"{source} has {len(stream)} tokens, fewer than one sample of --seq-length {seq_length} "
                f"+ 1 = {sample_len}; use a smaller --seq-length or a larger --data-path"
            )
        return cls(stream[: num_samples * sample_len].reshape(num_samples, sample_len), source)

    @property
    def seq_length(self) -> int:
        """Input length of a sample (each sample holds one more token, the last target)."""
        return int(self._samples.shape[1]) - 1

    @property
    def max_token_id(self) -> int:
        """Largest token id in the dataset."""
        return int(self._samples.max())

    def __len__(self) -> int:
        return int(self._samples.shape[0])

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return sample ``index`` as a LongTensor ``[seq_length + 1]``."""
        return torch.from_numpy(self._samples[index].copy())

    def gather(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Return samples ``indices`` stacked into a LongTensor ``[len(indices), seq_length + 1]``."""
        return torch.from_numpy(self._samples[np.asarray(indices, dtype=np.int64)])

    def split(self, eval_fraction: float) -> tuple[TokenDataset, TokenDataset | None]:
        """Hold out the *last* ``round(len * eval_fraction)`` samples (at least one) as the eval set.

        Samples never share tokens, so eval never overlaps train. ``eval_fraction == 0`` returns
        ``(self, None)``.
        """
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if eval_fraction == 0.0:
            return self, None
        num_eval = max(1, round(len(self) * eval_fraction))
        if num_eval >= len(self):
            raise ValueError(
                f"{self.source} has only {len(self)} samples of --seq-length {self.seq_length}; "
                f"holding out {num_eval} for eval leaves none to train on. Use more data or a smaller "
                f"--seq-length"
            )
        cut = len(self) - num_eval
        return (
            TokenDataset(self._samples[:cut], self.source),
            TokenDataset(self._samples[cut:], f"{self.source} (eval split)"),
        )


class GlobalBatchSampler:
    """Deterministic global-batch order with a resumable position (Megatron ``consumed_samples`` semantics).

    Sample ``k`` of the infinite stream is ``perm_e[k % n]`` with ``e = k // n``, ``n = len(dataset)`` and
    ``perm_e`` the permutation drawn from ``numpy.random.default_rng((seed, e))``: every epoch is a fresh
    shuffle and a batch straddling an epoch boundary simply continues into the next one. The position is
    the single int ``consumed_samples``, so the global batch size may change on resume.
    """

    def __init__(
        self, dataset: TokenDataset, global_batch_size: int, seed: int, consumed_samples: int = 0
    ) -> None:
        """Order ``dataset`` by ``seed``, starting after ``consumed_samples`` samples."""
        if global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be positive, got {global_batch_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be non-negative, got {consumed_samples}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be drawn."""
        return self.consumed_samples // len(self.dataset)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # cache one epoch: batches only ever move forward
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(len(self.dataset))
            self._perm_epoch = epoch
        return self._perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Return dataset indices of stream positions ``start .. start + count - 1`` (no state change)."""
        n = len(self.dataset)
        out = np.empty(count, dtype=np.int64)
        pos = 0
        while pos < count:
            epoch, offset = divmod(start + pos, n)
            take = min(count - pos, n - offset)
            out[pos : pos + take] = self._permutation(epoch)[offset : offset + take]
            pos += take
        return out

    def next_global_batch(self) -> torch.Tensor:
        """Return the next LongTensor ``[global_batch_size, seq_length + 1]`` and advance the position."""
        batch = self.dataset.gather(self.indices(self.consumed_samples, self.global_batch_size))
        self.consumed_samples += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """Return the JSON-serialisable position: ``consumed_samples`` plus what it is only valid for."""
        return {
            _CONSUMED: self.consumed_samples,
            "seed": self.seed,
            "epoch_len": len(self.dataset),
            "seq_length": self.dataset.seq_length,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; ``global_batch_size`` may differ, the data and seed may not.

        Raises:
            ValueError: listing every mismatch (dataset length, sequence length, seed) at once.
        """
        if not isinstance(state_dict.get(_CONSUMED), int) or state_dict[_CONSUMED] < 0:
            raise ValueError(f"data sampler state has no valid {_CONSUMED!r}: {state_dict!r}")
        expected = {"epoch_len": len(self.dataset), "seq_length": self.dataset.seq_length, "seed": self.seed}
        fixes = {
            "epoch_len": "--data-path / --mock-data",
            "seq_length": "--seq-length",
            "seed": "--seed",
        }
        problems = [
            f"{key}: checkpoint has {state_dict[key]}, this run has {value} (check {fixes[key]})"
            for key, value in expected.items()
            if key in state_dict and state_dict[key] != value
        ]
        if problems:
            raise ValueError(
                "cannot resume the data order, the checkpoint was saved for different data: "
                + "; ".join(problems)
            )
        self.consumed_samples = int(state_dict[_CONSUMED])


def dp_slice(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Return data-parallel rank ``dp_rank``'s contiguous block of a global batch (dim 0).

    Rank ``r`` gets rows ``[r * b, (r + 1) * b)`` with ``b = global_batch_size // dp_size``, so the ranks'
    slices concatenated in rank order are the global batch.
    """
    global_batch_size = int(batch.shape[0])
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is out of range for data-parallel size {dp_size}")
    if global_batch_size % dp_size:
        raise ValueError(
            f"--global-batch-size {global_batch_size} is not divisible by the data-parallel size {dp_size} "
            f"(world size / (tensor * pipeline parallel size)); pick a multiple of {dp_size}"
        )
    per_rank = global_batch_size // dp_size
    return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def build_datasets(
    data_path: Path | None,
    mock: bool,
    seq_length: int,
    vocab_size: int,
    seed: int,
    eval_fraction: float = 0.05,
    mock_num_tokens: int | None = None,
) -> tuple[TokenDataset, TokenDataset | None]:
    """Build the (train, eval) datasets for ``--data-path`` or ``--mock-data``.

    Steps:
        1. Require exactly one of ``data_path`` and ``mock``.
        2. Load the documents: the file, or :func:`mock_documents` with ``mock_num_tokens`` tokens
           (default: 1024 samples' worth).
        3. Check every token id fits ``vocab_size``.
        4. Cut into samples and hold out the last ``eval_fraction`` for eval.
    """
    if mock == (data_path is not None):
        raise ValueError("pass exactly one of --data-path and --mock-data")
    if data_path is not None:
        documents = load_token_documents(data_path)
        source = f"--data-path {data_path}"
    else:
        num_tokens = mock_num_tokens if mock_num_tokens is not None else 1024 * (seq_length + 1)
        documents = mock_documents(vocab_size, num_tokens, seed)
        source = f"--mock-data ({num_tokens} tokens)"
    dataset = TokenDataset.from_documents(documents, seq_length, source)
    check_vocab_size(max((max(d) for d in documents if len(d)), default=0), vocab_size, source)
    return dataset.split(eval_fraction)
