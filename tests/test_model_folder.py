"""Model folders for serve mode: loadable offline by mlx-lm, a tokenizer that does not collapse
prompts, reused across calls, written atomically, and one-line errors naming the path."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from harness.models import folder as model_folder
from harness.models import presets
from harness.models.loading import ModelChoice, ModelError

PRESETS = ("qwen3-tiny", "qwen3.5-tiny")
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def choice(preset: str = "qwen3-tiny", **fields) -> ModelChoice:
    values = {"preset": preset, "path": None, "layers": None, "vocab": None,
              "dtype": "bfloat16", "bits": None, "group_size": 64}
    values.update(fields)
    return ModelChoice(**values)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvmem-cache")


@pytest.fixture(scope="module")
def loaded(root):
    """Each preset's folder (built once for the module) and what mlx-lm loads from it."""
    from mlx_lm.utils import load

    out = {}
    for preset in PRESETS:
        path = model_folder.folder(choice(preset), root)
        model, tokenizer = load(str(path))[:2]
        out[preset] = (path, model, tokenizer)
    return out


def leftovers(root: Path) -> list[str]:
    """Staging folders left behind (a build that failed or lost a race must remove its own)."""
    return sorted(p.name for p in (root / "models").glob(".*.tmp"))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_folder_loads_with_mlx_lm_and_runs(loaded, preset):
    path, model, tokenizer = loaded[preset]
    assert re.fullmatch(rf"{re.escape(preset)}-[0-9a-f]{{12}}", path.name)
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    config = json.loads((path / "config.json").read_text())
    assert config == presets.PRESETS[preset].config
    ids = tokenizer.encode("the river")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), 1024)
    assert logits.dtype == mx.bfloat16


@pytest.mark.parametrize("preset", PRESETS)
def test_a_prompt_is_many_tokens_not_one(loaded, preset):
    """A word-level tokenizer saved the same way collapses a prompt to one token; this one
    gives one or two tokens a word."""
    _, _, tokenizer = loaded[preset]
    prompt = "Write a story about a river and a mountain in the morning."
    ids = tokenizer.encode(prompt)
    assert 12 <= len(ids) <= 24
    assert len(ids) == 20
    assert tokenizer.decode(ids) == prompt
    assert tokenizer.encode("hello world write a story") == model_folder.train_tokenizer().encode(
        "hello world write a story").ids
    assert tokenizer.eos_token_ids == {2}


def test_sentence_text_is_about_one_and_a_half_tokens_a_word(loaded):
    _, _, tokenizer = loaded["qwen3-tiny"]
    text = model_folder.sentence(np.random.default_rng(0), 100)
    assert len(text.split()) == 100
    assert len(tokenizer.encode(text)) == 138


@pytest.mark.parametrize("preset", PRESETS)
def test_the_chat_template_renders_two_turns_and_the_generation_prompt(loaded, preset):
    _, _, tokenizer = loaded[preset]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Write a story."},
                {"role": "assistant", "content": "The river was long."},
                {"role": "user", "content": "And the mountain?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWrite a story.<|im_end|>\n"
                    "<|im_start|>assistant\nThe river was long.<|im_end|>\n"
                    "<|im_start|>user\nAnd the mountain?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(1) == 5 and ids.count(2) == 4  # <|im_start|>, <|im_end|>
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text.startswith(without) and without.endswith("<|im_end|>\n")


def test_a_second_call_reuses_the_folder_without_rewriting_it(loaded, root):
    path = loaded["qwen3-tiny"][0]
    before = {name: (path / name).stat() for name in FILES}
    again = model_folder.folder(choice(), root)
    assert again == path
    after = {name: (path / name).stat() for name in FILES}
    assert {n: (s.st_ino, s.st_mtime_ns) for n, s in before.items()} == \
        {n: (s.st_ino, s.st_mtime_ns) for n, s in after.items()}
    assert leftovers(root) == []


def test_dtype_layers_and_quantization_each_get_their_own_folder(loaded, root):
    from mlx_lm.utils import load

    base = loaded["qwen3-tiny"][0]
    wide = model_folder.folder(choice(dtype="float32"), root)
    short = model_folder.folder(choice(layers=2), root)
    quantized = model_folder.folder(choice(bits=4), root)
    assert len({base, wide, short, quantized}) == 4
    assert json.loads((short / "config.json").read_text())["num_hidden_layers"] == 2
    assert json.loads((quantized / "config.json").read_text())["quantization"] == \
        {"group_size": 64, "bits": 4}
    model, _ = load(str(quantized))[:2]
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    assert mx.load(str(wide / "model.safetensors"))["model.norm.weight"].dtype == mx.float32


def test_a_path_choice_is_the_users_own_folder(tmp_path):
    assert model_folder.folder(choice(preset=None, path=str(tmp_path))) == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("KVMEM_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_folder.cache_root() == tmp_path / "home" / ".cache" / "kvmem"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_folder.cache_root() == tmp_path / "xdg" / "kvmem"
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "own"))
    assert model_folder.cache_root() == tmp_path / "own"


def test_a_vocab_smaller_than_the_tokenizers_is_refused(tmp_path):
    with pytest.raises(ModelError, match=r"vocab 256 is smaller than the generated "
                                         r"tokenizer's 512 tokens"):
        model_folder.folder(choice(vocab=256), tmp_path)
    assert not (tmp_path / "models").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_read_only_root_is_a_model_error_naming_the_path(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.raises(ModelError, match=re.escape(f"{root / 'models'}: Permission denied")):
            model_folder.folder(choice(), root)
    finally:
        root.chmod(0o755)


def test_a_read_only_file_system_is_a_model_error_naming_the_path(tmp_path, monkeypatch):
    """EROFS as the OS gives it (simulated: root can write through a read-only mode)."""
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(ModelError) as error:
        model_folder.folder(choice(), tmp_path)
    message = str(error.value)
    assert message.startswith(f"cannot write the model folder {tmp_path / 'models'}/qwen3-tiny-")
    assert message.endswith(f"{tmp_path / 'models'}: Read-only file system")


def test_a_root_that_is_a_file_is_a_model_error(tmp_path):
    root = tmp_path / "file"
    root.write_text("")
    with pytest.raises(ModelError, match=re.escape(f"{root / 'models'}: Not a directory")):
        model_folder.folder(choice(), root)


def test_a_full_disk_is_a_model_error_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """The weights written to /dev/full: MLX's own write error, with the file named."""
    real = mx.save_safetensors

    def save(path, *args, **kwargs):
        os.symlink("/dev/full", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mx, "save_safetensors", save)
    with pytest.raises(ModelError, match=r"model\.safetensors: \[write\] Unable to write"):
        model_folder.folder(choice(), tmp_path)
    assert leftovers(tmp_path) == []
    assert list((tmp_path / "models").iterdir()) == []


def test_a_folder_another_process_renamed_first_is_kept(tmp_path, monkeypatch):
    real = model_folder._write
    final = tmp_path / "models" / model_folder.folder_name(choice())

    def write(target, *args):
        real(target, *args)
        final.mkdir()  # the other process's rename lands while this one is writing
        (final / "theirs").write_text("")

    monkeypatch.setattr(model_folder, "_write", write)
    assert model_folder.folder(choice(), tmp_path) == final
    assert sorted(p.name for p in final.iterdir()) == ["theirs"]
    assert leftovers(tmp_path) == []


def test_sentence_is_deterministic_for_a_seed():
    assert model_folder.sentence(np.random.default_rng(0), 6) == "build server thing were can of."
    first = model_folder.sentence(np.random.default_rng(5), 300)
    assert first == model_folder.sentence(np.random.default_rng(5), 300)
    assert set(first.rstrip(".").split()) <= set(model_folder.WORDS)


def test_the_tokenizer_recipe_is_deterministic():
    tokenizer = model_folder.train_tokenizer()
    assert tokenizer.get_vocab_size() == model_folder.TOKENIZER_VOCAB == 512
    assert [tokenizer.token_to_id(t) for t in model_folder.SPECIAL_TOKENS] == [0, 1, 2]
    assert tokenizer.to_str() == model_folder.train_tokenizer().to_str()
