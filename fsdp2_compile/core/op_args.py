"""Named views of an op's arguments: one frozen dataclass per op, its fields generated from the op's schema
(`op_schema(op).arguments`), so code reads `view.fqn` instead of indexing `node.args`. `op_view` makes the class;
each op module declares the views of its own ops, and `ir.py` gathers them with the collectives'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

from torch import fx

from fsdp2_compile._torch_private import OpOverload, op_schema

__all__ = ["OpArgs", "op_view", "schema_args"]


def _bind(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a call to `op` by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(op_schema(op).arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            raise TypeError(f"{op}: argument {arg.name!r} missing")
    return bound


def schema_args(node: fx.Node) -> dict[str, Any]:
    """Every argument of an op call node by its schema name, as passed (defaults not filled in); {} for nodes that
    do not call an OpOverload."""
    schema = op_schema(node.target) if node.op == "call_function" else None
    if schema is None:
        return {}
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
    return out


class OpArgs:
    """Base of the named argument views: one frozen dataclass per op, fields named and ordered as in its schema."""

    op: ClassVar[OpOverload]
    tensor_fields: ClassVar[tuple[str, ...]]
    """The fields whose schema type is a tensor (or a list of them)."""

    @classmethod
    def of(cls, node: fx.Node) -> Self:
        """The arguments of `node`, a call to `cls.op`."""
        if node.op != "call_function" or node.target is not cls.op:
            raise TypeError(f"{cls.__name__}.of: node {node.name} calls {node.target}, not {cls.op}")
        return cls.bind(node.args, node.kwargs)

    @classmethod
    def bind(cls, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> Self:
        """The view of a call's positional and keyword arguments (defaults filled in from the schema)."""
        return cls(**_bind(cls.op, args, kwargs or {}))

    def as_args(self) -> tuple:
        """The positional arguments of the call, in schema order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def static(self) -> tuple:
        """The non-tensor arguments, in schema order (for an fsdp2 op: everything that names its parameter)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.tensor_fields)

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


def op_view(name: str, op: OpOverload, doc: str, base: type = OpArgs) -> type:
    """The view class of `op`: a frozen dataclass with one field per schema argument (its default kept)."""
    fields: list[Any] = []
    tensors = []
    for arg in op_schema(op).arguments:
        if "Tensor" in str(arg.type):
            tensors.append(arg.name)
        if arg.has_default_value():
            fields.append((arg.name, Any, dataclasses.field(default=arg.default_value)))
        else:
            fields.append((arg.name, Any))
    namespace = {"op": op, "tensor_fields": tuple(tensors), "__doc__": f"{doc}\n\nSchema: `{op_schema(op)}`"}
    cls = dataclasses.make_dataclass(name, fields, bases=(base,), frozen=True, namespace=namespace)
    return cls
