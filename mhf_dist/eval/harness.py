"""The lm-evaluation-harness model `mhf`: any exported mhf-dist model, scored exactly.

Log-likelihoods come from the same code as `mhf eval` (`mhf_dist.eval.scoring`), so both agree on the
same data. `--batch_size` is the requests scored per forward pass (`auto` / `auto:N` mean
AUTO_BATCH_SIZE: no memory probing). Contexts longer than `max_length` (default 1024, at most
max_position_embeddings) lose their oldest tokens, as in lm-eval's Hugging Face model.

    mhf-lm-eval --model mhf --model_args path=runs/.../model --tasks hellaswag --include_path my_tasks/
    # or in Python, after `import mhf_dist.eval.harness`:
    lm_eval.simple_evaluate(model="mhf", model_args="path=...", tasks=[...])

A `bos` model reads BOS before every context and as the empty context (the prefix token of rolling
windows); an `eos` model reads contexts as they are and EOS as the empty context. `lm_eval` cannot
discover models outside its source tree, so `mhf-lm-eval` is lm-eval's own command line with this model
registered. Needs `pip install 'mhf-dist[eval]'`.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Any, NoReturn

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from mhf_dist import interrupts
from mhf_dist.errors import Interrupted, MhfError, as_interrupted
from mhf_dist.eval.scoring import ScoringError, score_continuations
from mhf_dist.eval.tasks import check_positions
from mhf_dist.export import load_exported
from mhf_dist.models.generation import Sampling, generate_batch

AUTO_BATCH_SIZE = 16  # what `--batch_size auto` (or auto:N) means here
MODEL_ARGS = ("path", "max_length", "batch_size")
DEFAULT_MAX_LENGTH = 1024  # lm-eval's Hugging Face default, lowered to max_position_embeddings where smaller
RUNNER_ARGS = ("device", "max_batch_size")  # lm-eval passes them to every model; the scoring needs neither
DEFAULT_MAX_GEN_TOKS = 128  # a generate_until request without max_gen_toks
UNKNOWN_TASKS = "Tasks not found:"  # how lm-eval's task manager refuses a task name
NO_TASKS = "No tasks specified"  # and how its evaluator refuses a command line without --tasks
DECODE_CONTEXT = 8  # prompt ids decoded before a continuation (a SentencePiece space, a split character)


def harness_batch_size(value: int | str) -> int:
    """lm-eval's batch size (model_args give strings): a positive integer, or `auto` / `auto:N`."""
    text = str(value)
    if re.fullmatch(r"auto(:[1-9][0-9]*)?", text):
        return AUTO_BATCH_SIZE
    if not text.isdigit() or int(text) < 1:
        raise ScoringError(f"batch_size={value!r}; use a positive integer, 'auto' or 'auto:N'")
    return int(text)


@register_model("mhf")
class MhfHarnessLM(LM):
    def __init__(
        self,
        path: str,
        max_length: int | str | None = None,
        batch_size: int | str = 1,
        device: str | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = harness_batch_size(batch_size)
        if max_length is not None and (not str(max_length).isdigit() or int(max_length) < 2):
            raise ScoringError(f"max_length={max_length!r}; use an integer of at least 2 (ids read at once)")
        exported = load_exported(path)
        most = exported.config.backbone.max_position_embeddings
        self.max_length = min(DEFAULT_MAX_LENGTH, most) if max_length is None else int(max_length)
        check_positions(exported, self.max_length, "max_length is", f"pass max_length={most} or less")
        self.model = exported.model.eval()
        self.tokenizer = exported.tokenizer
        self.document_format = exported.document_format
        self.prefix_token_id = self.tokenizer.empty_context(self.document_format)[0]

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MhfHarnessLM:
        """As lm-eval's, but a `batch_size` (or `device`) in the model args wins over the command line's,
        which lm-eval always passes (its default would raise a duplicate-argument error)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> MhfHarnessLM:
        unknown = [name for name in arg_dict if name not in (*MODEL_ARGS, *RUNNER_ARGS)]
        if unknown:
            raise ScoringError(
                f"unknown model argument(s) {', '.join(map(repr, unknown))} of model mhf; its --model_args "
                f"are {', '.join(MODEL_ARGS)}"
            )
        if "path" not in arg_dict:
            raise ScoringError("model mhf needs --model_args path=DIR (an exported model directory)")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text])[0]

    def _context(self, ids: list[int]) -> list[int]:
        """A context as the model's documents start; an empty one is the prefix token."""
        framed = self.tokenizer.context_prefix(self.document_format) + ids
        return framed or [self.prefix_token_id]

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context:
            context_ids, continuation_ids = self.tokenizer.encode_pair(context, continuation)
        else:
            context_ids, continuation_ids = [], self._encode(continuation)
        return self._context(context_ids), continuation_ids

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        pairs = [self._pair(*request.args) for request in requests]
        return score_continuations(self.model, pairs, self.batch_size, self.max_length)

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """Each text's disjoint windows (lm-eval's), the windows of all texts batched together."""
        windows, owners = [], []
        for number, request in enumerate(requests):
            (text,) = request.args
            rolling = get_rolling_token_windows(
                self._encode(text), self.prefix_token_id, self.max_length, context_len=1
            )
            text_windows = [make_disjoint_window(window) for window in rolling]
            windows += text_windows
            owners += [number] * len(text_windows)
        totals = [0.0] * len(requests)
        scores = score_continuations(self.model, windows, self.batch_size)
        for owner, (logprob, _) in zip(owners, scores, strict=True):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Continuations decoded `batch_size` prompts at a time in lm-eval's Hugging Face model's order
        (grouped by gen kwargs, longest first), returned in the requests' order."""
        encoded = [(self._context(self._encode(r.args[0])), r.args[1]) for r in requests]  # (prompt, kwargs)
        order = Collator(encoded, sort_fn=lambda request: -len(request[0]), group_by="gen_kwargs")
        outputs = []
        for chunk in order.get_batched(n=self.batch_size):
            outputs += self._continuations([prompt for prompt, _ in chunk], chunk[0][1])
        return order.get_original(outputs)

    def _continuations(self, prompts: list[list[int]], gen_kwargs: dict[str, Any]) -> list[str]:
        """The prompts' continuations, decoded together; each stops at EOS, max_gen_toks or its first
        `until` string, which is cut off. A prompt loses its oldest ids to fit max_gen_toks in max_length."""
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        eos = self.tokenizer.decode([self.tokenizer.eos_id])
        until = [stop for stop in handle_stop_sequences(kwargs["until"], eos=eos) if stop]  # "" stops nothing
        room = self.max_length - kwargs["max_gen_toks"]
        if room < 1:
            raise ScoringError(
                f"max_gen_toks={kwargs['max_gen_toks']} leaves no room for a prompt in "
                f"max_length={self.max_length}; raise max_length or lower max_gen_toks"
            )
        prompts = [prompt[-room:] for prompt in prompts]
        # A continuation is decoded after the last few prompt ids (what its first characters depend on),
        # not after the whole prompt: checking `until` at every step stays O(new ids).
        tails = [prompt[-DECODE_CONTEXT:] for prompt in prompts]
        tail_chars = [len(self.tokenizer.decode(tail)) for tail in tails]

        def continuation(row: int, ids: list[int]) -> str:
            return self.tokenizer.decode(tails[row] + ids)[tail_chars[row] :]

        sampling = Sampling(
            temperature=float(kwargs.get("temperature", 0.0)),
            top_k=int(kwargs.get("top_k", 0)),
            top_p=float(kwargs.get("top_p", 1.0)),
        )
        new_ids = generate_batch(
            self.model,
            prompts,
            kwargs["max_gen_toks"],
            sampling,
            stop_ids=[self.tokenizer.eos_id],
            should_stop=lambda row, ids: any(stop in continuation(row, ids) for stop in until),
        )
        return [postprocess_generated_text(continuation(*row), until, None) for row in enumerate(new_ids)]


def cli() -> None:
    """`mhf-lm-eval`: lm-eval's command line with the `mhf` model registered."""
    with interrupts.running():
        try:
            _evaluate_in_one_line()
        # An interrupt, or a library's clean-up that failed as one unwound through it (as `mhf` says it).
        except (KeyboardInterrupt, Interrupted, Exception) as err:
            stop = as_interrupted(err)
            if stop is None:
                raise
            print(f"interrupted: {stop}", file=sys.stderr)
            sys.exit(stop.exit_code)


def _evaluate_in_one_line() -> None:
    """`_evaluate`, with a user's mistake as one `error:` line."""
    try:
        _evaluate()
    except MhfError as err:  # a bad batch size, a model that is not there: one line, as `mhf` prints it
        fail(str(err))
    except ValueError as err:  # lm-eval's own refusal of the task names, else not a user's mistake
        if str(err).startswith(NO_TASKS):
            fail(
                "no task given, or none found where --tasks points; pass --tasks NAME[,NAME...] (list "
                "them with `mhf-lm-eval ls tasks`)"
            )
        if not str(err).startswith(UNKNOWN_TASKS):
            raise
        fail(f"{err}; list them with `mhf-lm-eval ls tasks`, or pass --include_path DIR for your own")


def _evaluate() -> None:
    """lm-eval's `cli_evaluate`, with its argparse errors (a usage block) as one `error:` line. The
    parsers are HarnessCLI's private attributes: should they move, its own usage block is printed."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging(logging.WARNING)  # lm-eval's INFO lines only with LMEVAL_LOG_LEVEL=INFO, as `mhf --verbose`
    harness = HarnessCLI()
    commands = getattr(getattr(harness, "_subparsers", None), "choices", {})
    for parser in [getattr(harness, "_parser", None), *commands.values()]:
        if isinstance(parser, argparse.ArgumentParser):
            parser.error = _usage_error  # type: ignore[method-assign]
    harness.execute(harness.parse_args())


def _usage_error(message: str) -> NoReturn:
    fail(f"mhf-lm-eval: {message}; see `mhf-lm-eval --help`")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
