"""The library names its own parameters; the trainer says the same messages in its flags."""

from __future__ import annotations

import warnings

import pytest

from peftckpt.checkpoint.api import Checkpointer, SaveOptions
from peftckpt.checkpoint.errors import CheckpointFormatError
from peftckpt.train.flag_words import (
    FLAG_WORDS,
    in_flag_terms,
    in_flag_terms_error,
    say_warnings_in_flag_terms,
)

from .small_model import small_checkpointer

LIBRARY_TO_TRAINER = [
    ("SaveOptions(trainable_only=True) needs ckpt_format 'torch_dist', but this save would use 'torch'",
     "--save-trainable-params-only needs --ckpt-format torch_dist, but this save would use 'torch'"),
    ("saved without optimizer state (SaveOptions(save_optim=False) or an import)",
     "saved without optimizer state (--no-save-optim or an import)"),
    ("ckpt_format 'torch' cannot hold a data-parallel-sharded optimizer (a distributed optimizer); use "
     "ckpt_format 'torch_dist'", "--ckpt-format torch cannot hold a data-parallel-sharded optimizer "
     "(--use-distributed-optimizer); use --ckpt-format torch_dist"),
    ("(LoadOptions(verify_checksums=False) skips the checksums)", "(--no-verify-checksums skips the checksums)"),
    ("the newest intact earlier checkpoint in runs/lora is iteration 4: resume from it explicitly with "
     "Checkpointer.load('runs/lora/iter_0000004') (a load never goes back to an earlier checkpoint by itself)",
     "the newest intact earlier checkpoint in runs/lora is iteration 4: resume from it explicitly with "
     "--load runs/lora/iter_0000004 (a load never goes back to an earlier checkpoint by itself)"),
    ("with Checkpointer.load(\"/o'brien/iter_0000002\") (a load", "with --load /o'brien/iter_0000002 (a load"),
    ("load the base it was trained on (load_pretrained), or pass LoadOptions(verify_base=False) to override",
     "load the matching --pretrained-checkpoint, or pass --no-verify-base to override"),
    ("pass LoadOptions(load_optim=False) to start a fresh optimizer", "pass --no-load-optim to start a fresh optimizer"),
    ("pass LoadOptions.strictness = log_unexpected (or ignore_all)", "pass --dist-ckpt-strictness log_unexpected (or "
     "ignore_all)"),
    ("only deleting older checkpoints (keep_last_k) failed", "only deleting older checkpoints (--keep-last-k) failed"),
    ("its value must come from the base (load_pretrained); LoadOptions.strictness = log_unexpected keeps that value",
     "its value must come from --pretrained-checkpoint; --dist-ckpt-strictness log_unexpected keeps that value"),
    ("load_pretrained: /b is an adapter-only checkpoint (saved with SaveOptions(trainable_only=True)); it holds no "
     "base weights. Load it with Checkpointer.load instead", "--pretrained-checkpoint /b is an adapter-only "
     "checkpoint (saved with --save-trainable-params-only); it holds no base weights. Pass it as --load instead"),
    ("  adapter_config['rank']: checkpoint 4, model 8\n  adapter_config['alpha']: checkpoint 8, model 16\n"
     "  adapter_config['target_modules']: a\n  adapter_config['layers']: b\n  adapter_config['train_params']: c\n"
     "make the adapter_config match the checkpoint's",
     "  rank (--lora-rank): checkpoint 4, model 8\n  alpha (--lora-alpha): checkpoint 8, model 16\n"
     "  target_modules (--lora-target-modules): a\n  layers (--lora-layers): b\n  train_params (--lora-train-params): c"
     "\nfix those flags to match the checkpoint, or leave the LoRA flags out to take the checkpoint's"),
    ("fix the model configuration to match the checkpoint", "fix the model flags to match the checkpoint"),
    ("held in nf4 (block_size 64); this model's base is held in full precision (not quantized): hold the base the "
     "way the checkpoint's was (model_config['base_quantization'])", "held in nf4 (block_size 64); this model's base "
     "is held in full precision (not quantized): pass the --base-quantization it was trained with"),
    ("the model (its configuration and adapters) must match the checkpoint's",
     "the model flags (architecture, --lora-rank, --lora-target-modules) must match the checkpoint's"),
    ("Wait for it to end, or save to another directory", "Wait for it to end, or pass another --save directory"),
    ("Wait for it to end, or save to another location", "Wait for it to end, or pass another --save location"),
]


@pytest.mark.parametrize("library, trainer", LIBRARY_TO_TRAINER)
def test_library_words_become_flags(library: str, trainer: str) -> None:
    assert in_flag_terms(library) == trainer
    assert "--" not in library  # the library itself never names a flag


def test_every_entry_of_the_table_is_used() -> None:
    used = {pattern for pattern, _ in FLAG_WORDS for library, _ in LIBRARY_TO_TRAINER
            if in_flag_terms(library) != library and __import__("re").search(pattern, library)}
    assert used == {pattern for pattern, _ in FLAG_WORDS}


def test_a_real_refusal_and_a_real_warning_in_flag_terms(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    ckpt, _ = small_checkpointer()
    with pytest.raises(CheckpointFormatError) as info:
        ckpt.save(tmp_path, 1, options=SaveOptions(trainable_only=True, ckpt_format="torch"))
    assert str(in_flag_terms_error(info.value)).startswith("--save-trainable-params-only needs --ckpt-format "
                                                           "torch_dist")
    frozen = small_checkpointer()[1]
    for p in frozen.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings(), say_warnings_in_flag_terms("peftckpt train"):
        warnings.simplefilter("always")
        Checkpointer(frozen).save(tmp_path / "frozen", 1, options=SaveOptions(trainable_only=True))
    err = capsys.readouterr().err
    assert err.startswith("peftckpt train: warning: --save-trainable-params-only: no model parameter is trainable")
    assert err.count("\n") == 1  # one line: no file name, no source line
