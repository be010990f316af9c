"""Prompt characters to engine tokens, for routing in the engine's own units. Pure logic.

The proxy sees prompt text; the engine counts tokens, caches them in blocks of
`tokens_per_block`, and prefills the tokens it did not cache. The routing cost model
needs prompt lengths in tokens, and tokenizing every prompt on the request path costs
milliseconds for long ones, so it uses a ratio, tokens per character, learnt from:

- the model repository's tokenizer, where the data plane hands one over (`count`):
  one prompt in SAMPLE_EVERY is tokenized and the ratio is the running total of
  tokens over characters;
- else the engines' own input lengths: TRT-LLM's `nv_llm_input_token_len` histogram
  (sum over count: mean prompt tokens per finished request, all instances together)
  over the mean length in characters of the prompts routed with a known prompt.

The ratio is kept on the rates' grid (cost_model.GRID: 1/16 octave, about 4%): every
data-plane worker learns it from a slightly different sample of prompts, and on the grid
they agree (a decision must not depend on which worker took the request).
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.routing.cost_model import at_step, grid_step

# Before anything was learnt: English text through a BPE tokenizer is about 4 characters
# per token. Replaced by the first calibration (the first finished requests), so it only
# decides the first few routes.
PRIOR_TOKENS_PER_CHAR = 0.25
SAMPLE_EVERY = 64  # tokenizer path: one prompt in 64 pays for its tokenization...
SAMPLES = 256  # ...until this many were (the ratio of a model's traffic does not drift)
KEEP = 1.0 - 1.0 / 4096  # the means forget over a few thousand requests
# A ratio this much inside its grid step's bounds (relatively) is on that step for sure: log2's
# rounding error is about 1e-16 of it. Only a margin for the arithmetic, not a tuning.
_INSIDE = 1e-9


class PromptStats:
    """Characters per routed prompt, over the last few thousand prompts (forgotten sums): the
    engines' mean is over the requests that finished lately, which lag the ones routed; over
    thousands of requests the lag is a few percent, below the grid."""

    __slots__ = ("n", "chars")

    def __init__(self) -> None:
        self.n = 0.0
        self.chars = 0.0

    def add(self, chars: int) -> None:
        self.n = self.n * KEEP + 1.0
        self.chars = self.chars * KEEP + chars


class TokenRatio:
    """Tokens per prompt character; `value` is on the grid."""

    __slots__ = ("value", "source", "_count", "_seen", "_tok_sum", "_char_sum", "prompts", "_engine_n",
                 "_engine_sum", "_lo", "_hi")

    def __init__(self, count: Callable[[str], int] | None = None, prompts: "PromptStats | None" = None) -> None:
        self.value = PRIOR_TOKENS_PER_CHAR
        self.source = "prior"
        self._count = count
        self._seen = 0
        self._tok_sum = 0.0
        self._char_sum = 0.0
        # The prompts routed (kept where every data-plane worker can share them: journal.py), and
        # forgotten sums of the requests the engines finished and their prompt tokens (all
        # instances together; every worker sees the same snapshots).
        self.prompts = prompts if prompts is not None else PromptStats()
        self._engine_n = 0.0
        self._engine_sum = 0.0
        # the engines' ratio's grid step, inside its bounds (none yet): a ratio strictly between
        # them leaves the value as it is
        self._lo = self._hi = 0.0

    def tokens(self, chars: int) -> int:
        return int(chars * self.value)

    # --- what the router sees ----------------------------------------------------------------
    def prompt(self, text_len: int, text: str | None = None) -> None:
        """A prompt routed (its length in characters; its text where a tokenizer may sample it)."""
        if text_len <= 0:
            return
        self.prompts.add(text_len)
        if self._count is not None and text:
            self._seen += 1
            if self._seen % SAMPLE_EVERY == 1 and self._seen <= SAMPLE_EVERY * SAMPLES:
                self._tok_sum += self._count(text)
                self._char_sum += len(text)
                self._set(self._tok_sum / self._char_sum, "tokenizer")
                return
        if self.source != "tokenizer":
            self._calibrate()

    def engine(self, d_tokens: float, d_finished: float) -> None:
        """An engine's input histogram moved: `d_finished` requests with `d_tokens` prompt tokens."""
        if d_finished <= 0 or d_tokens <= 0:
            return
        k = KEEP ** d_finished
        self._engine_n = self._engine_n * k + d_finished
        self._engine_sum = self._engine_sum * k + d_tokens
        if self.source != "tokenizer":
            self._calibrate()

    def _calibrate(self) -> None:
        prompts = self.prompts
        if self._engine_n < 1 or prompts.n < 1:
            return
        ratio = (self._engine_sum / self._engine_n) / (prompts.chars / prompts.n)
        if self._lo < ratio < self._hi:
            # On the step it is on: the value and its source stay. Every routed prompt calibrates,
            # and the step changes a few times a run: the log2, round and pow were 4% of a
            # cost-model decision (bench/decision_cost.py, 16 instances).
            return
        self._set(ratio, "engine")

    def _set(self, ratio: float, source: str) -> None:
        if ratio > 0:
            step = grid_step(ratio)
            self.value = at_step(step)
            self.source = source
            if source == "engine":
                self._lo = at_step(step - 0.5) * (1.0 + _INSIDE)
                self._hi = at_step(step + 0.5) * (1.0 - _INSIDE)
            else:
                self._lo = self._hi = 0.0
