"""The reference trainer: flags, data, loop and its checkpoint integration."""

from .args import ArgumentError, build_parser, parse_train_args
from .trainer import Trainer

__all__ = ["ArgumentError", "build_parser", "parse_train_args", "Trainer"]
