"""Local model folders that `mlx_lm.server` (or any Hugging-Face-format loader) opens offline.

Serve mode runs a real server process, which loads a model by folder name: `config.json`,
`model.safetensors`, `tokenizer.json` and `tokenizer_config.json`. A preset of
`harness.models.presets` is only a config; `folder` writes the rest, so no checkpoint is ever
downloaded and the model is the same random-weight model the `mlx_lm` engine builds
(`models.build` after `mx.random.seed(0)`, in the choice's dtype, quantized when `bits` is set).

The tokenizer is a byte-level BPE of 512 tokens trained here (about 0.1 s), on sentences drawn
from a fixed list of 128 words: a byte-level one encodes any text, and its merges make a word
one or two tokens (1.4 on average), so a prompt's token count follows its words, which is what
a memory test of a prompt cache needs. (A word-level tokenizer saved the same way loads, but
transformers then encodes a whole prompt as one token.) `sentence` draws text from the same
list for a traffic generator. `tokenizer_config.json` names `PreTrainedTokenizerFast`;
transformers 5 loads `TokenizersBackend` for qwen3 and `Qwen3_5Tokenizer` for qwen3_5 from
the model type instead, and both encode exactly as the trained tokenizer does.

Folders are cached across runs under `<root>/models/<preset>-<hash>`, where the hash covers
everything a folder's bytes depend on (a format version, the config, dtype, quantization and
the tokenizer recipe); a folder is built in a temporary sibling and renamed into place, so a
reader never sees half a folder and two processes building the same one both end with a whole
one. A folder that cannot be written is a `ModelError` naming the path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from . import loading as models
from . import presets
from .loading import ModelChoice, ModelError

# Bump when what `folder` writes changes, so cached folders of the old format are not reused.
FORMAT_VERSION = 1

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Byte-level BPE: 256 byte tokens, the three special tokens and the merges learned from the
# corpus up to this many entries.
TOKENIZER_VOCAB = 512
CORPUS_SENTENCES = 3000
CORPUS_SEED = 20240611
CORPUS_WORDS = (4, 16)  # words per training sentence, [low, high)

# Plain English words: the training corpus and `sentence` both draw from this list.
WORDS = (
    "the", "a", "and", "or", "but", "of", "to", "in", "on", "at", "by", "for", "with", "from",
    "over", "after", "before", "when", "where", "how", "what", "which", "who", "this", "that",
    "it", "they", "we", "you", "she", "he", "is", "are", "was", "were", "be", "has", "have",
    "do", "can", "will", "would", "could", "may", "not", "no", "all", "some", "many", "more",
    "other", "new", "old", "good", "small", "large", "long", "first", "last", "next", "time",
    "year", "day", "people", "way", "thing", "world", "life", "hand", "part", "child", "place",
    "work", "point", "number", "group", "problem", "cache", "memory", "model", "token",
    "server", "request", "prompt", "answer", "question", "story", "river", "mountain", "city",
    "road", "house", "garden", "window", "door", "book", "letter", "music", "water", "light",
    "stone", "tree", "morning", "evening", "write", "read", "run", "walk", "build", "make",
    "take", "give", "find", "keep", "tell", "ask", "show", "call", "move", "live", "begin",
    "turn", "open", "close", "learn", "change", "often", "again",
)

# ChatML, as Qwen models use it: one block per message, then the assistant's opening on request.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def sentence(rng: np.random.Generator, words: int) -> str:
    """`words` words drawn uniformly from `WORDS`, space-separated, ending with a full stop
    (about 1.4 tokens a word with the folders' tokenizer: 300 words are ~430 tokens)."""
    picks = rng.integers(0, len(WORDS), size=words)
    return " ".join(WORDS[i] for i in picks) + "."


def _recipe() -> dict[str, Any]:
    """Everything the tokenizer's bytes depend on (the trainer's version included)."""
    import tokenizers

    return {"words": WORDS, "special": SPECIAL_TOKENS, "vocab": TOKENIZER_VOCAB,
            "sentences": CORPUS_SENTENCES, "seed": CORPUS_SEED, "lengths": CORPUS_WORDS,
            "chat_template": CHAT_TEMPLATE, "tokenizers": tokenizers.__version__}


def _config(choice: ModelChoice) -> dict[str, Any]:
    assert choice.preset is not None
    config = presets.config(choice.preset, choice.layers, choice.vocab)
    if choice.bits is not None:
        config["quantization"] = {"group_size": choice.group_size, "bits": choice.bits}
    return config


def cache_root() -> Path:
    """`$KVMEM_CACHE`, else `$XDG_CACHE_HOME/kvmem`, else `~/.cache/kvmem`."""
    if os.environ.get("KVMEM_CACHE"):
        return Path(os.environ["KVMEM_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kvmem"
    return Path.home() / ".cache" / "kvmem"


def folder_name(choice: ModelChoice) -> str:
    """`<preset>-<12 hex digits>`: the hash covers all a folder's bytes depend on."""
    assert choice.preset is not None
    key = {"format": FORMAT_VERSION, "config": _config(choice), "dtype": choice.dtype,
           "bits": choice.bits, "group_size": choice.group_size if choice.bits else None,
           "tokenizer": _recipe()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return f"{choice.preset}-{digest[:12]}"


def folder(choice: ModelChoice, root: Path | None = None) -> Path:
    """A local model folder for the choice, built once and reused: the user's own folder for a
    choice with `path`, else `<root>/models/<preset>-<hash>` (root: `cache_root()`)."""
    if choice.path is not None:
        return Path(choice.path)
    if choice.preset not in presets.buildable():
        raise ModelError(f"no model preset {choice.preset!r} (expected one of "
                         + ", ".join(presets.buildable()) + ")")
    config = _config(choice)
    if config["vocab_size"] < TOKENIZER_VOCAB:
        raise ModelError(f"model {choice.name}: vocab {config['vocab_size']} is smaller than "
                         f"the generated tokenizer's {TOKENIZER_VOCAB} tokens (give vocab >= "
                         f"{TOKENIZER_VOCAB})")
    parent = (root if root is not None else cache_root()) / "models"
    final = parent / folder_name(choice)
    if final.is_dir():
        return final
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=parent))
    except OSError as exc:
        raise ModelError(_unwritable(final, exc)) from None
    try:
        _write(staging, choice, config)
        try:
            staging.rename(final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                raise
            # Another process renamed its folder into place first: theirs is as good.
    except OSError as exc:
        raise ModelError(_unwritable(final, exc)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _unwritable(final: Path, exc: OSError) -> str:
    """One line: the folder, and the path and reason the OS gave."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = f"{exc.filename}: " if exc.filename else ""
    return f"cannot write the model folder {final}: {where}{reason}"


def _write(target: Path, choice: ModelChoice, config: dict[str, Any]) -> None:
    """The four files into `target` (an empty folder)."""
    tokenizer = train_tokenizer()
    size = tokenizer.get_vocab_size()
    if size > config["vocab_size"]:  # the recipe's own size is checked before; this is its proof
        raise ModelError(f"model {choice.name}: vocab {config['vocab_size']} is smaller than "
                         f"the generated tokenizer's {size} tokens")
    _write_text(target / "config.json", json.dumps(config, indent=2, sort_keys=True))
    _write_text(target / "tokenizer.json", tokenizer.to_str())
    _write_text(target / "tokenizer_config.json", json.dumps(_tokenizer_config(), indent=2))
    _write_weights(target / "model.safetensors", choice)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text + "\n", encoding="utf-8")


def _write_weights(path: Path, choice: ModelChoice) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(0)
    model = models.build(choice)
    weights: Any = dict(tree_flatten(model.parameters()))
    try:
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    except RuntimeError as exc:  # MLX reports a failed write so, with its reason in the text
        raise OSError(errno.EIO, str(exc).strip() or "write failed", str(path)) from None


def _tokenizer_config() -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END,
            "pad_token": ENDOFTEXT, "bos_token": None, "add_bos_token": False,
            "model_max_length": 40960, "chat_template": CHAT_TEMPLATE}


def corpus() -> list[str]:
    """The tokenizer's training text: `CORPUS_SENTENCES` sentences from a fixed seed."""
    rng = np.random.default_rng(CORPUS_SEED)
    low, high = CORPUS_WORDS
    return [sentence(rng, int(rng.integers(low, high))) for _ in range(CORPUS_SENTENCES)]


def train_tokenizer() -> Any:
    """A byte-level BPE (`tokenizers.Tokenizer`) of `TOKENIZER_VOCAB` tokens, trained on
    `corpus()`; the special tokens take ids 0, 1 and 2."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer
