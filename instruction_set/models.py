"""Model references: `NAME:PRESET[,key=value...]` for zoo models, `hf:<model_type>[,k=v]` for
any HuggingFace architecture from a small config (hetsynth.zoo.hf_auto),
`path/file.py:factory[,k=v]` for a user's own model.

A user factory is called with the overrides as keyword arguments and returns
`(module, example_inputs)`; the module's forward returns the loss. An override reaches the
factory as the type its parameter is annotated with or defaults to (int, float or bool:
`batch_size=16` is 16 for `def make(batch_size: int = 32)`, which a pipeline's micro-batch
capture relies on), else as the string written. Training data for a user
model are the rows of its example inputs when they hold real values (sample `i` is row
`i % batch`), and seeded random values of the same shape and dtype when they are on the meta
device. The inputs are those of the latest factory call made outside a meta device context
(a factory that writes `torch.randint(0, v, (b, s))` without `device=` would make meta inputs
under one): building the module on the meta device never replaces them.

Model families (a name, presets and the functions that build a module and its data) are a
registry, as op rules are: `register_family` adds one. The project's zoo (hetsynth.zoo) and any
other package reach it through the Python entry point group `hetsynth.models`, loaded on the
first lookup, so a rank resolves `gpt:tiny` without importing the face (arrows point down).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import inspect
import traceback
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from pydantic import ValidationError
from torch import nn

ENTRY_POINTS = "hetsynth.models"


class ModelRefError(ValueError):
    """A model reference that does not resolve; the message lists what would be valid."""


@dataclass(frozen=True)
class ModelFamily:
    """A family of models referenced as `NAME:PRESET[,key=value...]`: presets are keyword
    arguments of `config_cls`; `build(cfg)` makes the module, `example_inputs(cfg, device)` one
    batch, `make_batch(cfg, sample_ids, seed)` the training rows of those global samples."""

    name: str
    description: str
    config_cls: type
    presets: Mapping[str, Mapping[str, Any]]
    build: Callable[[Any], nn.Module]
    example_inputs: Callable[[Any, Any], tuple[torch.Tensor, ...]]
    make_batch: Callable[[Any, Sequence[int], int], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class ModelResolver:
    """References `name:<what>[,k=v...]` resolved by a function rather than presets (as
    hf:<model_type>): `resolve(ref, what, overrides)` returns the ModelSpec."""

    name: str
    usage: str  # how the reference is written, for error messages: "hf:<model_type>"
    resolve: Callable[[str, str, dict[str, str]], "ModelSpec"]


_FAMILIES: dict[str, ModelFamily] = {}
_RESOLVERS: dict[str, ModelResolver] = {}
_plugins_loaded = False


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a model family; a second family under the same name is a programming error."""
    assert _FAMILIES.get(family.name, family) is family, f"model family {family.name!r} registered twice"
    _FAMILIES[family.name] = family
    return family


def register_resolver(resolver: ModelResolver) -> ModelResolver:
    """Add a resolver; a second one under the same name is a programming error."""
    assert _RESOLVERS.get(resolver.name, resolver) is resolver, f"model resolver {resolver.name!r} registered twice"
    _RESOLVERS[resolver.name] = resolver
    return resolver


def families() -> dict[str, ModelFamily]:
    """Every registered family by name (the entry point group's packages loaded once)."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
            ep.load()
    return dict(_FAMILIES)


def seeded_generator(seed: int, sample_id: int) -> torch.Generator:
    """A generator for one sample: the same sample is the same on every rank and in every run."""
    return torch.Generator().manual_seed((seed * 1_000_003 + sample_id) % (2**63))


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model reference: how to build the module, its inputs and its data."""

    ref: str
    name: str
    config: Any
    _build: Callable[[], nn.Module] = field(repr=False)
    _inputs: Callable[[Any], tuple[torch.Tensor, ...]] = field(repr=False)
    _batch: Callable[[Sequence[int], int], tuple[torch.Tensor, ...]] = field(repr=False)
    dtype_override: str | None = None  # with_dtype: floating-point parameters and data in this dtype

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_override or getattr(self.config, "dtype", None) or "float32")

    @cached_property
    def batch_size(self) -> int:
        return int(self.example_inputs("meta")[0].shape[0])

    def build(self, device: str | torch.device = "cpu") -> nn.Module:
        """Build the module on `device` with its own initialisation, in the spec's dtype."""
        with torch.device(device):
            module = _sized(self.ref, self._build)
        return module.to(self.dtype)

    def example_inputs(self, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
        return self._cast(tuple(t.to(device) for t in _sized(self.ref, lambda: self._inputs(device))))

    def make_batch(self, sample_ids: Sequence[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
        """The training inputs of the given global sample indices (the same on every rank)."""
        return self._cast(self._batch(sample_ids, seed))

    def _cast(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.dtype_override is None:
            return tensors
        return tuple(t.to(self.dtype) if t.is_floating_point() else t for t in tensors)


def with_dtype(spec: ModelSpec, dtype: str) -> ModelSpec:
    """The same model with its floating-point parameters, buffers and data in `dtype` (built
    in its own dtype, then converted, so both dtypes start from the same initialisation)."""
    return dataclasses.replace(spec, dtype_override=dtype)


def _check_options(model: str, cfg_cls: type, overrides: dict[str, str]) -> None:
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    for key in overrides:
        if key not in fields:
            raise ModelRefError(
                f"model {model!r} has no option {key!r}; valid options: {', '.join(sorted(fields))}"
            )


def config_error(ref: str, err: ValidationError) -> ModelRefError:
    """One line per bad field: `ref: key=value: what is valid` (hetsynth.zoo.config)."""
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["loc"]:
            msg = f"{e['loc'][0]}={e['input']}: {msg[0].lower()}{msg[1:]}"
        lines.append(msg)
    return ModelRefError(f"{ref}: " + "; ".join(lines))


def _parse_overrides(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item:
            raise ModelRefError(f"override {item!r} must look like key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _zoo_spec(ref: str, entry: ModelFamily, preset: str, overrides: dict[str, str]) -> ModelSpec:
    if preset not in entry.presets:
        raise ModelRefError(
            f"model {entry.name!r} has no preset {preset!r}; presets: {', '.join(entry.presets)}"
        )
    _check_options(entry.name, entry.config_cls, overrides)
    try:
        cfg = entry.config_cls(**(dict(entry.presets[preset]) | overrides))
    except ValidationError as err:
        raise config_error(ref, err) from None
    return ModelSpec(
        ref=ref, name=entry.name, config=cfg,
        _build=lambda: entry.build(cfg),
        _inputs=lambda device: entry.example_inputs(cfg, device),
        _batch=lambda ids, seed: entry.make_batch(cfg, ids, seed),
    )


def _sized(ref: str, make: Callable[[], Any]) -> Any:
    """A model's module or inputs; sizes that pass its config's checks but whose tensors torch
    cannot hold (a size past int64, a product that overflows) are a ModelRefError (a user's
    factory's own errors are ModelRefErrors already: _user_call)."""
    try:
        return make()
    except (RuntimeError, TypeError, OverflowError, MemoryError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelRefError(f"{ref}: the model cannot be built at these sizes ({type(err).__name__}: {first}); "
                            f"choose smaller sizes") from None


def _raised(err: BaseException, path: Path) -> str:
    """`TypeError: message (file.py, line 12)`: an error and where in the user's file it arose."""
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} ({err.filename}, line {err.lineno})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def _user_call(what: str, path: Path, call: Callable[[], Any]) -> Any:
    """Run the user's code; anything it raises (SystemExit from `sys.exit(0)` included, but
    not Ctrl-C) becomes a ModelRefError naming it."""
    try:
        return call()
    except (ModelRefError, KeyboardInterrupt):
        raise
    except BaseException as err:  # the user's code may raise or exit with anything
        raise ModelRefError(f"{what} raised {_raised(err, path)}") from None


_SCALARS: dict[str, type] = {"int": int, "float": float, "bool": bool}
_TRUTH = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _factory_arguments(ref: str, factory: Callable[..., Any], raw: dict[str, str]) -> dict[str, Any]:
    """The overrides as the factory's parameters take them (module docstring): converted to
    int, float or bool where a parameter is annotated so or defaults to one; ModelRefError
    naming a value that does not convert, or a name the factory has no parameter for."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: pass the strings
        return dict(raw)
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out: dict[str, Any] = {}
    for key, value in raw.items():
        param = params.get(key)
        if param is None:
            if not open_kwargs:
                raise ModelRefError(f"{ref}: the factory has no parameter {key!r}; its parameters: "
                                    f"{', '.join(params) or 'none'}")
            out[key] = value
            continue
        kind = _scalar_kind(param)
        out[key] = value if kind is None else _converted(ref, key, value, kind)
    return out


def _scalar_kind(param: inspect.Parameter) -> type | None:
    annotation = param.annotation
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None)
    if name in _SCALARS:
        return _SCALARS[name]
    default = param.default
    return type(default) if type(default) in (int, float, bool) else None


def _converted(ref: str, key: str, value: str, kind: type) -> Any:
    if kind is bool:
        if value.lower() in _TRUTH:
            return _TRUTH[value.lower()]
    else:
        try:
            return kind(value)
        except ValueError:
            pass
    raise ModelRefError(f"{ref}: {key}={value!r} is not {'a' if kind is not int else 'an'} {kind.__name__} "
                        f"(the factory's parameter {key!r} is one)")


def _load_factory(path: Path, name: str) -> Callable[..., Any]:
    if not path.is_file():
        raise ModelRefError(f"model file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"hetsynth_user_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    _user_call(f"importing {path}", path, lambda: spec.loader.exec_module(module))
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n in vars(module) if callable(vars(module)[n]) and not n.startswith("_"))
        raise ModelRefError(f"{path} has no callable {name!r}; callables found: {found}")
    return factory


def check_example_inputs(inputs: Any, source: str) -> tuple[torch.Tensor, ...]:
    """The example inputs as a tuple of tensors, one per forward argument, all with the same
    batch size (dim 0) >= 1; raises ModelRefError naming what is wrong."""
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, (tuple, list)):
        hint = " (wrap a single tensor x as (x,))" if isinstance(inputs, torch.Tensor) else ""
        raise ModelRefError(f"{source}: example_inputs must be a tuple of tensors, one per forward "
                            f"argument; got {type(inputs).__name__}{hint}")
    if not inputs:
        raise ModelRefError(f"{source}: example_inputs is empty; give at least one tensor (dim 0 is the batch)")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ModelRefError(f"{source}: example_inputs[{i}] is a {type(t).__name__} ({str(t)[:40]!r}), "
                                f"not a tensor; every forward argument must be a tensor")
        if t.dim() == 0:
            raise ModelRefError(f"{source}: example_inputs[{i}] is a 0-d tensor; every input needs a "
                                f"batch dim 0")
    batches = [t.shape[0] for t in inputs]
    if len(set(batches)) > 1 or batches[0] < 1:
        raise ModelRefError(f"{source}: example inputs need one batch size >= 1 in dim 0; shapes: "
                            f"{[tuple(t.shape) for t in inputs]}")
    return tuple(inputs)


def _factory_result(ref: str, result: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module)):
        got = type(result).__name__ + (f" of {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise ModelRefError(f"{ref}: the factory must return (nn.Module, example_inputs); got {got}")
    return result[0], check_example_inputs(result[1], ref)


def _rows(inputs: tuple[torch.Tensor, ...], ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    """Rows of real example inputs, or seeded random rows for meta example inputs."""
    out = []
    for t in inputs:
        if t.device.type != "meta":
            out.append(t[[i % t.shape[0] for i in ids]])
            continue
        rows = []
        for i in ids:
            g = seeded_generator(seed, i)
            rows.append(torch.randn(t.shape[1:], generator=g, dtype=t.dtype) if t.is_floating_point()
                        else torch.randint(0, 2, t.shape[1:], generator=g, dtype=t.dtype))
        out.append(torch.stack(rows) if rows else t.new_zeros((0, *t.shape[1:]), device="cpu"))
    return tuple(out)


def _file_spec(ref: str, path: Path, factory_name: str, raw: dict[str, str]) -> ModelSpec:
    factory = _load_factory(path, factory_name)
    overrides = _factory_arguments(ref, factory, raw)
    call = f"{factory_name}({', '.join(f'{k}={v!r}' for k, v in overrides.items())})"
    cache: dict[str, tuple[torch.Tensor, ...]] = {}

    def run() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """One factory call: a fresh module (fresh initialisation) per build. Its inputs are
        the user's values unless a meta device context turned them into meta tensors."""
        made = _factory_result(ref, _user_call(f"{ref}: the factory {call}", path, lambda: factory(**overrides)))
        cache["meta" if torch.get_default_device().type == "meta" else "user"] = made[1]
        return made

    def inputs(device: Any = None) -> tuple[torch.Tensor, ...]:
        """The user's inputs; for a meta request, the inputs of a meta build serve as well."""
        if "user" not in cache and not (str(device) == "meta" and "meta" in cache):
            with torch.device("cpu"):
                run()
        return cache.get("user") or cache["meta"]

    return ModelSpec(ref=ref, name=path.stem, config=None, _build=lambda: run()[0], _inputs=inputs,
                     _batch=lambda ids, seed: _rows(inputs(), ids, seed))


def parse_model_ref(ref: str) -> ModelSpec:
    """Resolve `NAME:PRESET[,k=v...]`, `hf:<model_type>[,k=v...]` or `path/file.py:factory[,k=v...]`."""
    head, _, tail = ref.partition(",")
    name, sep, preset = head.rpartition(":")
    known = families()
    if not sep:
        name, preset = head, "tiny" if head in known else ""
    if name.endswith(".py"):
        return _file_spec(ref, Path(name), preset or "model", _parse_overrides(tail))
    if name in _RESOLVERS:
        return _RESOLVERS[name].resolve(ref, preset, _parse_overrides(tail))
    if name not in known:
        hint = "" if known else ("; no model families are installed: install hetsynth (pip install -e .) "
                                 f"so that its zoo registers through the {ENTRY_POINTS!r} entry points")
        usages = [*known, *(r.usage for r in _RESOLVERS.values())]
        raise ModelRefError(
            f"unknown model {name!r}; zoo models: {', '.join(usages)} (or path/to/file.py:factory){hint}"
        )
    return _zoo_spec(ref, known[name], preset, _parse_overrides(tail))


def with_overrides(spec: ModelSpec, **overrides: Any) -> ModelSpec:
    """The same reference with some overrides set or replaced (for example batch_size)."""
    head, _, tail = spec.ref.partition(",")
    merged = _parse_overrides(tail) | {k: str(v) for k, v in overrides.items()}
    return parse_model_ref(",".join([head] + [f"{k}={v}" for k, v in merged.items()]))
