"""``CalibrationRecipe``: every choice that shapes an artifact, validated once, before any slow work starts.

A frozen value (comparable, a cache key); errors name the CLI flag, where most recipes come from."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass

from ..errors import QuasarError
from ..scheme import ACTIVATION_MODES, ActivationMode, W8A8Scheme


def _alpha(alpha: str | float) -> str | float:
    """'auto', 'off' or a float in [0, 1]; the CLI hands numbers over as strings."""
    if alpha in ("auto", "off"):
        return alpha
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        raise QuasarError(f"--alpha must be 'auto', 'off' or a number in [0, 1], not {alpha!r}") from None
    if not 0.0 <= value <= 1.0:
        raise QuasarError(f"--alpha must be in [0, 1], not {value}")
    return value


def _check_count(flag: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise QuasarError(f"{flag} must be an integer >= {minimum}, not {value!r}")


@dataclass(frozen=True)
class CalibrationRecipe:
    """How to turn a float checkpoint into a W8A8 artifact: ``alpha`` "auto" (searched per smoothing group), "off" or in
    [0, 1]; ``keep_float``: globs of linears left float; ``keep_float_above``: also any whose relative error stays above
    this; ``calib_data``: a JSONL or text file (None: built-in); ``int8_lm_head``: quantize the lm_head too."""

    alpha: str | float = "auto"
    activation: ActivationMode = "dynamic"
    num_samples: int = 64
    seq_len: int = 512
    keep_float: tuple[str, ...] = ()
    keep_float_above: float | None = None
    calib_data: str | None = None
    int8_lm_head: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", _alpha(self.alpha))
        if self.activation not in ACTIVATION_MODES:
            raise QuasarError(f"--activation must be 'dynamic' or 'static', not {self.activation!r}")
        _check_count("--num-samples", self.num_samples, 1)
        _check_count("--seq-len", self.seq_len, 2)
        if isinstance(self.keep_float, str) or not all(isinstance(p, str) for p in self.keep_float):
            raise QuasarError(f"--keep-float must be a sequence of glob patterns, not {self.keep_float!r}")
        object.__setattr__(self, "keep_float", tuple(self.keep_float))
        above = self.keep_float_above
        if above is not None and (isinstance(above, bool) or not isinstance(above, numbers.Real)):
            raise QuasarError(f"--keep-float-above must be a number, not {above!r}")
        if not isinstance(self.int8_lm_head, bool):
            raise QuasarError(f"--int8-lm-head is a switch (True or False), not {self.int8_lm_head!r}")
        if self.calib_data is not None:
            object.__setattr__(self, "calib_data", str(self.calib_data))

    @property
    def scheme(self) -> W8A8Scheme:
        return W8A8Scheme(activation=self.activation)

    def to_dict(self) -> dict:
        """JSON-ready fields, for cache keys and logs (the manifest's recipe block is written by ``manifest.py``)."""
        return {**asdict(self), "keep_float": list(self.keep_float)}
