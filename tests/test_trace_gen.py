"""The bundled conversation trace (scenarios/traces/chat.jsonl) and its generator
(scripts/make_trace.py): the file is what the generator writes with its defaults, every line
follows the trace format of docs/traces.md, and the drawn lengths and turns keep the means of
LMSYS-Chat-1M (arXiv:2309.11998) that the generator cites, divided by its scale."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from harness.models.folder import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "make_trace.py"
BUNDLED = ROOT / "scenarios" / "traces" / "chat.jsonl"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_trace", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load()


@pytest.fixture(scope="module")
def lines() -> list[dict[str, Any]]:
    return [json.loads(line) for line in BUNDLED.read_text(encoding="utf-8").splitlines()]


def test_the_same_arguments_write_the_same_bytes(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert gen.main(["--seed", "3", "--sessions", "20", "--out", str(first)]) == 0
    assert gen.main(["--seed", "3", "--sessions", "20", "--out", str(second)]) == 0
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes() != gen.render(gen.generate(seed=4, sessions=20)).encode()


def test_the_bundled_trace_is_what_the_generator_writes_by_default(tmp_path):
    out = tmp_path / "chat.jsonl"
    assert gen.main(["--out", str(out)]) == 0
    assert out.read_bytes() == BUNDLED.read_bytes(), (
        "regenerate it: python scripts/make_trace.py --out scenarios/traces/chat.jsonl")


def test_the_bundled_trace_is_small_and_of_the_stated_size(lines):
    assert BUNDLED.stat().st_size < 200_000
    assert 120 <= len(lines) <= 200
    data = BUNDLED.read_bytes()
    assert data.endswith(b"\n") and b"\r" not in data and b"\n\n" not in data


def test_every_line_follows_the_trace_format(lines):
    seen: set[str] = set()
    for number, body in enumerate(lines, 1):
        assert isinstance(body, dict), number
        assert ("messages" in body) != ("prompt" in body), number
        assert set(body) <= {"messages", "prompt", "max_tokens", "stream", "session", "at", "model"}
        assert "at" not in body, "the bundled trace leaves arrivals to the scenario's rate"
        assert type(body["max_tokens"]) is int and body["max_tokens"] >= 1, number
        assert type(body.get("stream", False)) is bool, number
        session = body.get("session")
        assert session is None or (isinstance(session, str) and session), number
        messages = body["messages"]
        roles = [m["role"] for m in messages]
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) and m["content"]
                   for m in messages), number
        first_turn = session is None or session not in seen
        # A later turn carries only its new user message; a first turn may open with the system
        # prompt.
        assert roles in (["user"], ["system", "user"]) if first_turn else roles == ["user"], number
        if session is not None:
            seen.add(session)


def test_conversations_are_multi_turn_and_single_turn_as_in_the_dataset(lines):
    turns = Counter(body.get("session") for body in lines)
    single = turns.pop(None)
    conversations = single + len(turns)
    assert conversations == gen.SESSIONS
    assert single >= 10 and len(turns) >= 10 and max(turns.values()) >= 4
    # LMSYS-Chat-1M: 2.0 turns a conversation; a geometric count over 72 conversations has a
    # standard error of 0.17 turns.
    assert abs(len(lines) / conversations - gen.MEAN_TURNS) <= 0.35


def test_the_system_prompts_are_shared_prefixes(lines):
    systems = Counter(body["messages"][0]["content"] for body in lines
                      if body["messages"][0]["role"] == "system")
    assert set(systems) == set(gen.system_prompts())
    assert max(systems.values()) >= 5
    seen: set[str] = set()
    bare = 0  # conversations with no system prompt
    for body in lines:
        session = body.get("session")
        if session is None or session not in seen:
            bare += body["messages"][0]["role"] == "user"
        if session is not None:
            seen.add(session)
    assert bare >= 5


def test_the_lengths_keep_the_cited_means_divided_by_the_scale(lines):
    """The means of the drawn lengths against the paper's (69.5 tokens a prompt, 214.5 a
    response) divided by 8. Prompts are counted by the generated models' own tokenizer. The
    tolerances are about two standard errors of a mean of ~150 lognormal draws (sigma 1.0 for
    prompts: 11%; 0.6 for replies: 5%), plus what the clipping moves (`expected_means`: +4% and
    -3%)."""
    tokenizer = train_tokenizer()
    prompts = [m["content"] for body in lines for m in body["messages"] if m["role"] == "user"]
    prompt_tokens = np.mean([len(tokenizer.encode(text).ids) for text in prompts])
    max_tokens = np.mean([body["max_tokens"] for body in lines])
    assert gen.SCALE == 8
    assert prompt_tokens == pytest.approx(69.5 / 8, rel=0.25)
    assert max_tokens == pytest.approx(214.5 / 8, rel=0.10)
    # The replies' length to the prompts' follows the dataset's 3.1 within the same bounds.
    assert max_tokens / prompt_tokens == pytest.approx(214.5 / 69.5, rel=0.35)
    low, high = gen.OUTPUT_TOKENS
    assert all(low <= body["max_tokens"] <= high for body in lines)
    # 3 lines in 4 stream.
    assert np.mean([body["stream"] for body in lines]) == pytest.approx(0.75, abs=0.1)


def test_the_clipping_moves_the_expected_means_by_a_few_per_cent():
    means = gen.expected_means(draws=1 << 16)
    assert means["prompt_tokens"] == pytest.approx(means["cited_prompt_tokens"], rel=0.06)
    assert means["max_tokens"] == pytest.approx(means["cited_max_tokens"], rel=0.05)


def test_bad_arguments_are_usage_errors(capsys):
    for argv in (["--sessions", "0"], ["--scale", "0"]):
        with pytest.raises(SystemExit) as exited:
            gen.main(argv)
        assert exited.value.code == 2
    assert "sessions must be at least 1" in capsys.readouterr().err
