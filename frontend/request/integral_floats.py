"""JSON does not tell 1 from 1.0, and OpenAI accepts `"n": 1.0`: a field the schema types as an integer takes an
integral float. msgspec's strict conversion refuses floats for int, and its lax mode would also take strings
("1") and more, so a body is walked along its Struct's type instead and only integral floats meant as integers are
made ints. Anything else (1.5, "1", a float meant as a float) reaches msgspec as it came, to be judged there.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import msgspec.inspect as mi

_SEQUENCES: tuple[type[mi.CollectionType], ...] = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)
_CONTAINERS: tuple[type[mi.Type], ...] = _SEQUENCES + (mi.StructType, mi.DictType)
_Info = TypeVar("_Info", bound=mi.Type)
_INT_RANGE = (-(2**63), 2**64)  # the integers msgspec decodes from JSON; an integral float outside stays a float


@functools.cache
def _type_info(request_type: type) -> mi.Type:
    return mi.type_info(request_type)


@functools.cache
def _fields(struct_cls: type) -> dict[str, mi.Type]:
    info = mi.type_info(struct_cls)
    assert isinstance(info, mi.StructType)  # only ever a StructType's cls
    return {field.encode_name: field.type for field in info.fields}


def integral_floats_as_ints(data: Any, request_type: type) -> Any:
    """`data` (parsed JSON or msgpack) with each integral float made an int where `request_type` wants an
    integer and no float; the input is not modified (changed containers are copies)."""
    return _walk(data, _type_info(request_type))


def _members(info: mi.Type) -> tuple[mi.Type, ...]:
    return info.types if isinstance(info, mi.UnionType) else (info,)


def _member(info: mi.Type, kinds: type[_Info] | tuple[type[_Info], ...]) -> _Info | None:
    return next((t for t in _members(info) if isinstance(t, kinds)), None)


def _wants_int(info: mi.Type) -> bool:
    members = _members(info)
    return any(isinstance(t, mi.IntType) for t in members) and not any(isinstance(t, mi.FloatType) for t in members)


def integral(value: float) -> bool:
    """An integral float within msgspec's integers (1e300 stays a float, refused as one where an int is wanted)."""
    return value.is_integer() and _INT_RANGE[0] <= value < _INT_RANGE[1]


def _walk(value: Any, info: mi.Type) -> Any:
    # Only the type's own structure is followed (an Any stops the walk): no deeper than the type, nor the data
    if isinstance(value, float):
        return int(value) if integral(value) and _wants_int(info) else value
    if isinstance(value, list):
        sequence = _member(info, _SEQUENCES)
        if sequence is None:
            return value
        item_type = sequence.item_type
        if _member(item_type, _CONTAINERS) is None:  # scalars, e.g. a million token ids: no call per item
            if float not in map(type, value):
                return value
            if _wants_int(item_type):
                return [int(v) if type(v) is float and integral(v) else v for v in value]
            return value
        return [_walk(item, item_type) for item in value]
    if isinstance(value, dict):
        struct = _member(info, mi.StructType)
        if struct is not None:
            fields = _fields(struct.cls)
            return {key: _walk(item, fields[key]) if key in fields else item for key, item in value.items()}
        mapping = _member(info, mi.DictType)
        if mapping is not None:
            return {key: _walk(item, mapping.value_type) for key, item in value.items()}
    return value
