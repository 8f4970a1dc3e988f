"""The lm-evaluation-harness model `mhf`: any exported mhf-dist model, scored exactly.

Log-likelihoods come from the same code as `mhf eval` (continuations token by token over the whole
vocabulary through the KV cache; V_actl-renormalised for `mhf`), so both agree on the same data.

    mhf-lm-eval --model mhf --model_args path=runs/.../model --tasks hellaswag --include_path my_tasks/
    # or in Python, after `import mhf_dist.eval.harness`:
    lm_eval.simple_evaluate(model="mhf", model_args="path=...", tasks=[...])

Contexts follow the model's document format as lm-eval's Hugging Face model does with the tokenizer's
default special tokens: a `bos` model reads BOS before every context and as the empty context (the
prefix token of rolling windows); an `eos` model reads contexts as they are and EOS as the empty context.

`lm_eval` itself cannot discover models outside its source tree, so `mhf-lm-eval` is lm-eval's own
command line with this model registered. Needs `pip install 'mhf-dist[eval]'`.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mhf_dist.eval.tasks import continuation_logprob
from mhf_dist.export import load_exported
from mhf_dist.models.generation import generate


@register_model("mhf")
class MhfHarnessLM(LM):
    def __init__(self, path: str, max_length: int = 1024, **_: Any) -> None:  # batch_size, device: unused
        super().__init__()
        exported = load_exported(path)
        self.model = exported.model.eval()
        self.tokenizer = exported.tokenizer
        self.document_format = exported.document_format
        self.max_length = int(max_length)
        self.prefix_token_id = self.tokenizer.empty_context(self.document_format)[0]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text])[0]

    def _context(self, ids: list[int]) -> list[int]:
        """A context as the model's documents start: BOS first (`bos`); an empty one is the prefix token."""
        framed = self.tokenizer.context_prefix(self.document_format) + ids
        return framed or [self.prefix_token_id]

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        results = []
        for request in requests:
            context, continuation = request.args
            if context:
                context_ids, continuation_ids = self.tokenizer.encode_pair(context, continuation)
            else:
                context_ids, continuation_ids = [], self._encode(continuation)
            results.append(continuation_logprob(self.model, self._context(context_ids), continuation_ids))
        return results

    @torch.no_grad()
    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        results = []
        for request in requests:
            (text,) = request.args
            windows = get_rolling_token_windows(
                self._encode(text), self.prefix_token_id, self.max_length, context_len=1
            )
            total = 0.0
            for context, targets in map(make_disjoint_window, windows):
                ids = torch.tensor([context + targets])
                nll = self.model.token_nll(ids[:, :-1], ids[:, 1:])[0, -len(targets) :]
                total -= float(nll.double().sum())
            results.append(total)
        return results

    def generate_until(self, requests: list[Any]) -> list[str]:
        outputs = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            prompt = self._context(self._encode(context))
            ids = list(
                generate(
                    self.model, prompt, int(kwargs.get("max_gen_toks", 128)), stop_ids=[self.tokenizer.eos_id]
                )
            )
            text = self.tokenizer.decode(prompt + ids)[len(self.tokenizer.decode(prompt)) :]
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs


def cli() -> None:
    """`mhf-lm-eval`: lm-eval's command line with the `mhf` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
