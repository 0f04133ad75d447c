"""A `torch.export` archive (.pt2) checked as plain data before torch reads it.

`torch.export.load` trusts its file. It unpickles weights, constants and example inputs
marked `use_pickle` (or that fail `weights_only`) with `weights_only=False`, unpickles
custom and opaque objects, loads AOTInductor shared libraries, evaluates symbolic shapes
with `sympy.sympify` (an `eval`), compiles guard code, parameter names and node names
into Python source, and calls any callable under `torch`, `math` or `operator` that a
node names. Any of these runs code from the file. So an archive is accepted only when
none of them can happen: the exact layout `torch.export.save` writes, raw tensor
payloads, example inputs that load with `weights_only=True`, operators of the `aten` and
`higher_order` namespaces (or symbolic integer arithmetic), names that are dotted
identifiers, and shape expressions made of sympy arithmetic alone. Guard code (Python
that `torch.export.save` writes for relations between input shapes, such as a slide
encoder's features and coordinates sharing their first dimension) is never compiled: the
archive is loaded from a copy without it, and the program's range constraints, which are
data, still check every input's shape. The archive is read with torch's own reader, so
both see the same records.
"""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from slidesnake.errors import ModelError

_LAYOUT = re.compile(
    r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/model\.json|data/sample_inputs/model\.pt"
    r"|data/weights/model_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+"
    r"|extra/[\w.\-]+"
)
_PAYLOADS = {
    "data/weights/model_weights_config.json": re.compile(r"weight_\d+"),
    "data/constants/model_constants_config.json": re.compile(r"tensor_\d+"),
}
# Names that FX writes into the Python source of the loaded module.
_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*)?")
_NAME_KEYS = {"name", "as_name", "parameter_name", "buffer_name", "user_input_name", "fqn"}
_NAME_KEYS |= {"tensor_constant_name"}
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OP_NAMESPACES = {"aten", "higher_order"}
# The symbolic integer operations torch's deserializer knows (its `_SYM_OPS`), by name.
_SYM_OPS = {
    *(
        f"_operator.{name}"
        for name in "eq ne le ge lt gt neg pos mul add sub floordiv mod pow "  # noqa: SIM905
        "truediv and_ or_ lshift rshift getitem".split()
    ),
    "math.trunc",
    *(f"torch.sym_{name}" for name in ("not", "int", "float", "ite", "max", "min", "sqrt")),
}
# What a shape expression may call: sympy's arithmetic and torch's sympy functions,
# never `sympify`, `S` or `parse_expr`, which evaluate strings.
_SYMPY_FUNCTIONS = """
    Symbol Integer Float Rational Add Mul Pow Mod Max Min Abs floor ceiling Eq Ne Lt Le
    Gt Ge StrictLessThan StrictGreaterThan LessThan GreaterThan Equality Unequality And Or
    Not Piecewise ExprCondPair BooleanTrue BooleanFalse FloorDiv ModularIndexing Where
    PythonMod CleanDiv CeilToInt FloorToInt CeilDiv LShift RShift PowByNatural FloatPow
    FloatTrueDiv IntTrueDiv IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt
    RoundToInt RoundDecimal ToFloat Identity"""
_SYMPY_CALLS = set(_SYMPY_FUNCTIONS.split())
_SYMPY_VALUES = {"true", "false", "oo", "zoo", "nan", "pi", "E"}
_SYMPY_NODES = (
    *(ast.Expression, ast.Call, ast.Name, ast.Constant, ast.keyword, ast.BinOp, ast.UnaryOp),
    *(ast.Load, ast.operator, ast.unaryop, ast.Tuple),
)
_SPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"}
# torch.export.save writes the layout checked here from torch 2.8 on; an older torch
# writes another and cannot load this one.
ARCHIVE_TORCH = "2.8"


class UnsafeArchive(ModelError):
    """A .pt2 archive holds something that would run code when torch loads or runs it."""


def check_archive(path: str | Path) -> bool:
    """Refuse `path` unless loading and running it executes nothing from the file, once
    its guard code is dropped; True if it has guard code (load it `without_guards`)."""
    path = Path(path)
    if torch.__version__ < ARCHIVE_TORCH:
        raise ModelError(
            f"checkpoint {path}: a torch.export archive (.pt2) needs torch {ARCHIVE_TORCH} or "
            f"newer, and this environment has torch {torch.__version__}; upgrade torch, or "
            "give the weights as safetensors with the model's architecture"
        )
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = set(reader.get_all_records())
    except Exception as err:
        raise ModelError(
            f"checkpoint {path} is not a readable .pt2 program ({err}); "
            "export it again with torch.export.save"
        ) from None
    try:
        _check_layout(records)
        for config, payload in _PAYLOADS.items():
            _check_payloads(json.loads(reader.get_record(config)), payload)
        _check_example_inputs(reader.get_record("data/sample_inputs/model.pt"))
        program = json.loads(reader.get_record("models/model.json"))
        _check_program(program)
    except UnsafeArchive as err:
        raise UnsafeArchive(
            f"checkpoint {path} is refused: {err}, which would run code from the file when "
            "it is loaded; only plain torch.export.save archives of aten operators are "
            "accepted: export the model again, or use safetensors weights"
        ) from None
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise ModelError(
            f"checkpoint {path} is not a readable .pt2 program ({type(err).__name__}: {err}); "
            "export it again with torch.export.save"
        ) from None
    return bool(program.get("guards_code"))


@contextmanager
def without_guards(path: str | Path) -> Iterator[Path]:
    """A temporary copy of the archive whose program has no guard code, checked as torch
    will read it. The records come from torch's own reader, the one the check used, so
    the copy holds what was checked (a second zip reader could see other records in a
    crafted file); the copy is checked again before it is handed over."""
    reader = torch._C.PyTorchFileReader(str(path))
    with tempfile.TemporaryDirectory(prefix="slidesnake-pt2-") as folder:
        copy = Path(folder) / Path(path).name
        with zipfile.ZipFile(copy, "w", zipfile.ZIP_STORED) as target:
            for record in reader.get_all_records():
                data = reader.get_record(record)
                if record == "models/model.json":
                    program = json.loads(data)
                    program["guards_code"] = []
                    data = json.dumps(program).encode()
                target.writestr(f"archive/{record}", data)
        if check_archive(copy):
            raise UnsafeArchive(f"checkpoint {path} is refused: its guard code survived a copy")
        yield copy


def _check_layout(records: set[str]) -> None:
    for record in sorted(records):
        if not _LAYOUT.fullmatch(record):
            raise UnsafeArchive(f"it holds '{record}'")
    missing = {"models/model.json", "data/sample_inputs/model.pt", *_PAYLOADS} - records
    if missing:
        raise KeyError(f"no {sorted(missing)[0]}")


def _check_payloads(config: dict, file_name: re.Pattern) -> None:
    for fqn, payload in config["config"].items():
        if payload.get("use_pickle"):
            raise UnsafeArchive(f"it stores '{fqn}' as a pickle")
        if not file_name.fullmatch(payload["path_name"]):
            raise UnsafeArchive(f"it stores '{fqn}' as a '{payload['path_name']}' object")
        _check_name(fqn)


def _check_example_inputs(data: bytes) -> None:
    # torch retries example inputs with weights_only=False when this fails.
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError:
        raise UnsafeArchive("its example inputs are a pickle of more than tensors") from None


def _check_program(program: dict) -> None:
    for key, value in _items(program):
        if key == "target" or key == "as_operator":
            _check_operator(value)
        elif key == "expr_str":
            _check_expression(value)
        elif key in _NAME_KEYS:
            _check_name(value)
        elif key == "forward_arg_names":
            for name in value:
                _check_name(name)
        elif key in ("in_spec", "out_spec"):
            _check_spec(value)
        elif key == "as_custom_obj" or (key == "custom_obj_values" and value):
            raise UnsafeArchive("it holds a custom object")


def _items(node: object) -> Iterator[tuple[str, object]]:
    """Every (key, value) pair of a JSON tree; every key is also checked as a name."""
    if isinstance(node, dict):
        for key, value in node.items():
            _check_name(key)
            yield key, value
            yield from _items(value)
    elif isinstance(node, list):
        for value in node:
            yield from _items(value)


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UnsafeArchive(f"it names something {str(name)[:80]!r}")


def _check_operator(target: object) -> None:
    if target in _SYM_OPS:
        return
    parts = target.split(".") if isinstance(target, str) else []
    if (
        len(parts) in (4, 5)
        and parts[:2] == ["torch", "ops"]
        and parts[2] in _OP_NAMESPACES
        and all(part.isidentifier() and not part.startswith("__") for part in parts)
    ):
        op = getattr(getattr(torch.ops, parts[2]), parts[3], None)
        for part in parts[4:]:
            op = getattr(op, part, None)
        if isinstance(op, torch._ops.OpOverload | torch._ops.HigherOrderOperator):
            return
    raise UnsafeArchive(f"it calls {str(target)[:80]!r}")


def _check_expression(expression: object) -> None:
    try:
        tree = ast.parse(str(expression), mode="eval")
    except SyntaxError:
        raise UnsafeArchive(f"a shape expression {str(expression)[:80]!r} is not sympy") from None
    # A string is data only as a Symbol's name: Max, Min and others sympify (eval) strings.
    names = {
        id(call.args[0])
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "Symbol"
        and call.args
    }
    for node in ast.walk(tree):
        if not _is_sympy_arithmetic(node, names):
            raise UnsafeArchive(f"a shape expression {str(expression)[:80]!r} is more than sympy")


def _is_sympy_arithmetic(node: ast.AST, names: set[int]) -> bool:
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS
    if isinstance(node, ast.Name):
        return node.id in _SYMPY_CALLS | _SYMPY_VALUES or bool(_SYMBOL.fullmatch(node.id))
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            return id(node) in names and bool(_SYMBOL.fullmatch(node.value))
        return isinstance(node.value, int | float)
    return isinstance(node, _SYMPY_NODES)


def _check_spec(spec: object) -> None:
    try:
        tree = json.loads(spec)[1]
    except (TypeError, ValueError, IndexError, KeyError):
        raise UnsafeArchive("its input or output structure is not a plain tree") from None
    pending = [tree]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict) or node.get("type") not in _SPEC_TYPES:
            raise UnsafeArchive(f"its inputs or outputs are of type {str(node)[:80]!r}")
        pending.extend(node.get("children_spec", []))


# torch.export's serialised dtypes (its schema's ScalarType), for the dtypes of weights.
_DTYPES = {
    1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64,
    6: torch.float16, 7: torch.float32, 8: torch.float64, 12: torch.bool, 13: torch.bfloat16,
}  # fmt: skip


def archive_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The parameters and buffers of a (checked) archive as plain tensors, read from its
    records: the weights alone, for an architecture built here. `torch.export.load` would
    also rebuild the program, which costs seconds per job."""
    reader = torch._C.PyTorchFileReader(str(path))
    config = json.loads(reader.get_record("data/weights/model_weights_config.json"))["config"]
    storages: dict[str, torch.Tensor] = {}
    state = {}
    for fqn, payload in config.items():
        meta = payload["tensor_meta"]
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"weight '{fqn}' has a dtype slidesnake does not read")
        record = f"data/weights/{payload['path_name']}"
        if record not in storages:  # weights that alias share one record
            numel = reader.get_record_size(record) // torch._utils._element_size(dtype)
            flat = torch.empty(0, dtype=dtype)
            flat.set_(reader.get_storage_from_record(record, numel, dtype).untyped_storage())
            storages[record] = flat
        state[fqn] = torch.as_strided(
            storages[record],
            [size["as_int"] for size in meta["sizes"]],
            [stride["as_int"] for stride in meta["strides"]],
            meta["storage_offset"]["as_int"],
        )
    return state


def declared_width(path: str | Path, input_size: int) -> int | None:
    """The width of a program's features as its (checked) archive declares it, so that no
    tile need run through it at start-up: one input [batch, 3, input_size, input_size] and
    one output [batch, D], the batch symbolic and the same. None for anything else (then
    one tile through the program tells, and checks it runs)."""
    reader = torch._C.PyTorchFileReader(str(path))
    program = json.loads(reader.get_record("models/model.json"))["graph_module"]
    try:
        values, signature = program["graph"]["tensor_values"], program["signature"]
        (x,) = [values[_user_tensor(s, "user_input")]["sizes"]
                for s in signature["input_specs"] if "user_input" in s]  # fmt: skip
        (y,) = [values[_user_tensor(s, "user_output")]["sizes"]
                for s in signature["output_specs"] if "user_output" in s]  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None
    if len(x) != 4 or len(y) != 2 or "as_expr" not in x[0] or x[0] != y[0]:
        return None
    if [size.get("as_int") for size in x[1:]] != [3, input_size, input_size]:
        return None
    width = y[1].get("as_int")
    return width if isinstance(width, int) and width > 0 else None


def _user_tensor(spec: dict, kind: str) -> str:
    return spec[kind]["arg"]["as_tensor"]["name"]
