"""What every receipt model shares: the base classes, the constrained field types, and the parts
that several receipts carry (the tokens entry, the compute bound, the kernel path).

Every model allows keys beyond its fields (writers add more) and judges a value as its JSON Schema
does: strictly (a string is never a number, a number never a boolean), but 3.0 is an integer.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

# ---------------------------------------------------------------- base classes


class Part(BaseModel):
    """An object inside a receipt."""

    model_config = ConfigDict(extra="allow", strict=True)


class Receipt(Part):
    """A receipt: one JSON file with a "kind"; its schema file is generated from the model."""

    schema_file: ClassVar[str]  # file name under results_v100/schemas/
    schema_title: ClassVar[str]
    # top-level keywords pydantic cannot express (conditions across fields; $refs to $defs allowed here)
    schema_keywords: ClassVar[dict] = {}


# ---------------------------------------------------------------- field types
def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]  # JSON Schema's integer: 3.0 is one


def int_at_least(n: int) -> Any:
    # the constraint before the validator, or pydantic writes "ge" instead of "minimum" into the schema
    return Annotated[int, Field(ge=n), BeforeValidator(_integral)]


Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Timestamp = Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")]  # utc_now()
DateTimePrefix = Annotated[str, Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T")]
NonEmptyStr = Annotated[str, Field(min_length=1)]
PosInt = int_at_least(1)
NonNegInt = int_at_least(0)
NonNegFloat = Annotated[float, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
Obj = dict[str, Any]  # any JSON object
Label = Literal["contradiction", "entailment", "neutral"]


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema compares: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_json_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return a == b


def const(value: Any) -> Any:
    """A field that must equal `value` ({"const": value}); unlike Literal it takes lists, and 0.0 for 0."""
    def check(v: Any) -> Any:
        if not _json_equal(v, value):
            raise ValueError(f"must be {value!r}")
        return v
    return Annotated[Any, AfterValidator(check), WithJsonSchema({"const": value})]


def one_of(*values: Any) -> Any:
    """A field that must be one of `values` ({"enum": [...]})."""
    def check(v: Any) -> Any:
        if not any(_json_equal(v, x) for x in values):
            raise ValueError(f"must be one of {', '.join(map(repr, values))}")
        return v
    return Annotated[Any, AfterValidator(check), WithJsonSchema({"enum": list(values)})]


def unique(v: list) -> list:
    if len({repr(x) for x in v}) != len(v):
        raise ValueError("items must be unique")
    return v


def require_keys(*keys: str, when_object: bool = False) -> Any:
    """A JSON object holding at least `keys`; with when_object, any value, but an object must hold them."""
    def check(v: Any) -> Any:
        if isinstance(v, dict):
            missing = [k for k in keys if k not in v]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
        elif not when_object:
            raise ValueError("must be an object")
        return v
    schema = ({"if": {"type": "object"}, "then": {"required": list(keys)}} if when_object
              else {"type": "object", "required": list(keys)})
    return Annotated[Any, AfterValidator(check), WithJsonSchema(schema)]


def ref(model: type[BaseModel]) -> dict:
    """A $ref to `model`'s entry under $defs (for conditions written as JSON Schema)."""
    return {"$ref": f"#/$defs/{model.__name__}"}


# ---------------------------------------------------------------- shared parts
class TokensEntry(Part):
    """the token file and where its rows were cut (--truncate)"""

    path: Any
    sha256: Sha256
    truncate: PosInt
    truncated_rows: NonNegInt
    ids_sha256: Sha256


class ComputeBound(Part):
    """matmul FLOPs of one pass against the matmul peak measured in the same run
    (openjev/engine/flops.py compute_bound)"""

    peak_fp16_tflops: float | None = Field(description="null when the peak was measured in float32 (CPU)")
    model_flops_per_pass: NonNegFloat
    fraction_of_peak: NonNegFloat | None


class KernelPath(Part):
    """what the Transformers forward ran (openjev/engine/kernels.py kernel_path): gdn = fla | torch-fallback,
    attn_implementation, cudnn_enabled, selection reason"""

    gdn: str | None = None
    attn_implementation: str | None = None
