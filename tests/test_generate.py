"""`dspark.generate` (plain decoding): argument checks, stopping, batching and seeding."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    model = dspark.init_model(config, seed=0)
    model.tokenizer = ByteTokenizer(config["vocab_size"])
    return model


def _prompts(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _greedy_reference(model, prompt, n):
    """Feed the whole sequence again at every step: no decode state reuse at all."""
    seq = list(prompt)
    for _ in range(n):
        state = model.new_state()
        logits = model(torch.tensor(seq), [state], [len(seq)]).logits
        seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):]


def test_greedy_matches_full_recompute(tiny):
    prompt = _prompts(1, seed=3)[0]
    out = dspark.generate(tiny, prompt, max_new_tokens=12)
    assert out.token_ids == _greedy_reference(tiny, prompt, 12)
    assert out.finish_reason == "length"
    assert out.stats.rounds == 11 and out.stats.tau == 1.0


def test_batch_equals_single_and_chunking_is_invisible(tiny):
    prompts = _prompts(4, seed=1)
    single = [dspark.generate(tiny, p, max_new_tokens=10).token_ids for p in prompts]
    batch = dspark.generate(tiny, prompts, max_new_tokens=10, prefill_chunk=5)
    assert [o.token_ids for o in batch] == single


def test_text_prompt_round_trips_through_tokenizer(tiny):
    out = dspark.generate(tiny, "def fibonacci(n):", max_new_tokens=5)
    assert out.stats.prompt_tokens == len("def fibonacci(n):".encode())
    assert isinstance(out.text, str)


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny):
    p = _prompts(1, seed=2)[0]
    a = dspark.generate(tiny, p, max_new_tokens=16, temperature=1.0, seed=7).token_ids
    b = dspark.generate(tiny, p, max_new_tokens=16, temperature=1.0, seed=7).token_ids
    c = dspark.generate(tiny, p, max_new_tokens=16, temperature=1.0, seed=8).token_ids
    assert a == b and a != c


def test_stops_at_eos(tiny):
    prompt = _prompts(1, seed=4)[0]
    free = dspark.generate(tiny, prompt, max_new_tokens=6).token_ids
    # Declare the third generated token to be EOS: generation must stop right after it.
    stop_model_eos = free[2]
    cfg = dict(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()),
               eos_token_id=stop_model_eos)
    other = dspark.init_model(cfg, seed=0)
    out = dspark.generate(other, prompt, max_new_tokens=6)
    assert out.token_ids == free[: free.index(stop_model_eos) + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(draft_tokens=-1), "draft_tokens"),
    (dict(draft_tokens=9), "draft_tokens"),
    (dict(draft_tokens="many"), "draft_tokens"),
    (dict(planner="magic", draft_tokens="auto"), "planner"),
    (dict(prefill_chunk=True), "prefill_chunk"),
    (dict(max_new_tokens=10**6), "max_position_embeddings"),
    (dict(drafter="zzz"), "drafter must be None, one of"),  # refused even where no round drafts
])
def test_bad_arguments_name_the_argument(tiny, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        dspark.generate(tiny, [1, 2, 3], **kwargs)


@pytest.mark.parametrize("prompt, needle", [
    ([], "empty"),
    ([[]], "empty"),
    ([1, 2, 999], "999"),
    ([1.5, 2], "list of ints"),
])
def test_bad_prompts_are_named(tiny, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        dspark.generate(tiny, prompt)


def test_text_without_tokenizer_is_refused(tiny):
    bare = dspark.init_model(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()))
    with pytest.raises(ValueError, match="tokenizer"):
        dspark.generate(bare, "hello")


def test_cli_generates(capsys):
    from dspark.cli import main
    assert main(["generate", "Hello", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Hello")
    assert "4 tokens" in captured.err


def test_cli_drafts_by_default_with_the_models_own_drafter_and_equals_plain(capsys):
    """dspark-tiny ships a DSpark drafter: the default is "auto" (greedy here, so the text is plain
    decoding's); --draft-tokens 0 decodes plainly; a model without one decodes plainly by default."""
    from dspark.cli import main

    outs = {}
    for extra in ([], ["--draft-tokens", "0"]):
        assert main(["generate", "def fibonacci(n):", "--max-new-tokens", "48"] + extra) == 0
        outs[tuple(extra)] = capsys.readouterr()
    (auto_out, auto_err), (plain_out, plain_err) = outs[()], outs[("--draft-tokens", "0")]
    assert auto_out == plain_out
    rounds = [int(err.split(" rounds")[0].rsplit(" ", 1)[-1]) for err in (auto_err, plain_err)]
    assert rounds[1] == 47 and rounds[0] < 30  # the greedy tiny pair accepts most drafts
    assert main(["generate", "ab", "--model", "random-tiny", "--max-new-tokens", "6"]) == 0
    assert "5 rounds, tau 1.00" in capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [(["--threads", "0"], "--threads: must be a positive int, got '0'"),
                                          (["--threads", "two"], "--threads: must be a positive int"),
                                          (["--device", "gpu0"], "device 'gpu0' is not a torch device")])
def test_cli_refuses_bad_threads_and_devices_with_a_clear_error(extra, needle, capsys):
    """Bad --threads / --device exit with status 2 and a message naming the value (they used to end
    in torch's RuntimeError / AssertionError tracebacks)."""
    from dspark.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hello", "--max-new-tokens", "2", *extra])
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
