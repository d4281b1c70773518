"""QuantConfig: the scheme every method shares plus the chosen method's options, validated once, recorded in
the export.

A method declares its options as a frozen MethodOptions dataclass whose fields are made with option(): the
default, the help text and CLI flag (`quantkit quantize` builds its flags from these), the name the field had
in the flat quant_config of older exports, and the checks a value must pass. Options shared by several methods
are inherited (QQQ's options are GPTQ's plus its own), never declared twice; a method that only wants another
default re-declares the field with redefault() (awq-gptq's 5 AWQ ratios).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, TypeVar

import torch

from quantkit.qtensor import QuantizationError, check_group_size

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
AUTO_GROUP = "auto"  # the largest of 128/64/32 dividing every quantized input width, per channel if none does
LEGACY_METHOD = "gptq"  # the method of a stored quant_config that names none (exports before methods were named)
_RETIRED_KEYS = ("ignore",)  # what older exports wrote and nothing reads (an always-empty module list)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_SPEC = "quantkit.option"


@dataclass(frozen=True)
class OptionSpec:
    """How an option is offered and checked: field metadata of a MethodOptions field."""

    help: str
    flag: str | None = None  # click declaration, e.g. "--damp" or "--clip/--no-clip"; None: --field-name
    legacy: str | None = None  # the key of the flat quant_config older exports wrote
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # None values are always allowed (they mean "the method decides")

    def flag_for(self, name: str, is_bool: bool) -> str:
        if self.flag is not None:
            return self.flag
        dashed = "--" + name.replace("_", "-")
        return f"{dashed}/--no-{dashed[2:]}" if is_bool else dashed


def option(default: Any, help: str, **spec: Any) -> Any:
    """A MethodOptions field with its default; `spec` holds OptionSpec's other fields."""
    return field(default=default, metadata={_SPEC: OptionSpec(help=help, **spec)})


def option_spec(f: Field) -> OptionSpec:
    return f.metadata[_SPEC]


def redefault(owner: type, name: str, default: Any) -> Any:
    """A subclass's option that differs from `owner`'s only in its default: the same help, flag and checks."""
    spec = option_spec(next(f for f in fields(owner) if f.name == name))
    return field(default=default, metadata={_SPEC: spec})


@dataclass(frozen=True)
class MethodOptions:
    """The options of a method (none here); subclasses add option() fields and, if need be, check()."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_option_value(f, getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """Checks beyond the declared choices and minimums; raises QuantizationError."""

    @classmethod
    def accepted_keys(cls) -> set[str]:
        """Field names and the legacy names of the same fields."""
        return {key for f in fields(cls) for key in (f.name, option_spec(f).legacy) if key is not None}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MethodOptions:
        """The options among `values` (by field or legacy name); other keys are left to the caller."""
        found = {}
        for f in fields(cls):
            for key in (option_spec(f).legacy, f.name):  # the current name wins over the legacy one
                if key is not None and key in values:
                    found[f.name] = values[key]
        return cls(**found)

    def label(self) -> str:
        """What QuantConfig.label() adds for these options, e.g. ' act-order'."""
        return ""


def check_option_value(f: Field, value: Any) -> None:
    spec = option_spec(f)
    if value is None:
        return
    flag = f"({spec.flag_for(f.name, False).split('/')[0]})"  # the Python field, then the CLI flag
    if spec.choices is not None and value not in spec.choices:
        raise QuantizationError(f"{f.name} must be one of {spec.choices}, got {value!r} {flag}")
    if spec.minimum is not None and value < spec.minimum:
        raise QuantizationError(f"{f.name} must be at least {spec.minimum:g}, got {value} {flag}")


Options = TypeVar("Options", bound=MethodOptions)


@dataclass(frozen=True)
class QuantConfig:
    """Frozen: resolved once (for_model), then only read; a change is a new config (dataclasses.replace)."""

    method: str = "awq-gptq"  # the default method, of the CLI too
    bits: int = 4
    group_size: int | str = AUTO_GROUP  # -1: per output channel; AUTO_GROUP until for_model resolves it
    sym: bool = True
    act_bits: int = 16  # 8: per-token dynamic int8 activations (W4A8)
    # W8A8-FP8: float8 e4m3 weights with one scale per output channel and dynamic per-token float8 activations
    # (bits 8, act_bits 8, per channel; the fp8 method sets it)
    fp8: bool = False
    # lm_head quantized too, by the method's quantizer on the normed last hidden states (weight-only schemes and FP8;
    # AWQ's and RTN's: round to nearest): the largest single matrix of a model, a fifth of a 4-bit 8B model's bytes
    # while it stays 16-bit
    quantize_head: bool = False
    # MoE: every expert's statistics from every calibration token (the layer's output still follows the routing);
    # off: each expert's from the tokens routed to it, too few tokens handled by models/moe.py's LowTokenGuard
    moe_all_tokens: bool = False
    # the dtype the export serves in, "float16" or "bfloat16" (fp32 exports hold fp16-rounded scales): scales are
    # rounded to it before GPTQ compensates their error, so the export holds the scales it compensated for
    scale_dtype: str = "float16"
    # the method's options (its Method.options_class); None: its defaults
    options: MethodOptions = None  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        expected = _options_class(self.method)
        if self.options is None:
            object.__setattr__(self, "options", expected())
        elif not isinstance(self.options, expected):
            raise QuantizationError(f"method {self.method!r} takes {expected.__name__}, "
                                    f"got {type(self.options).__name__}")
        self._apply_method_scheme()

    def _apply_method_scheme(self) -> None:
        """The scheme fields the method fixes (METHOD_SCHEMES): a field left at its default takes the method's
        value; one set otherwise contradicts the method, refused in one line."""
        for name, required in METHOD_SCHEMES.get(self.method, {}).items():
            value = getattr(self, name)
            if value == required:
                continue
            if value != _SCHEME_DEFAULTS[name]:
                raise QuantizationError(f"{self.method} needs {name}={required!r}; {name}={value!r} "
                                        f"({SCHEME_FLAGS[name]}) contradicts it")
            object.__setattr__(self, name, required)

    def method_fixes(self) -> dict[str, Any]:
        """The scheme fields the method fixes, with their values: what the resolved scheme says it chose."""
        return dict(METHOD_SCHEMES.get(self.method, {}))

    def options_as(self, expected: type[Options]) -> Options:
        """The options, typed as the class the calling method's code reads (its own or one it extends)."""
        if not isinstance(self.options, expected):
            raise QuantizationError(f"method {self.method!r} has no {expected.__name__}")
        return self.options

    @property
    def resolved(self) -> bool:
        return self.group_size != AUTO_GROUP

    def for_model(self, model: torch.nn.Module, adapter: Any) -> QuantConfig:
        """This scheme for `model`: 'auto' becomes a group size, an explicit one is checked against every width
        that will be quantized, before any work (a later layer, an expert or an MLA projection can differ)."""
        return dataclasses.replace(self, group_size=resolve_group_size(model, adapter, self.group_size))

    def validate(self) -> QuantConfig:
        if self.bits not in (4, 8):
            raise QuantizationError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size not in (*SUPPORTED_GROUP_SIZES, AUTO_GROUP):
            raise QuantizationError(f"group size must be one of {SUPPORTED_GROUP_SIZES} (-1 = per channel) "
                                    f"or {AUTO_GROUP!r}, got {self.group_size!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise QuantizationError(f"scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {self.scale_dtype!r}")
        if self.act_bits not in (8, 16):
            raise QuantizationError(f"activation bits must be 8 or 16, got {self.act_bits}")
        if self.quantize_head and self.act_bits == 8 and not self.fp8:
            raise QuantizationError("--quantize-head takes weight-only schemes (W4A16, W8A16) and FP8; with int8 "
                                    "activations (W4A8) the head stays 16-bit")
        if self.fp8 and not METHOD_SCHEMES.get(self.method, {}).get("fp8"):
            raise QuantizationError(f"method {self.method!r} makes integer weights; FP8 weights come from --method fp8")
        if self.fp8:
            if (self.bits, self.act_bits, self.group_size, self.sym) != (8, 8, -1, True):
                raise QuantizationError("FP8 (W8A8-FP8) is 8-bit symmetric weights per output channel with 8-bit "
                                        f"activations, got {self.label()}")
            return self
        if self.act_bits == 8 and self.bits != 4:
            raise QuantizationError("W4A8 needs 4-bit weights (--bits 4)")
        if self.act_bits == 8 and not self.sym:
            raise QuantizationError("W4A8 needs symmetric weights (drop --asym)")
        return self

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    def label(self) -> str:
        """Short human-readable name of the scheme, e.g. 'gptq W4A16 g64 sym act-order'."""
        group = {-1: "per-channel", AUTO_GROUP: "group auto"}.get(self.group_size, f"g{self.group_size}")
        numbers = "-FP8" if self.fp8 else ""
        scheme = f"{self.method} W{self.bits}A{self.act_bits}{numbers} {group} {'sym' if self.sym else 'asym'}"
        return scheme + self.options.label() + (" +head" if self.quantize_head else "")

    def to_dict(self) -> dict:
        """The scheme's fields and "options": the method's options by field name."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> QuantConfig:
        """Reads to_dict()'s shape, and the flat quant_config of older exports (every method's options side by
        side, AWQ's as awq_*): options of other methods are ignored, keys no method knows are an error."""
        values = {k: v for k, v in values.items() if k not in _RETIRED_KEYS}
        scheme_keys = {f.name for f in fields(cls)} - {"options"}
        method = values.get("method", LEGACY_METHOD)
        options = values.get("options", values)
        unknown = set(values) - scheme_keys - {"options"} if "options" in values else set()
        unknown |= set(options) - scheme_keys - _all_option_keys()
        if unknown:
            raise QuantizationError(f"unknown quant_config keys: {', '.join(sorted(unknown))}")
        scheme = {k: v for k, v in values.items() if k in scheme_keys}
        return cls(**scheme, options=_options_class(method).from_dict(options))


def resolve_group_size(model: torch.nn.Module, adapter: Any, requested: int | str) -> int:
    """AUTO_GROUP: the largest of 128/64/32 dividing every quantized input width (576 -> 64 for SmolLM2), -1 if
    none does. An explicit size is checked against every width now, before any calibration work."""
    widths = adapter.quantized_input_widths(model)
    if requested != AUTO_GROUP:
        if requested != -1:
            for width in sorted(widths):
                check_group_size(width, int(requested))
        return int(requested)
    return next((group for group in (128, 64, 32) if all(w % group == 0 for w in widths)), -1)


# method name -> the scheme fields it fixes (QQQ: W4A8, symmetric), from Method.required_scheme by register
METHOD_SCHEMES: dict[str, dict[str, Any]] = {}
SCHEME_FLAGS = {"sym": "--asym", "act_bits": "--act-bits", "bits": "--bits", "group_size": "--group-size",
                "fp8": "--method fp8"}  # the flag that sets each field
_SCHEME_DEFAULTS = {f.name: f.default for f in fields(QuantConfig) if f.name in SCHEME_FLAGS}

# method name -> its options class, filled by quantkit.quantizers.base.register (the package's __init__ imports
# the built-in methods, so they are here whenever quantkit is imported)
METHOD_OPTIONS: dict[str, type[MethodOptions]] = {}


def _options_class(method: str) -> type[MethodOptions]:
    if method not in METHOD_OPTIONS:
        raise QuantizationError(f"unknown method {method!r}; available: {', '.join(sorted(METHOD_OPTIONS))}")
    return METHOD_OPTIONS[method]


def _all_option_keys() -> set[str]:
    return {key for cls in METHOD_OPTIONS.values() for key in cls.accepted_keys()}
