"""Write a conversation trace for serve mode's trace replay (`workload.http.trace`), the same
bytes for the same arguments.

`python scripts/make_trace.py --out scenarios/traces/chat.jsonl` regenerates the bundled trace;
docs/traces.md describes the format and what is drawn here.

What is drawn, per conversation:

- its turns: a geometric count (n turns with probability 2^-n), capped at `MAX_TURNS`, so
  half the conversations are single-turn and the mean is 2.0 turns, the "average turns per
  sample" of LMSYS-Chat-1M (Zheng et al., 2023, "LMSYS-Chat-1M: A Large-Scale Real-World LLM
  Conversation Dataset", arXiv:2309.11998, Table 1: 2.0 turns, 69.5 tokens per prompt, 214.5
  tokens per response);
- its system prompt: none for a quarter of the conversations, else one of three fixed prompts
  (32, 64 and 128 words) with shares 3/8, 1/4 and 1/8, so each is the shared prefix of many
  conversations. The paper gives no system-prompt figures: these are this script's choice;
- per turn, the user message's length and the reply's `max_tokens`: lognormals whose means are
  the paper's 69.5 and 214.5 tokens, divided by `--scale` (8 by default). The paper gives means
  only; the spreads are this script's choice: sigma 1.0 for prompts (a coefficient of variation
  of 1.3: a user message runs from a word to a pasted page) and 0.6 for replies (0.66: replies
  vary less, and the ceiling below cuts their tail anyway). A prompt's token count becomes
  the words of `sentence` that the generated models' tokenizer reads as that many tokens
  (`TOKENS_PER_WORD`, `SENTENCE_TOKENS`); prompts are clipped to `PROMPT_WORDS` words and
  replies to `OUTPUT_TOKENS` tokens, which moves the means by a few per cent
  (`expected_means`: +4% and -3%);
- per turn, `stream`: true for 3 lines in 4, so time to first token is measured.

Scaled down: at 8, a user message averages 8.7 tokens and a reply 26.8 tokens, sized for a
trace of about 150 requests (75 s of arrivals at two requests a second) to replay against a
tiny random-weight model on two CPU cores in well under three minutes. The shape (lognormal
lengths, the replies' 3.1 times the prompts', the turns per conversation) is the dataset's; the
size is not.

The file's order interleaves conversations as a shared server sees them: conversations start
at exponential gaps of `MEAN_TURNS` request slots (so about one request a slot in all), and a
user answers after 2 + an exponential of mean 6 slots; lines are written in the order of those
times, which the file does not keep (no `at`: the scenario gives the arrival rate). A
multi-turn conversation's lines share a `session`, the later ones carrying only the new user
message; a single-turn one has no `session`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.models.folder import sentence

# LMSYS-Chat-1M (arXiv:2309.11998), Table 1.
MEAN_TURNS = 2.0
MEAN_PROMPT_TOKENS = 69.5
MEAN_RESPONSE_TOKENS = 214.5

SCALE = 8.0  # lengths are divided by this
PROMPT_SIGMA, OUTPUT_SIGMA = 1.0, 0.6  # of the lognormals' logs
# A `sentence` of w words is about TOKENS_PER_WORD * w + SENTENCE_TOKENS tokens with the generated
# models' tokenizer (harness.models.folder): the full stop and the first word's missing leading
# space cost the constant.
TOKENS_PER_WORD, SENTENCE_TOKENS = 1.4, 1.7
PROMPT_WORDS = (1, 200)  # a user message's words, clipped to [low, high]
OUTPUT_TOKENS = (4, 64)  # max_tokens, clipped to [low, high]
MAX_TURNS = 8
SESSIONS = 72  # conversations, single-turn ones included: ~144 requests
STREAM_SHARE = 0.75

# The shared system prompts' lengths in words, and each one's share of the conversations (the
# rest have none).
SYSTEM_WORDS = (32, 64, 128)
SYSTEM_SHARES = (3 / 8, 1 / 4, 1 / 8)

THINK_SLOTS = (2.0, 6.0)  # a user's pause between turns, in request slots: fixed + exponential


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    """One draw of a lognormal with this mean (not median) and log-spread."""
    return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))


def _turns(rng: np.random.Generator) -> int:
    """1 + a geometric count with mean `MEAN_TURNS`, capped at `MAX_TURNS`."""
    return min(int(rng.geometric(1 / MEAN_TURNS)), MAX_TURNS)


def _prompt_words(rng: np.random.Generator, scale: float) -> int:
    tokens = _lognormal(rng, MEAN_PROMPT_TOKENS, PROMPT_SIGMA) / scale
    low, high = PROMPT_WORDS
    return int(np.clip(round((tokens - SENTENCE_TOKENS) / TOKENS_PER_WORD), low, high))


def _max_tokens(rng: np.random.Generator, scale: float) -> int:
    tokens = _lognormal(rng, MEAN_RESPONSE_TOKENS, OUTPUT_SIGMA) / scale
    low, high = OUTPUT_TOKENS
    return int(np.clip(round(tokens), low, high))


def system_prompts(seed: int = 0) -> list[str]:
    """The shared system prompts, drawn from their own stream so that they do not depend on how
    many conversations are drawn."""
    rng = np.random.default_rng([seed, 1])
    return [sentence(rng, words) for words in SYSTEM_WORDS]


def generate(seed: int = 0, sessions: int = SESSIONS, scale: float = SCALE) -> list[dict[str, Any]]:
    """The trace's request bodies, in file order."""
    if sessions < 1:
        raise ValueError(f"sessions must be at least 1, not {sessions}")
    if scale <= 0:
        raise ValueError(f"scale must be positive, not {scale}")
    systems = system_prompts(seed)
    rng = np.random.default_rng([seed, 2])
    shares = [1 - sum(SYSTEM_SHARES), *SYSTEM_SHARES]
    timed: list[tuple[float, int, int, dict[str, Any]]] = []
    start = 0.0
    for conversation in range(sessions):
        start += float(rng.exponential(MEAN_TURNS))
        turns = _turns(rng)
        choice = int(rng.choice(len(shares), p=shares))
        at = start
        for turn in range(turns):
            messages: list[dict[str, str]] = []
            if turn == 0 and choice > 0:
                messages.append({"role": "system", "content": systems[choice - 1]})
            messages.append({"role": "user", "content": sentence(rng, _prompt_words(rng, scale))})
            body: dict[str, Any] = {}
            if turns > 1:
                body["session"] = f"c{conversation + 1:03d}"
            body["messages"] = messages
            body["max_tokens"] = _max_tokens(rng, scale)
            body["stream"] = bool(rng.random() < STREAM_SHARE)
            timed.append((at, conversation, turn, body))
            fixed, spread = THINK_SLOTS
            at += fixed + float(rng.exponential(spread))
    timed.sort(key=lambda row: row[:3])
    return [body for *_, body in timed]


def render(bodies: Sequence[dict[str, Any]]) -> str:
    """One compact JSON object a line, keys in the order they were set, `\\n` line ends."""
    return "".join(json.dumps(body, separators=(",", ":")) + "\n" for body in bodies)


def expected_means(scale: float = SCALE, draws: int = 1 << 20) -> dict[str, float]:
    """What rounding and clipping do to the means: a user message's tokens (estimated from its
    words) and `max_tokens`, averaged over many draws, beside the paper's means divided by
    `scale`."""
    rng = np.random.default_rng(0)
    low, high = PROMPT_WORDS
    logs = rng.normal(size=draws)
    prompt = np.exp(math.log(MEAN_PROMPT_TOKENS) - PROMPT_SIGMA**2 / 2 + PROMPT_SIGMA * logs) / scale
    words = np.clip(np.rint((prompt - SENTENCE_TOKENS) / TOKENS_PER_WORD), low, high)
    low, high = OUTPUT_TOKENS
    reply = np.exp(math.log(MEAN_RESPONSE_TOKENS) - OUTPUT_SIGMA**2 / 2 + OUTPUT_SIGMA * logs) / scale
    return {"prompt_tokens": float(words.mean() * TOKENS_PER_WORD + SENTENCE_TOKENS),
            "max_tokens": float(np.clip(np.rint(reply), low, high).mean()),
            "cited_prompt_tokens": MEAN_PROMPT_TOKENS / scale,
            "cited_max_tokens": MEAN_RESPONSE_TOKENS / scale}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the random seed (default 0)")
    parser.add_argument("--sessions", type=int, default=SESSIONS,
                        help=f"conversations to draw, single-turn ones included (default {SESSIONS})")
    parser.add_argument("--scale", type=float, default=SCALE,
                        help=f"divide the dataset's lengths by this (default {SCALE:g})")
    parser.add_argument("--out", default="-", help="the .jsonl file to write (default: stdout)")
    args = parser.parse_args(argv)
    try:
        text = render(generate(args.seed, args.sessions, args.scale))
    except ValueError as error:
        parser.error(str(error))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(text.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
