"""`CPTQuantizationConfig`: the ``quantization_config`` transformers reads from a CPT checkpoint's ``config.json``."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..config import CPTConfig
from ..numerics.errors import ErrorQuantization
from .format import QUANT_METHOD, CheckpointFields

logger = logging.getLogger(__name__)

_REQUIRED = ("bits", "quantized_modules")


class CPTQuantizationConfig(QuantizationConfigMixin):
    """``quantization_config`` of a CPT checkpoint (``quant_method: "cpt"`` in ``config.json``).

    Written by `hf_cpt.save_quantized` / `hf_cpt.export_portable`; not meant to be passed to
    ``from_pretrained`` by hand (a CPT checkpoint needs trained activation ranges, so there is no
    quantize-on-load). Its fields are those of `hf_cpt.serialization.format.CheckpointFields`, validated on
    construction; an error names the field. Unknown fields (from a newer writer) are ignored with a message.
    """

    def __init__(self, **values: Any) -> None:
        known = CheckpointFields.names()
        unknown = sorted(set(values) - known)
        if unknown:
            logger.info("hf_cpt: ignoring unknown quantization_config fields %s", unknown)
        missing = [name for name in _REQUIRED if name not in values]
        if missing:
            raise ValueError(f"quantization_config.{missing[0]} is missing: not a CPT checkpoint's config.")
        values.setdefault("quant_method", QUANT_METHOD)
        fields = CheckpointFields(**{key: value for key, value in values.items() if key in known})
        self.__dict__.update(dataclasses.asdict(fields))

    @classmethod
    def from_fields(cls, fields: CheckpointFields) -> CPTQuantizationConfig:
        return cls(**dataclasses.asdict(fields))

    @property
    def fields(self) -> CheckpointFields:
        """The typed fields (validated again: transformers may have set attributes since)."""
        return CheckpointFields(**{name: self.__dict__[name] for name in CheckpointFields.names()})

    def post_init(self) -> None:
        """Validate every field; the error names the field."""
        self.fields  # noqa: B018 - constructing the schema validates it

    @property
    def errors(self) -> ErrorQuantization:
        """How the loaded model quantizes errors if trained further (absent in older files: the paper's)."""
        return self.fields.errors

    def to_dict(self) -> dict[str, Any]:
        return self.fields.to_dict()

    @property
    def packed(self) -> bool:
        return self.checkpoint_format == "packed"

    def packed_modules(self) -> dict[str, int]:
        """Every module whose weight is stored as codes, with its bits."""
        modules = {name: self.bits for name in self.quantized_modules} if self.packed else {}
        modules.update(self.float_packed_modules)
        return modules

    @property
    def stores_rotations(self) -> bool:
        """Format 3 packed files hold each rotated layer's rotation tensors; older ones rebuild them from the seed."""
        return self.packed and self.format_version >= 3

    def guard_module(self) -> str | None:
        return self.guard_tensor.rsplit(".", 1)[0] if self.packed and self.guard_tensor else None

    def cpt_layer_names(self) -> list[str]:
        """The CPT layers to rebuild: the quantized modules and the CPT layers tied to one of them."""
        return self.quantized_modules + [n for n in self.shared_weights if n in self.layer_schemes]

    def layer_scheme(self, name: str) -> tuple[str, int | None]:
        """(activation granularity, rotation seed or None) of a quantized module."""
        granularity, seed = self.layer_schemes.get(name, ("tensor", None))
        return granularity, seed

    def run_config(self) -> CPTConfig | None:
        """The `CPTConfig` of the run that produced the checkpoint, when it was recorded."""
        if not self.cpt_config:
            return None
        try:
            return CPTConfig.from_dict(self.cpt_config)
        except (TypeError, ValueError) as error:
            logger.warning("hf_cpt: the recorded cpt_config is not usable here (%s).", error)
            return None
