"""Building models: ``load_model`` (from a checkpoint directory) and ``init_model`` (random weights).

Both read the HF-style ``config.json`` (``model_type`` picks the model family) and return a model in
eval mode with a ``tokenizer`` attribute (None when the directory has none). Supporting another
family (``deepseek_v41``) means adding one :class:`ModelFamily` entry to :data:`MODEL_FAMILIES`.
Any other transformers causal LM (a model object, or a directory whose ``model_type`` transformers
knows) is wrapped by ``dspark.models.hf_causal``.
"""

from __future__ import annotations

import json
from importlib import resources
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from dspark import configs
from dspark.draft.io import dspark_from_checkpoint, dspark_from_v41_checkpoint, load_drafter
from dspark.models.deepseek_v4 import checkpoint as deepseek_v4_checkpoint
from dspark.models.deepseek_v4.config import DeepseekV4Config
from dspark.models.deepseek_v4.model import DeepseekV4ForCausalLM
from dspark.models.deepseek_v41 import checkpoint as deepseek_v41_checkpoint
from dspark.models.deepseek_v41.config import DeepseekV41Config
from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM

CONFIG_FILE = "config.json"
DRAFTER_DIR = "drafter"
# The architecture-complete tiny V4 of `dspark/configs/tiny-v4.json` with random weights and a byte
# tokenizer: noise, but it runs everything without a checkpoint.
RANDOM_TINY = "random-tiny"
# Models shipped inside the package, by name: `load_model("tiny")`.
EMBEDDED: Mapping[str, Path] = MappingProxyType(
    {"tiny": Path(str(resources.files("dspark") / "assets" / "dspark-tiny"))})


@dataclass(frozen=True)
class ModelFamily:
    """How to build one ``model_type`` from its config dict and fill it from a checkpoint.

    ``options`` names the keyword options ``build`` accepts (model-level settings fixed at
    construction, e.g. DeepSeek-V4.1's ``prefill_mode``), passed through ``load_model`` /
    ``init_model``.
    """

    build: Callable[..., torch.nn.Module]
    load_weights: Callable[[torch.nn.Module, Path, dict], None]
    options: frozenset[str] = frozenset()


def _build_deepseek_v4(config: dict, device: torch.device, dtype: torch.dtype, **options) -> torch.nn.Module:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(config), dtype=dtype, device=device, **options)
    # Loading a checkpoint without `mtp.*` weights turns this off (checkpoint.load_checkpoint).
    model.has_mtp = len(model.mtp) > 0
    return model


def _load_deepseek_v4(model: torch.nn.Module, path: Path, config: dict) -> None:
    deepseek_v4_checkpoint.load_checkpoint(model, path, config)
    # A DSpark checkpoint carries its drafter too (stages under `mtp.*`); None otherwise.
    model.dspark = dspark_from_checkpoint(model, path, config)


def _build_deepseek_v41(config: dict, device: torch.device, dtype: torch.dtype, **options) -> torch.nn.Module:
    # A checkpoint trained without the FP8 cache rounding (dspark-tiny) says so in its config.json;
    # running it with the rounding on would change its numerics. An explicit option still wins.
    if "cache_qat" in config:
        options.setdefault("cache_qat", bool(config["cache_qat"]))
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(config), dtype=dtype, device=device, **options)
    model.dspark = None  # set by loading a checkpoint that ships its DSpark stages (`mtp.*`)
    return model


def _load_deepseek_v41(model: torch.nn.Module, path: Path, config: dict) -> None:
    deepseek_v41_checkpoint.load_checkpoint(model, path, config)
    # The released stages `mtp.0..2` (V4.1 blocks) become the model's DSpark drafter; None otherwise.
    model.dspark = dspark_from_v41_checkpoint(model, path, config)


MODEL_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        "deepseek_v4": ModelFamily(_build_deepseek_v4, _load_deepseek_v4, frozenset({"kernels"})),
        "deepseek_v41": ModelFamily(_build_deepseek_v41, _load_deepseek_v41,
                                    frozenset({"prefill_mode", "engram_tables", "cache_qat", "kernels"})),
    }
)


def _family(config: dict, origin: str) -> ModelFamily:
    model_type = config.get("model_type")
    if model_type not in MODEL_FAMILIES:
        raise ValueError(
            f"{origin}: unknown model_type {model_type!r}; supported: {', '.join(sorted(MODEL_FAMILIES))}"
        )
    return MODEL_FAMILIES[model_type]


def _build(family: ModelFamily, config: dict, device, dtype, options: dict) -> torch.nn.Module:
    unknown = sorted(set(options) - family.options)
    if unknown:
        accepted = ", ".join(sorted(family.options)) or "none"
        raise ValueError(f"model_type {config.get('model_type')!r}: unknown option(s) {unknown}; accepted: {accepted}")
    return family.build(config, *_placement(device, dtype), **options)


def _read_config(path: Path) -> dict:
    """``config.json`` from a checkpoint directory or the file itself."""
    file = path / CONFIG_FILE if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} has no {CONFIG_FILE}")
    if not file.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    return json.loads(file.read_text())


def _placement(device: str | torch.device | None, dtype: torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """Default device CPU; default dtype: float32 on CPU (exact references, tests), bfloat16 on accelerators."""
    device = check_device(device or "cpu")
    return device, _dtype(dtype) or (torch.float32 if device.type == "cpu" else torch.bfloat16)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch floating dtype, also by name ("bfloat16", "torch.float16"), as transformers takes it;
    None stays None; anything else is a ValueError naming it."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise ValueError(f"dtype must be a torch floating dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    return named


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, or a ValueError naming it: not a device string, or a CUDA device
    this machine does not have (torch's own errors there are an assertion and an opaque RuntimeError)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: CUDA is not available on this machine "
                             f"(torch {torch.__version__}); use --device cpu / device='cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _load_tokenizer(path: Path):
    """The directory's tokenizer: transformers' fast tokenizer when ``tokenizer_config.json``
    describes it (special tokens, chat template), the bare ``tokenizers`` one otherwise."""
    if not (path / "tokenizer.json").is_file():
        return None
    if (path / "tokenizer_config.json").is_file():
        from transformers import PreTrainedTokenizerFast  # slow import, only when needed

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def build_model(config: Mapping, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                **options) -> torch.nn.Module:
    """The model of a ``config.json`` dict with *uninitialised* weights, for loaders that fill every
    tensor themselves (``dspark.distributed.load_sharded``); options as in :func:`load_model`."""
    config = dict(config)
    return _build(_family(config, "config"), config, device, dtype, options)


def load_tokenizer(path: str | Path):
    """The tokenizer of checkpoint directory ``path`` (as ``load_model`` attaches it), or None."""
    return _load_tokenizer(Path(path))


def load_model(
    path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    **options,
) -> torch.nn.Module:
    """Load a model from a checkpoint directory, or wrap a transformers causal LM.

    Parameters
    ----------
    path : the name of an embedded model (``"tiny"``: dspark-tiny, a trained V4.1-architecture
        model with its DSpark drafter; ``"random-tiny"``: the tiny V4 with random weights and a byte
        tokenizer), or a directory with ``config.json`` and
        ``model.safetensors`` or sharded safetensors with ``model.safetensors.index.json``; official DeepSeek layout (FP8/FP4 or plain) or a
        transformers ``save_pretrained`` directory. Any other transformers causal LM — a
        ``PreTrainedModel`` object or a directory whose ``model_type`` transformers knows — becomes an
        ``HFCausalLM`` target (``dspark.models.hf_causal``).
    device : where the weights live; default CPU for a directory, and for a model object where it
        already is.
    dtype : parameter dtype (parameters the model keeps in fp32 stay fp32); default float32 on CPU,
        bfloat16 elsewhere (a model object keeps its own unless one is given).
    **options : model-level options of the family, fixed for the model's life; DeepSeek-V4.1:
        ``prefill_mode`` ("bounded_replay" default, or "exact"), ``engram_tables`` ("auto",
        "device", "host") and ``cache_qat`` (True default). Both DeepSeek families: ``kernels``, a
        ``dspark.kernels.KernelConfig`` choosing the fused Triton kernels or the torch references
        per op (default ``KernelConfig.for_device(device)``: Triton on CUDA, references elsewhere).
        A transformers causal LM: ``tokenizer`` (its tokenizer; a directory's own is loaded by
        default) and ``draft_stage`` (``DraftStageShape`` or dict: sizes of DSpark stages built for it).

    Returns
    -------
    The model in eval mode, with ``model.tokenizer`` (None when the directory has no
    ``tokenizer.json``), ``model.has_mtp`` (False when the checkpoint has no ``mtp.*`` weights) and
    ``model.dspark`` (the DSpark drafter of a DSpark checkpoint, else None).

    Raises
    ------
    FileNotFoundError for a missing directory, config or weights; ValueError for an unknown
    ``model_type``, an unknown option or weights that do not match the config (every bad key named).
    """
    if isinstance(path, torch.nn.Module):
        from dspark.models.hf_causal import wrap_hf_model  # imports transformers: only for its targets

        return wrap_hf_model(path, device, dtype, **options)
    if isinstance(path, str) and path == RANDOM_TINY:
        return _random_tiny(device, dtype)
    path = EMBEDDED[path] if isinstance(path, str) and path in EMBEDDED else Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    config = _read_config(path)
    if config.get("model_type") not in MODEL_FAMILIES and _transformers_causal_lm(config.get("model_type")):
        from dspark.models.hf_causal import load_hf_directory

        model = load_hf_directory(path, *_placement(device, dtype), **options)
    else:
        family = _family(config, str(path / CONFIG_FILE))
        model = _build(family, config, device, dtype, options)
        family.load_weights(model, path, config)
        model.tokenizer = _load_tokenizer(path)
    if (path / DRAFTER_DIR / CONFIG_FILE).is_file():
        # A trained drafter shipped beside the weights (`dspark train-draft` output) becomes the
        # model's own DSpark drafter, which `generate` picks by default.
        model.dspark = load_drafter(path / DRAFTER_DIR, model)
    return model.eval().requires_grad_(False)


def _transformers_causal_lm(model_type) -> bool:
    """Whether transformers knows `model_type` as a causal LM (imports transformers: ~0.5 s on a
    CPU, so only for a model type no family of ours takes)."""
    from dspark.models.hf_causal import is_transformers_causal_lm

    return is_transformers_causal_lm(model_type)


def _random_tiny(device, dtype) -> torch.nn.Module:
    from dspark.tokenizer import ByteTokenizer

    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    model = init_model(config, seed=0, device=device, dtype=dtype)
    model.tokenizer = ByteTokenizer(config["vocab_size"])
    return model


def init_model(
    config: dict | str | Path,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    **options,
) -> torch.nn.Module:
    """Build a model with random weights (``init_weights(seed)``), in eval mode, without tokenizer.

    ``config`` is a config dict, the name of a shipped config (``dspark.configs.NAMES``, e.g.
    ``"v4-mini"``) or the path of a ``config.json`` (or of its directory); dtype and ``options`` as
    in :func:`load_model`.
    """
    if isinstance(config, str) and config in configs.NAMES:
        config = configs.load_config(config)
    if not isinstance(config, Mapping):
        config = _read_config(Path(config))
    family = _family(config, "config")
    model = _build(family, dict(config), device, dtype, options)
    model.init_weights(seed)
    model.tokenizer = None
    return model.eval().requires_grad_(False)
