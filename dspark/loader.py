"""Generic safetensors checkpoint reading, the weight-loading loop and the sharded writer.

Nothing here knows a model. A checkpoint directory holds either one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. :class:`SafetensorsReader` opens them lazily
(headers only, tensors memory-mapped on demand); :func:`plan_sources` pairs each quantised
``*.weight`` with its ``*.scale`` and describes every model tensor as a :class:`TensorSource`
(decoded shape + how to read it); :func:`load_tensors` is the loop that checks every name and
shape first and only then copies. Model-specific knowledge (key renames, ignored keys, which
parameters may be absent) is passed in by the model's ``checkpoint.py``.

Quantised pairs are recognised by the stored dtype, never by the name alone: mHC parameters such
as ``hc_attn_scale`` or ``hc_head.hc_scale`` end in ``scale`` but are ordinary fp32 tensors.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.quant import block_grid, dequantize

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype names of quantised weights (header strings, read without loading data).
FP8_DISK_DTYPES = frozenset({"F8_E4M3"})
# Packed FP4 arrives as I8 in the official release and as U8 / F4 in some re-exports.
FP4_DISK_DTYPES = frozenset({"I8", "U8", "F4"})
# Problems per category printed in an error; a wrong-model load can otherwise list thousands.
_MAX_LISTED = 40


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in shard order.

    Uses ``model.safetensors.index.json`` when present (every shard it names must exist),
    else ``model.safetensors``. Raises ``FileNotFoundError`` when the directory has neither and
    ``ValueError`` naming the shard when the index points at a missing file.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        shards = sorted(set(weight_map.values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise ValueError(f"{INDEX_FILE} in {str(path)!r} names missing shard file(s): {', '.join(missing)}")
        return [path / name for name in shards]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"{str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


class SafetensorsReader:
    """Lazy, read-only view of all tensors of a checkpoint directory.

    Use as a context manager; headers are read on entry, tensor data only by :meth:`get`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = checkpoint_files(self.path)
        self._stack = contextlib.ExitStack()
        self._handle_of: dict[str, object] = {}

    def __enter__(self) -> SafetensorsReader:
        try:
            for file in self.files:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                for key in handle.keys():
                    if key in self._handle_of:
                        raise ValueError(f"tensor {key!r} is stored in more than one shard of {str(self.path)!r}")
                    self._handle_of[key] = handle
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()
        self._handle_of.clear()

    def keys(self) -> list[str]:
        return list(self._handle_of)

    def __contains__(self, key: str) -> bool:
        return key in self._handle_of

    def dtype(self, key: str) -> str:
        """safetensors dtype name (``"F8_E4M3"``, ``"BF16"``, ...), from the header."""
        return self._handle_of[key].get_slice(key).get_dtype()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle_of[key].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._handle_of[key].get_tensor(key)

    def get_part(self, key: str, axis: int, start: int, stop: int) -> torch.Tensor:
        """Entries [start, stop) of `key` along `axis`, reading only those bytes from the file."""
        index = (slice(None),) * axis + (slice(start, stop),)
        return self._handle_of[key].get_slice(key)[index]


@dataclass(frozen=True)
class TensorSource:
    """One model tensor as the checkpoint provides it.

    ``shape`` is the decoded shape (what the parameter must have), known before any data is read;
    ``read(device)`` loads the tensor onto ``device`` and decodes it there (FP8/FP4 are dequantised
    to float32 on the device the parameter lives on, so an accelerator does the arithmetic).
    """

    shape: tuple[int, ...]
    read: Callable[[torch.device], torch.Tensor]


def scale_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "scale"


def quant_codec(reader: SafetensorsReader, key: str) -> str | None:
    """``"fp8"`` / ``"fp4"`` for a quantised ``*.weight``, else None (stored as is)."""
    if not key.endswith(".weight"):
        return None
    dtype = reader.dtype(key)
    return "fp8" if dtype in FP8_DISK_DTYPES else "fp4" if dtype in FP4_DISK_DTYPES else None


def _quantised_source(
    reader: SafetensorsReader, key: str, codec: str, fp8_block: tuple[int, int], fp4_block: tuple[int, int]
) -> tuple[TensorSource | None, str | None]:
    """The dequantising source for a quantised weight (``fp8_block`` already resolved for ``key``),
    or a problem description."""
    scales = scale_key(key)
    if scales not in reader:
        return None, f"{key}: {reader.dtype(key)} weight without its block scale {scales}"
    stored = reader.shape(key)
    shape = stored if codec == "fp8" else (*stored[:-1], 2 * stored[-1])
    block = fp8_block if codec == "fp8" else fp4_block
    expected_grid = block_grid(shape, block)
    if reader.shape(scales) != expected_grid:
        return None, (
            f"{scales}: scale shape {reader.shape(scales)} does not fit weight {shape} "
            f"with block {tuple(block)}: expected {expected_grid}"
        )

    def read(device: torch.device) -> torch.Tensor:
        return dequantize(reader.get(key).to(device), reader.get(scales).to(device), fp8_block, fp4_block)

    return TensorSource(shape, read), None


def plan_sources(
    reader: SafetensorsReader,
    rename: Callable[[str], str | None],
    fp8_block: tuple[int, int] | Callable[[str], tuple[int, int]],
    fp4_block: tuple[int, int],
) -> tuple[dict[str, TensorSource], dict[str, str]]:
    """Describe every model tensor a checkpoint provides, reading headers only.

    Parameters
    ----------
    reader : open checkpoint.
    rename : on-disk key -> model name, or None for a deliberately ignored key.
    fp8_block : block of FP8 weights' scales, e.g. (128, 128) (config ``weight_block_size``), or a
        function on-disk key -> block for checkpoints that mix FP8 layouts (DeepSeek-V4.1: 32 x 32
        dense linears, 1 x 32 Engram table rows).
    fp4_block : block of packed-FP4 weights' scales, (1, 32) for DeepSeek experts.

    Returns
    -------
    sources : model name -> :class:`TensorSource`; a quantised weight's ``*.scale`` is consumed.
    problems : model name -> what is wrong with its stored form (missing scale, scale grid mismatch).
    """
    codecs = {key: quant_codec(reader, key) for key in reader.keys()}
    consumed_scales = {scale_key(key) for key, codec in codecs.items() if codec}
    sources: dict[str, TensorSource] = {}
    problems: dict[str, str] = {}
    for key, codec in codecs.items():
        name = rename(key)
        if key in consumed_scales or name is None:
            continue
        if codec is None:
            source, problem = TensorSource(reader.shape(key), lambda device, key=key: reader.get(key)), None
        else:
            block = fp8_block(key) if callable(fp8_block) else fp8_block
            source, problem = _quantised_source(reader, key, codec, block, fp4_block)
        if problem:
            problems[name] = problem
        elif name in sources:
            problems[name] = f"{name}: provided twice (last by on-disk key {key})"
        else:
            sources[name] = source
    return sources, problems


def sources_from_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSource]:
    """Wrap already-materialised tensors (e.g. a translated HF state dict) as sources."""
    return {name: TensorSource(tuple(t.shape), lambda device, t=t: t) for name, t in tensors.items()}


def _listed(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {item}" for item in shown) + more


def check_sources(
    model_tensors: Mapping[str, torch.Tensor],
    sources: Mapping[str, TensorSource],
    may_be_missing: Callable[[str], bool] = lambda name: False,
    problems: Mapping[str, str] = MappingProxyType({}),
) -> str | None:
    """Everything wrong with loading ``sources`` into ``model_tensors``, as one message or None.

    ``problems`` (model name -> description) are reported as they are, and their names are not
    reported again as missing.
    """
    accounted = sources.keys() | problems.keys()
    missing = [name for name in model_tensors if name not in accounted and not may_be_missing(name)]
    unexpected = [name for name in sources if name not in model_tensors]
    mismatched = [
        f"{name}: expected {tuple(model_tensors[name].shape)}, found {source.shape}"
        for name, source in sources.items()
        if name in model_tensors and tuple(model_tensors[name].shape) != source.shape
    ]
    sections = [
        _listed(title, items)
        for title, items in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches", mismatched),
            ("other problems", list(problems.values())),
        )
        if items
    ]
    return "\n".join(sections) if sections else None


def load_tensors(
    model_tensors: Mapping[str, torch.Tensor],
    sources: Mapping[str, TensorSource],
    may_be_missing: Callable[[str], bool] = lambda name: False,
    problems: Mapping[str, str] = MappingProxyType({}),
    where: str = "checkpoint",
) -> list[str]:
    """Check, then copy every source into the model tensor of the same name.

    Parameters
    ----------
    model_tensors : name -> parameter or buffer, e.g. ``model.state_dict(keep_vars=True)``.
        Each tensor keeps its own dtype and device: sources are cast to it (so fp32-kept
        parameters stay fp32 in a bf16 model) and moved to it.
    sources : name -> :class:`TensorSource`.
    may_be_missing : names allowed to be absent from ``sources`` (left as they are).
    problems : model name -> problem found while planning, reported together with the others.
    where : what is being loaded, for the error message.

    Returns
    -------
    The names left untouched because ``may_be_missing`` allowed them.

    Raises
    ------
    ValueError listing every missing key, unexpected key, shape mismatch and other problem at once,
    before any tensor data is read.
    """
    message = check_sources(model_tensors, sources, may_be_missing, problems)
    if message:
        raise ValueError(f"cannot load {where}:\n{message}")
    with torch.no_grad():
        for name, source in sources.items():
            target = model_tensors[name]
            target.copy_(source.read(target.device))
    return [name for name in model_tensors if name not in sources]


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def natural_key(name: str) -> list:
    """Sort `layers.2` before `layers.10`, so shards hold consecutive layers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _encoded_shards(
    state: Mapping[str, torch.Tensor],
    encode: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    max_shard_bytes: int,
) -> Iterable[dict[str, torch.Tensor]]:
    """Encode tensors one by one into shards of at most ``max_shard_bytes`` (one oversized
    tensor gets a shard of its own), so at most one shard is held in memory."""
    shard, size = {}, 0
    for name in sorted(state, key=natural_key):
        encoded = encode(name, state[name])
        nbytes = sum(t.numel() * t.element_size() for t in encoded.values())
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard.update(encoded)
        size += nbytes
    if shard:
        yield shard


def save_sharded(
    path: str | Path,
    state: Mapping[str, torch.Tensor],
    encode: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    config: dict,
    max_shard_bytes: int,
) -> None:
    """Write a sharded safetensors checkpoint: ``model-0000i-of-0000N.safetensors``,
    ``model.safetensors.index.json`` and ``config.json``.

    ``encode(name, tensor)`` returns the on-disk tensors of one model tensor (the weight, plus
    e.g. its block scale), on the CPU and contiguous. Model-specific formats live in the model's
    ``checkpoint.py``; this is only the file layout.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Shard names carry the total count, known only at the end: write under temporary names first.
    written: list[tuple[Path, list[str]]] = []
    total_size = 0
    for i, shard in enumerate(_encoded_shards(state, encode, max_shard_bytes)):
        temporary = path / f"shard-{i:05d}.safetensors.partial"
        save_file(shard, str(temporary), metadata={"format": "pt"})
        written.append((temporary, list(shard)))
        total_size += sum(t.numel() * t.element_size() for t in shard.values())
    weight_map = {}
    for i, (temporary, keys) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        temporary.rename(path / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
