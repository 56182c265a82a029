"""Integrations with training frameworks: the transformers `Trainer` (`CPTCallback`, `CPTTrainer`)."""
