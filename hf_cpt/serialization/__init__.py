"""CPT checkpoints: the format (`format`), export, saving, loading with ``from_pretrained`` and the model card."""
