"""`dspark.api.load_model` / `init_model`: dispatch on model_type, defaults, tokenizer, errors."""

import json
from importlib import resources

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import dspark.api as api
from dspark.models.deepseek_v4.checkpoint import save_checkpoint


def tiny_config():
    return json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "plain"
    save_checkpoint(api.init_model(tiny_config(), seed=5), path, quantize=False)
    return path


def write_tokenizer(path):
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))


def test_init_model_is_seeded_and_accepts_a_config_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    a = api.init_model(tiny_config(), seed=7)
    b = api.init_model(tmp_path / "config.json", seed=7)
    c = api.init_model(tmp_path, seed=8)
    assert a.tokenizer is None and not a.training
    assert all(torch.equal(t, b.state_dict()[n]) for n, t in a.state_dict().items())
    assert not torch.equal(a.state_dict()["layers.1.attn.wq_a.weight"], c.state_dict()["layers.1.attn.wq_a.weight"])


def test_default_dtype_is_float32_on_cpu_and_fp32_parameters_stay_fp32():
    assert api.init_model(tiny_config()).state_dict()["head.weight"].dtype == torch.float32
    bf16 = api.init_model(tiny_config(), dtype=torch.bfloat16).state_dict()
    assert bf16["head.weight"].dtype == torch.bfloat16 and bf16["layers.1.attn.attn_sink"].dtype == torch.float32


def test_bare_tokenizer_json_is_attached(plain_dir, tmp_path):
    path = tmp_path / "with_tokenizer"
    path.mkdir()
    for file in plain_dir.iterdir():
        (path / file.name).symlink_to(file)
    write_tokenizer(path)
    model = api.load_model(path)
    assert isinstance(model.tokenizer, Tokenizer)
    assert model.tokenizer.encode("hello world").ids == [1, 2]


def test_tokenizer_config_selects_the_transformers_tokenizer(plain_dir, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "with_tokenizer"
    path.mkdir()
    for file in plain_dir.iterdir():
        (path / file.name).symlink_to(file)
    write_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    model = api.load_model(path)
    assert isinstance(model.tokenizer, PreTrainedTokenizerFast)
    assert model.tokenizer.encode("hello world", add_special_tokens=False) == [1, 2]


def test_importing_the_cli_does_not_import_transformers():
    """transformers (~0.5 s to import on a CPU) is imported where a model needs it (its tokenizer, a
    transformers target), not by `import dspark` or the CLI's imports."""
    import subprocess
    import sys

    code = "import sys, dspark.cli; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


def test_unknown_model_type_is_named(plain_dir, tmp_path):
    path = tmp_path / "other"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**tiny_config(), "model_type": "deepseek_v9"}))
    with pytest.raises(ValueError, match="unknown model_type 'deepseek_v9'; supported: deepseek_v4"):
        api.load_model(path)
    with pytest.raises(ValueError, match="'deepseek_v9'"):
        api.init_model({**tiny_config(), "model_type": "deepseek_v9"})


def test_missing_directory_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        api.load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        api.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        api.load_model(tmp_path)


def test_check_device_names_a_device_this_machine_lacks(monkeypatch):
    """`load_model` / `init_model` placement: a bad device string, CUDA where torch has none, or a
    CUDA index past the machine's count is a ValueError naming it (not torch's assertion)."""
    check_device = api.check_device
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        check_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'cuda': CUDA is not available on this machine"):
        api.init_model("tiny-v4", device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="'cuda:3': this machine has 1 CUDA device"):
        check_device("cuda:3")


def test_dtype_by_name_or_a_clear_error():
    """dtype may be named as transformers takes it ("bfloat16", "torch.float16"); a non-floating or
    unknown dtype is a ValueError naming it (torch's own error came from deep inside the build)."""
    model = api.init_model("tiny-v4", dtype="torch.bfloat16")
    assert torch.bfloat16 in {p.dtype for p in model.parameters()}  # (the mHC parameters stay fp32)
    for bad in ("int8", "bfloat17", torch.int32, 3):
        with pytest.raises(ValueError, match="dtype must be a torch floating dtype"):
            api.init_model("tiny-v4", dtype=bad)
