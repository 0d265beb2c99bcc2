"""What one grammar may cost: llguidance's parser limits as the engine's options, and what
its errors mean in a request's answer.

Each limit is an `EngineConfig` field (so a `--structured-outputs-...` flag); the defaults
are llguidance's own. A grammar that exceeds one is refused at validation when the front-end
can tell (a 400 naming the field), else its request ends with finish reason `error` and
`explain`'s reason, and its compiled grammar is cached as failed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The front-end's probe (see grammar_validator) follows a grammar this many tokens.
PROBE_TOKENS = 2


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """llguidance's `LLParserLimits` (defaults: llguidance's).

    `max_items_in_row`: Earley items one grammar row may hold (alternatives of a rule);
    `max_items_per_step`: Earley items one token's mask may create; `lexer_fuel`: work
    building a grammar's lexer (regex derivatives); `step_lexer_fuel`: lexer work per token's
    mask; `max_lexer_states`: lexer states a grammar may build (1-2 kB each);
    `max_grammar_size`: symbols in a grammar's productions.
    """

    max_items_in_row: int = 2000
    max_items_per_step: int = 50_000
    lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000

    @staticmethod
    def of(config: Any) -> GrammarLimits:
        """The limits an `EngineConfig` sets (its `structured_outputs_*` fields)."""
        return GrammarLimits(**{name: getattr(config, f"structured_outputs_{name}")
                                for name in GrammarLimits.__dataclass_fields__})

    def parser_limits(self) -> Any:
        """As `llguidance.LLParserLimits`; errors without llguidance's state dumps (a public
        endpoint must not echo a grammar's internals)."""
        import llguidance
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row, step_max_items=self.max_items_per_step,
            initial_lexer_fuel=self.lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
            verbose_errors=False)


# llguidance's error text -> the option that bounds it.
_FLAGS = (("Current row has", "--structured-outputs-max-items-in-row"),
          ("too many expressions", "--structured-outputs-lexer-fuel"),
          ("fuel", "--structured-outputs-step-lexer-fuel"),
          ("too many states", "--structured-outputs-max-lexer-states"),
          ("grammar size", "--structured-outputs-max-grammar-size"),
          ("too many items", "--structured-outputs-max-items-per-step"),
          ("max_items", "--structured-outputs-max-items-per-step"))
_EMPTY = ("NoExtension",)  # the grammar allows nothing at all from where it stands


def explain(error: str, at_start: bool) -> str:
    """A matcher's error as the end of a sentence that starts with the constraint's field
    (`structured_outputs.regex ...`): what happened, and the option that bounds it."""
    text = error.replace("<non-verbose/>", "").strip()
    first = text.splitlines()[0].strip() if text else "an unknown error"
    if any(first.startswith(marker) for marker in _EMPTY):
        return ("admits no output at all (its language is empty: e.g. a $ref loop, an "
                "empty character class, a rule that never ends)" if at_start else
                "reached a point where no token can continue it")
    for marker, flag in _FLAGS:
        if marker in first:
            return f"exceeds the grammar engine's limits ({first}; the limit is {flag})"
    return f"failed in the grammar engine: {first}"


def empty_language() -> str:
    return explain("NoExtension", at_start=True)
